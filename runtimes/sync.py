"""The blocking facade for runtimes: the whole :class:`~runtimes.base.Runtime` API for
synchronous code.

``with open_runtime_sync({"type": "docker"}) as rt: rt.exec(["make"])``. Each
:class:`SyncRuntime` runs one event loop on its own daemon thread (the *portal thread*,
an anyio :class:`~anyio.from_thread.BlockingPortal`) and is the root of a generic
:class:`~runtimes.blocking.Blocking` facade: every coroutine method of the runtime is a
blocking method here, run on that loop, so calls from several threads run side by side in
the sandbox; what they return is wrapped by the table :attr:`SyncRuntime.facades` (a
shell session, a host route). Exceptions cross unchanged (the same typed objects);
``KeyboardInterrupt`` in the calling thread cancels the call in flight (an exec's tree is
killed) before it propagates; a runtime left open at exit is closed through its portal by
the exit backstop of :mod:`runtimes.lifecycle`. See ``docs/sync.md``.

Each facade's typed face (what a type checker and an editor see) is a protocol of
:mod:`runtimes.sync_faces`, inherited only while type checking.

The blocking API, each raising what its async namesake raises (see its docstring), plus
BlockingCallInEventLoopError in async code and SandboxUnavailableError before
:meth:`SyncRuntime.start` or after :meth:`SyncRuntime.close`:

- ``exec(argv, **options) -> ExecResult`` (``stdin`` may also be a plain iterable of bytes),
  ``read(path, *, max_bytes=None) -> bytes``, ``write(path, data) -> None``,
  ``exists(path) -> bool``, ``stat(path) -> FileInfo``, ``list(path=".") -> list[FileInfo]``,
  ``glob(pattern) -> list[FileInfo]``, ``remove(path, *, missing_ok=False) -> None``,
  ``upload(local, remote) -> None``, ``download(remote, local, **options) -> None``,
  ``stop_processes() -> int``, ``prepare_policy_user() -> str | None``,
  ``plan_host_route(via=None) -> tuple[RouteKind, str]``, ``alive() -> bool`` and any
  other coroutine method of the backend (Docker's ``host_port``);
- ``expose_host(port, *, via=None) -> SyncHostRoute``; ``shell(**options) -> SyncShellSession``;
- as they are: ``workdir``, ``sandbox_id``, ``state``, ``closed``, ``policy_user``,
  ``describe()``, ``resolve_path()``, ``host_routes()`` and every other attribute.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import anyio
from anyio.from_thread import BlockingPortal

from .arguments import PathLike
from .base import Runtime
from .blocking import Blocking
from .config import RuntimeConfig
from .errors import SandboxInvalidArgumentError, SandboxUnavailableError, ShellSessionError
from .lifecycle import State
from .models import ExecResult, Stream
from .portal import (
    BlockingCallInEventLoopError,
    PortalThread,
    call_through,
    pulled_in_threads,
    refuse_inside_event_loop,
)
from .registry import open_runtime
from .routes import HostRoute
from .shell import ShellSession

if TYPE_CHECKING:
    from .sync_faces import HostRouteFace, RuntimeFace, ShellSessionFace, SyncStdin
else:  # at run time the faces' members would hide Blocking's lookup
    HostRouteFace = RuntimeFace = ShellSessionFace = object

__all__ = [
    "BlockingCallInEventLoopError",
    "SyncHostRoute",
    "SyncRuntime",
    "SyncShellSession",
    "open_runtime_sync",
]

log = logging.getLogger("runtimes")

BACKENDS = ("asyncio", "trio")

EXIT_CLOSE_TIMEOUT = 60.0
"""Seconds the exit backstop waits for ``close()`` through the portal before it falls back
to the backend's own synchronous teardown (a loop stuck in a user's ``on_output``)."""

_EXIT_STOP_TIMEOUT = 10.0


def open_runtime_sync(
    config: RuntimeConfig | Mapping[str, Any] | str,
    *,
    backend: str = "asyncio",
    backend_options: Mapping[str, Any] | None = None,
) -> SyncRuntime:
    """A blocking runtime for ``config``, not yet started: use it as
    ``with open_runtime_sync(...) as rt:`` (or call :meth:`SyncRuntime.start` and
    :meth:`SyncRuntime.close`). ``backend`` picks the portal thread's event loop
    (``"asyncio"`` or ``"trio"``), ``backend_options`` go to :func:`anyio.run`.

    Raises:
        RuntimeConfigError, UnknownRuntimeError, RuntimePluginError: as
            :func:`~runtimes.registry.open_runtime`.
        SandboxInvalidArgumentError: an unknown ``backend``.
    """
    return SyncRuntime(open_runtime(config), backend=backend, backend_options=backend_options)


def _async_stdin(stdin: SyncStdin) -> bytes | str | AsyncIterable[bytes] | None:
    if (
        stdin is None
        or isinstance(stdin, bytes | bytearray | memoryview | str | AsyncIterable)
        or not isinstance(stdin, Iterable)
    ):
        return stdin  # type: ignore[return-value]  # the async API judges what it is
    return pulled_in_threads(stdin)


class SyncShellSession(Blocking, ShellSessionFace):
    """A :class:`~runtimes.shell.ShellSession` for synchronous code, from
    :meth:`SyncRuntime.shell`: ``with rt.shell() as sh: r = sh.run("cd src && make")``.

    The session lives in one task on the runtime's portal thread from ``__enter__`` to
    :meth:`close` (idempotent; a session whose runtime was closed is already gone).
    ``run(command, *, timeout=None, output_limit=None, input=None) -> ExecResult`` and
    ``resize(rows, cols)`` block on their async namesakes and raise what they raise (a
    ShellSessionError once the runtime is closed); ``alive`` and ``pid`` are the
    session's. A ``KeyboardInterrupt`` during ``run`` interrupts the command (the session
    stays usable), during ``__enter__`` cancels the start (the shell is ended), then
    propagates.
    """

    @property
    def session(self) -> ShellSession:
        """The async session underneath (its coroutines run on the portal thread only)."""
        session: ShellSession = self._target
        return session

    def _reentered_error(self) -> Exception:
        return ShellSessionError("a shell session can be entered only once")

    def _call(self, func: Any, /, *args: Any, **kwargs: Any) -> Any:
        """Through the runtime's portal; once the runtime is closed, the ShellSessionError
        the async session raises then."""
        try:
            return super()._call(func, *args, **kwargs)
        except SandboxUnavailableError as exc:
            if not getattr(self._parent, "closed", False):
                raise
            raise ShellSessionError(f"the shell session is closed: {exc}") from exc


class SyncHostRoute(Blocking, HostRouteFace):
    """A :class:`~runtimes.routes.HostRoute` whose :meth:`close` blocks; usable as a
    context manager. ``via``, ``host``, ``port``, ``address``, ``closed``, ``url()``,
    ``lost()`` and ``check()`` are the route's own."""

    @property
    def route(self) -> HostRoute:
        """The async route underneath."""
        route: HostRoute = self._target
        return route

    def close(self) -> None:
        """:meth:`HostRoute.close` (idempotent; the runtime's close ends it too).
        Raises: as it does."""
        if self.route.closed or getattr(self._parent, "closed", False):
            return
        super().close()


