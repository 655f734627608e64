"""Blocking calls into an event loop that runs on its own thread (:mod:`runtimes.sync`).

:class:`PortalThread` is one event loop on a daemon thread, reached through an anyio
:class:`~anyio.from_thread.BlockingPortal`; :func:`call_through` awaits a coroutine there
from any other thread, cancelling it (and waiting for its cleanup) when the caller is
interrupted; :class:`HeldContext` holds an async context manager open there between two
blocking calls; :func:`refuse_inside_event_loop` keeps a thread that runs a loop from
blocking it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Generic, TypeVar, cast

import anyio
import anyio.to_thread
from anyio.from_thread import BlockingPortal

from .errors import (
    BlockingCallInEventLoopError,
    SandboxInvalidArgumentError,
    SandboxUnavailableError,
)

__all__ = [
    "BlockingCallInEventLoopError",
    "HeldContext",
    "PortalThread",
    "call_through",
    "pulled_in_threads",
    "refuse_inside_event_loop",
    "running_event_loop",
]

log = logging.getLogger("runtimes")

ABANDON_WAIT = 60.0
"""Seconds an interrupted caller waits for an abandoned entering to clean up (a portal that
never ran it would otherwise hold the caller forever)."""

T = TypeVar("T")


def running_event_loop() -> str | None:
    """The event loop library running in this thread, if any."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return None
        return "trio"
    return None


def refuse_inside_event_loop(what: str) -> None:
    """Raises BlockingCallInEventLoopError when this thread runs an event loop."""
    library = running_event_loop()
    if library is not None:
        raise BlockingCallInEventLoopError(
            f"SyncRuntime.{what}() blocks, and this thread is running a {library} event loop; "
            "use the async Runtime here, or call it from a worker thread"
        )


class PortalThread:
    """One event loop on a daemon thread, reached through a :class:`BlockingPortal`.

    Not :func:`anyio.from_thread.start_blocking_portal`: a runtime left open must not
    keep the interpreter from exiting, and the exit backstop needs a bounded stop."""

    def __init__(self, backend: str, backend_options: Mapping[str, Any], name: str):
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._main, args=(ready, backend, dict(backend_options)), name=name, daemon=True
        )
        self._thread.start()
        try:
            self.portal = ready.result()
        except (ImportError, LookupError) as exc:
            raise SandboxInvalidArgumentError(
                f"cannot run a {backend!r} event loop: {exc}"
            ) from exc

    @staticmethod
    def _main(
        ready: concurrent.futures.Future[BlockingPortal],
        backend: str,
        backend_options: dict[str, Any],
    ) -> None:
        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        try:
            anyio.run(serve, backend=backend, backend_options=backend_options)
        except BaseException as exc:  # handed to the thread that waits for it
            if not ready.done():
                ready.set_exception(exc)
            else:
                log.warning("the portal thread's event loop failed", exc_info=True)

    def stop(self, timeout: float | None = None) -> bool:
        """Cancel what still runs on the loop, end it and join the thread; whether it
        ended within ``timeout``."""
        try:
            self.portal.start_task_soon(self.portal.stop, True).result(timeout)
        except RuntimeError:
            pass  # already stopped
        except TimeoutError:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()


def call_through(
    portal: BlockingPortal,
    func: Callable[..., Awaitable[T]],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    closed: Callable[[], SandboxUnavailableError],
) -> T:
    """``await func(*args, **kwargs)`` on the portal's loop, blocking this thread.

    Interrupted here (``KeyboardInterrupt``), the call is cancelled and waited for (its
    cleanup, such as killing an exec's tree, is done) before the interrupt propagates."""
    finished = threading.Event()

    async def run() -> T:
        try:
            return await func(*args, **kwargs)
        finally:
            finished.set()

    try:
        future = portal.start_task_soon(run)
    except RuntimeError:  # the portal stopped: the runtime was closed meanwhile
        raise closed() from None
    try:
        return future.result()
    except concurrent.futures.CancelledError:  # the portal cancelled it: closing
        raise closed() from None
    except BaseException:
        if not future.done():
            future.cancel()
            finished.wait()
        raise


class HeldContext(Generic[T]):
    """``async with cm`` held open by one task on the portal's loop from :meth:`enter` to
    :meth:`exit` (anyio wants a task group entered and left by the same task)."""

    def __init__(self, portal: BlockingPortal, cm: AbstractAsyncContextManager[T]):
        self._portal = portal
        self._cm = cm
        self._entered: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._finished = threading.Event()
        self._leave: anyio.Event | None = None
        self._task: concurrent.futures.Future[None] | None = None
        self._abandon = threading.Lock()
        self._abandoned = False
        self._scope: anyio.CancelScope | None = None

    async def _hold(self) -> None:
        try:
            with anyio.CancelScope() as scope:
                with self._abandon:
                    self._scope = scope
                    if self._abandoned:
                        scope.cancel()
                leave = self._leave = anyio.Event()
                async with self._cm as value:
                    self._entered.set_result(value)
                    await leave.wait()
            if not self._entered.done():
                self._entered.cancel()
        except BaseException as exc:
            if not self._entered.done():
                self._entered.set_exception(exc)
            raise
        finally:
            self._finished.set()

    def enter(self) -> T:
        """Enter ``cm`` on the loop; what its ``__aenter__`` returns. Raises what that
        raises; interrupted here (``KeyboardInterrupt``, even before the portal confirmed
        it started the entering), the entering is cancelled and its cleanup waited for
        before the interrupt propagates."""
        try:
            self._task = self._portal.start_task_soon(self._hold)
            return self._entered.result()
        except BaseException:
            if not self._entered.done():
                self._cancel_entering()
            raise

    def _cancel_entering(self) -> None:
        with self._abandon:
            self._abandoned = True  # _hold cancels itself if it starts after this
            scope = self._scope
        if scope is not None:
            with contextlib.suppress(RuntimeError):  # the portal stopped: nothing runs
                self._portal.call(scope.cancel)
        self._finished.wait(ABANDON_WAIT)

    def exit(self) -> None:
        """Leave ``cm`` (its ``__aexit__`` runs on the loop) and wait for it; raises what
        that raises. Nothing to do once the portal stopped: its cancellation left the block."""
        if self._task is None or self._leave is None or not self._entered.done():
            return
        try:
            self._portal.call(self._leave.set)
        except RuntimeError:
            return  # the portal is stopped
        try:
            self._task.result()
        except concurrent.futures.CancelledError:
            return


async def pulled_in_threads(chunks: Iterable[bytes]) -> AsyncIterator[bytes]:
    """A blocking iterable as an async one: each ``next()`` in a worker thread, so a
    generator that waits (for input, a queue) never stalls the portal's loop."""
    iterator = iter(chunks)
    end = object()
    while True:
        chunk: object = await anyio.to_thread.run_sync(next, iterator, end, abandon_on_cancel=True)
        if chunk is end:
            return
        yield cast(bytes, chunk)  # what it really is, the async API checks
