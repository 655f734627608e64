"""One blocking facade for any async object: :class:`Blocking`.

A facade wraps an async object (its *target*) and reaches it through an anyio
:class:`~anyio.from_thread.BlockingPortal` that a *root* facade owns (a
:class:`~runtimes.sync.SyncRuntime`, a ``SyncAgentSessionFactory``). Nothing of the target's
API is restated; attribute access decides:

- a coroutine method becomes a blocking method: it runs on the portal's loop
  (:func:`~runtimes.portal.call_through`: the same exception objects cross; a
  ``KeyboardInterrupt`` here cancels the call and waits for its cleanup);
- a plain method named in :attr:`Blocking.in_loop` (one that makes loop-bound objects,
  such as ``Runtime.shell``) is called on the loop too; any other plain method and any
  other attribute is the target's own, as it is;
- what comes back is wrapped by the table :attr:`Blocking.facades` (a type of result and
  the facade class for it: a runtime's shell session, a host route, a factory's agent
  session), and an async iterator that is not in the table becomes a blocking iterator;
- a target that is an async context manager becomes a blocking one: ``with facade:``
  holds its ``async with`` open in one task on the loop (:class:`~runtimes.portal.HeldContext`)
  until the block ends or :meth:`Blocking.close`; any other target's ``with`` block ends with
  :meth:`Blocking.close`, which then awaits the target's own ``close()``.

Every blocking call refuses a thread that runs an event loop
(:class:`~runtimes.errors.BlockingCallInEventLoopError`). A child facade calls through its
parent's portal; a root overrides :meth:`Blocking._portal` and :meth:`Blocking._closed_error`.

What a type checker sees of a facade is its *face*: a protocol that gives the blocking
signatures (:mod:`runtimes.sync_faces`), which the facade class inherits only while type
checking; :func:`face_only` is the body of each of its members.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, ClassVar, NoReturn, ParamSpec, Self, TypeVar

from anyio.from_thread import BlockingPortal

from .errors import SandboxInvalidArgumentError, SandboxUnavailableError
from .portal import HeldContext, call_through, refuse_inside_event_loop

__all__ = ["Blocking", "BlockingIterator", "face_only"]

P = ParamSpec("P")
T = TypeVar("T")


def face_only() -> NoReturn:
    """The body of a member of a facade's face (a protocol a facade class inherits only
    while type checking): never run, since at run time the facade answers the lookup.

    Raises:
        TypeError: always (a face's member called on an object that is not a facade).
    """
    raise TypeError("a blocking facade's face only types the facade; it has no behaviour")


class Blocking:
    """A blocking facade over the async object ``target``, reached through ``parent``'s
    portal (a root facade has no parent and owns the portal). See the module docstring
    for what attribute access turns into what."""

    facades: ClassVar[Mapping[type, type[Blocking]]] = {}
    """Results of these types come back wrapped in the facade class given (its ``parent``
    the facade that returned them)."""

    in_loop: ClassVar[frozenset[str]] = frozenset()
    """Plain (not ``async``) methods of the target that must run on the loop: they make
    objects bound to it (anyio locks and events)."""

    def __init__(self, target: Any, parent: Blocking | None = None) -> None:
        self._target = target
        self._parent = parent
        self._held: HeldContext[Any] | None = None
        self._entered = False
        self._held_lock = threading.Lock()

    # ------------------------------------------------------------------ the loop

    def _portal(self, what: str) -> BlockingPortal:
        """The running portal, refusing a caller inside an event loop.

        Raises:
            BlockingCallInEventLoopError: this thread runs an event loop.
            SandboxUnavailableError: the root facade is not open (never started, closed).
        """
        if self._parent is None:
            raise SandboxInvalidArgumentError(f"{type(self).__name__} has no portal of its own")
        return self._parent._portal(what)

    def _closed_error(self) -> SandboxUnavailableError:
        """What a call raises when the portal stopped under it (the root closed)."""
        if self._parent is None:
            return SandboxUnavailableError(f"{type(self).__name__} is closed")
        return self._parent._closed_error()

    def _call(self, func: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """``await func(*args, **kwargs)`` on the loop, blocking this thread."""
        portal = self._portal(getattr(func, "__name__", "call"))
        return call_through(portal, func, args, kwargs, self._closed_error)

    def _wrap(self, value: Any) -> Any:
        """``value`` in its facade from :attr:`facades`; an async iterator as a blocking one."""
        for kind, facade in self.facades.items():
            if isinstance(value, kind):
                return facade(value, self)
        if isinstance(value, AsyncIterator):
            return BlockingIterator(value, self)
        return value

    # ------------------------------------------------------------------ the target's API

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._target, name)
        if inspect.iscoroutinefunction(value):

            @functools.wraps(value)
            def blocking(*args: Any, **kwargs: Any) -> Any:
                return self._wrap(self._call(value, *args, **kwargs))

            return blocking
        if name in self.in_loop and callable(value):

            @functools.wraps(value)
            def on_loop(*args: Any, **kwargs: Any) -> Any:
                async def call() -> Any:
                    return value(*args, **kwargs)

                call.__name__ = name
                return self._wrap(self._call(call))

            return on_loop
        return self._wrap(value) if not callable(value) else value

    # ------------------------------------------------------------------ with blocks

    def _reentered_error(self) -> Exception:
        """What entering the facade's ``with`` block a second time raises."""
        return SandboxInvalidArgumentError(f"a {type(self).__name__} can be entered only once")

    def __enter__(self) -> Self:
        """An async context manager target: its ``async with`` entered on the loop, held
        there until :meth:`close`. Any other target: nothing to do.

        Raises:
            What the target's ``__aenter__`` raises; the error of :meth:`_reentered_error`
            on a second entering; BlockingCallInEventLoopError (in async code).
        """
        if not hasattr(self._target, "__aenter__"):
            return self
        with self._held_lock:
            if self._entered:
                raise self._reentered_error()
            held = HeldContext(self._portal("__enter__"), self._target)
            held.enter()
            self._held, self._entered = held, True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Leave the held ``async with`` (idempotent; nothing once the portal stopped), or,
        for a target that is not an async context manager, await its ``close()``.

        Raises:
            What the target's ``__aexit__`` or ``close()`` raises;
            BlockingCallInEventLoopError (in async code).
        """
        refuse_inside_event_loop("close")
        if hasattr(self._target, "__aenter__"):
            with self._held_lock:
                held, self._held = self._held, None
            if held is not None:
                held.exit()
            return
        self._call(self._target.close)


class BlockingIterator(Blocking, Iterator[Any]):
    """An async iterator as a blocking one: each ``next()`` awaits ``__anext__`` on the loop."""

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Any:
        iterator: AsyncIterator[Any] = self._target
        try:
            return self._wrap(self._call(iterator.__anext__))
        except StopAsyncIteration:
            raise StopIteration from None