class SyncRuntime(Blocking, RuntimeFace):
    """A :class:`~runtimes.base.Runtime` for synchronous code: the same API, blocking.

    The root of a :class:`~runtimes.blocking.Blocking` facade (the module docstring lists
    what it offers): each coroutine method runs its async namesake on this runtime's portal
    thread and raises what that raises (the same classes, the same attributes). Safe to
    call from several threads at once (calls run concurrently); calling from a thread that
    runs an event loop raises :class:`BlockingCallInEventLoopError`.
    """

    facades = {ShellSession: SyncShellSession, HostRoute: SyncHostRoute}
    in_loop = frozenset({"shell"})

    def __init__(
        self,
        runtime: Runtime,
        *,
        backend: str = "asyncio",
        backend_options: Mapping[str, Any] | None = None,
    ):
        if not isinstance(runtime, Runtime):
            raise SandboxInvalidArgumentError(
                f"SyncRuntime wraps a Runtime, not {type(runtime).__name__}"
            )
        if backend not in BACKENDS:
            raise SandboxInvalidArgumentError(
                f"unknown event loop backend {backend!r}: one of {', '.join(BACKENDS)}"
            )
        super().__init__(runtime)
        self._runtime = runtime
        self._backend = backend
        self._backend_options = dict(backend_options or {})
        self._loop: PortalThread | None = None
        self._lock = threading.Lock()  # start/close transitions
        self._backend_close_at_exit = runtime.close_at_exit

    @property
    def runtime(self) -> Runtime:
        """The async runtime underneath (its coroutines run on the portal thread only)."""
        return self._runtime

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Start the portal thread, then the sandbox: :meth:`Runtime.start`.

        Raises:
            As :meth:`Runtime.start`; BlockingCallInEventLoopError (in async code).
        """
        refuse_inside_event_loop("start")
        with self._lock:
            if self._loop is not None or self._runtime.state != State.NEW:
                raise SandboxUnavailableError(
                    f"{self.describe()} was already started ({self._runtime.state.value})"
                )
            name = f"vf-sandbox-portal-{self._runtime.name}-{id(self):x}"
            self._loop = loop = PortalThread(self._backend, self._backend_options, name)
            # lifecycle's exit backstop closes live runtimes through close_at_exit: this one
            # has to close on its own loop, then stop the thread.
            self._runtime.close_at_exit = self._close_at_exit  # type: ignore[method-assign]
            try:
                call_through(loop.portal, self._runtime.start, (), {}, self._closed_error)
            except BaseException:
                self._loop = None
                loop.stop()
                raise
        return self

    def close(self) -> None:
        """Close the sandbox (:meth:`Runtime.close`), then stop the portal thread. Calls
        other threads still have in flight end with it: their command dies with the
        sandbox, or they are cancelled and raise SandboxUnavailableError. Idempotent, and
        safe from several threads at once.

        Raises:
            As :meth:`Runtime.close`; BlockingCallInEventLoopError (in async code).
        """
        refuse_inside_event_loop("close")
        with self._lock:
            loop, self._loop = self._loop, None
            if loop is None:
                if self._runtime.state == State.NEW:
                    anyio.run(self._runtime.close, backend=self._backend)  # marks it closed
                return
            try:
                call_through(loop.portal, self._runtime.close, (), {}, self._closed_error)
            finally:
                loop.stop()

    def _close_at_exit(self) -> None:
        """The exit backstop for a runtime still open at exit: ``close()`` on its own loop,
        then the thread stopped; the backend's synchronous teardown if the loop does not
        answer within :data:`EXIT_CLOSE_TIMEOUT`."""
        locked = self._lock.acquire(timeout=_EXIT_STOP_TIMEOUT)
        if not locked:
            log.warning("atexit: %s is busy starting or closing", self.describe())
        try:
            loop, self._loop = self._loop, None
            if loop is None:
                self._backend_close_at_exit()
                return
            try:
                future = loop.portal.start_task_soon(self._runtime.close)
            except RuntimeError:
                self._backend_close_at_exit()
                return
            try:
                future.result(EXIT_CLOSE_TIMEOUT)
            except TimeoutError:
                if future.done():
                    raise  # close() itself timed out
                log.warning("atexit: %s did not close through its loop", self.describe())
                self._backend_close_at_exit()
                return  # the stuck loop's daemon thread ends with the interpreter
            finally:
                if future.done():
                    loop.stop(_EXIT_STOP_TIMEOUT)
        finally:
            if locked:
                self._lock.release()

    def __enter__(self) -> Self:
        return self.start()

    def __repr__(self) -> str:
        return f"<SyncRuntime {self.describe()} ({self._runtime.state.value})>"

    # ------------------------------------------------------------------ the loop

    def _closed_error(self) -> SandboxUnavailableError:
        what = "was never started" if self._runtime.state == State.NEW else "is closed"
        return SandboxUnavailableError(f"{self.describe()} {what}")

    def _portal(self, what: str) -> BlockingPortal:
        refuse_inside_event_loop(what)
        loop = self._loop
        if loop is None:
            raise self._closed_error()
        return loop.portal

    # ------------------------------------------------------------------ what differs

    def alive(self) -> bool:
        """:meth:`Runtime.alive`: ``False`` for a closed or never started runtime.

        Raises:
            As :meth:`Runtime.alive`; BlockingCallInEventLoopError (in async code).
        """
        refuse_inside_event_loop("alive")
        if self._loop is None:
            return False
        try:
            return self._call(self._runtime.alive)
        except SandboxUnavailableError:
            return False  # closed meanwhile

    def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        stdin: SyncStdin = None,
        user: str | None = None,
        output_limit: int | None = None,
        on_output: Callable[[Stream, bytes], object] | None = None,
        keep_output: bool = True,
        check: bool = False,
    ) -> ExecResult:
        """:meth:`Runtime.exec`, blocking, with its keyword arguments. ``stdin`` may also be
        a plain iterable of bytes (each item pulled in a worker thread, so it may block
        waiting for input); ``on_output`` is called in the portal thread, not the caller's.
        A ``KeyboardInterrupt`` while it waits kills the tree, then propagates.

        Raises:
            As :meth:`Runtime.exec`; BlockingCallInEventLoopError (in async code).
        """
        return self._call(
            self._runtime.exec,
            argv,
            timeout=timeout,
            cwd=cwd,
            env=env,
            stdin=_async_stdin(stdin),
            user=user,
            output_limit=output_limit,
            on_output=on_output,
            keep_output=keep_output,
            check=check,
        )
