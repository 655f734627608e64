"""The blocking facade: the whole :class:`~runtimes.base.Runtime` API for synchronous code.

``with open_runtime_sync({"type": "docker"}) as rt: rt.exec(["make"])``. Each
:class:`SyncRuntime` runs one event loop on its own daemon thread (the *portal thread*,
an anyio :class:`~anyio.from_thread.BlockingPortal`) and every blocking method runs the
async method there, so calls from several threads run side by side in the sandbox.
Exceptions cross unchanged (the same typed objects); ``KeyboardInterrupt`` in the calling
thread cancels the call in flight (an exec's tree is killed) before it propagates; a
runtime left open at exit is closed through its portal by the exit backstop of
:mod:`runtimes.lifecycle`. See ``docs/sync.md``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, Self, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

from ._extract import Links
from .arguments import PathLike
from .base import Runtime
from .config import RuntimeConfig
from .errors import (
    SandboxInvalidArgumentError,
    SandboxUnavailableError,
    ShellSessionError,
)
from .lifecycle import State
from .listing import DEFAULT_MAX_ENTRIES, FileInfo
from .models import ExecResult, Stream
from .portal import (
    BlockingCallInEventLoopError,
    HeldContext,
    PortalThread,
    call_through,
    pulled_in_threads,
    refuse_inside_event_loop,
)
from .registry import open_runtime
from .routes import HostRoute, RouteKind

if TYPE_CHECKING:
    from .shell import ShellSession

__all__ = [
    "BlockingCallInEventLoopError",
    "SyncHostRoute",
    "SyncRuntime",
    "SyncShellSession",
    "open_runtime_sync",
]

log = logging.getLogger("runtimes")

P = ParamSpec("P")
T = TypeVar("T")
Files = list[FileInfo]
"""A listing (``list`` is a method's name inside :class:`SyncRuntime`)."""

BACKENDS = ("asyncio", "trio")

EXIT_CLOSE_TIMEOUT = 60.0
"""Seconds the exit backstop waits for ``close()`` through the portal before it falls back
to the backend's own synchronous teardown (a loop stuck in a user's ``on_output``)."""

_EXIT_STOP_TIMEOUT = 10.0

_Stdin = bytes | str | Iterable[bytes] | AsyncIterable[bytes] | None


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


def _async_stdin(stdin: _Stdin) -> bytes | str | AsyncIterable[bytes] | None:
    if (
        stdin is None
        or isinstance(stdin, bytes | bytearray | memoryview | str | AsyncIterable)
        or not isinstance(stdin, Iterable)
    ):
        return stdin  # type: ignore[return-value]  # the async API judges what it is
    return pulled_in_threads(stdin)


class SyncRuntime:
    """A :class:`~runtimes.base.Runtime` for synchronous code: the same methods, blocking.

    Each method runs its async namesake on this runtime's portal thread and raises what
    that raises (the same classes, the same attributes): see the async method's docstring
    for the errors. Safe to call from several threads at once (calls run concurrently);
    calling from a thread that runs an event loop raises
    :class:`BlockingCallInEventLoopError`. Public coroutine methods of a backend not
    listed here (Docker's ``host_port``) are reached through attribute access, blocking
    too; other attributes pass through as they are.
    """

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
        self._runtime = runtime
        self._backend = backend
        self._backend_options = dict(backend_options or {})
        self._loop: PortalThread | None = None
        self._lock = threading.Lock()  # start/close transitions
        self._backend_close_at_exit = runtime._close_at_exit

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
            # lifecycle's exit backstop closes live runtimes through _close_at_exit: this one
            # has to close on its own loop, then stop the thread.
            self._runtime._close_at_exit = self._close_at_exit  # type: ignore[method-assign]
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SyncRuntime {self.describe()} ({self._runtime.state.value})>"

    # ------------------------------------------------------------------ calls into the loop

    def _closed_error(self) -> SandboxUnavailableError:
        what = "was never started" if self._runtime.state == State.NEW else "is closed"
        return SandboxUnavailableError(f"{self.describe()} {what}")

    def _portal(self, what: str) -> BlockingPortal:
        """The running portal, refusing a caller inside an event loop.

        Raises:
            BlockingCallInEventLoopError: this thread runs an event loop.
            SandboxUnavailableError: never started, or closed.
        """
        refuse_inside_event_loop(what)
        loop = self._loop
        if loop is None:
            raise self._closed_error()
        return loop.portal

    def _call(self, func: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        portal = self._portal(getattr(func, "__name__", "call"))
        return call_through(portal, func, args, kwargs, self._closed_error)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._runtime, name)
        if not inspect.iscoroutinefunction(value):
            return value

        @functools.wraps(value)
        def blocking(*args: Any, **kwargs: Any) -> Any:
            return self._call(value, *args, **kwargs)

        return blocking

    # ------------------------------------------------------------------ state

    @property
    def runtime(self) -> Runtime:
        """The async runtime underneath (its coroutines run on the portal thread only)."""
        return self._runtime

    @property
    def workdir(self) -> str:
        """:attr:`Runtime.workdir` (raises SandboxUnavailableError unless open)."""
        return self._runtime.workdir

    @property
    def sandbox_id(self) -> str | None:
        """:attr:`Runtime.sandbox_id`."""
        return self._runtime.sandbox_id

    @property
    def state(self) -> State:
        """:attr:`Runtime.state`."""
        return self._runtime.state

    @property
    def closed(self) -> bool:
        """:attr:`Runtime.closed`."""
        return self._runtime.closed

    @property
    def policy_user(self) -> str | None:
        """:attr:`Runtime.policy_user`."""
        return self._runtime.policy_user

    def describe(self) -> str:
        """:meth:`Runtime.describe`."""
        return self._runtime.describe()

    def resolve_path(self, path: PathLike) -> str:
        """:meth:`Runtime.resolve_path` (raises SandboxInvalidArgumentError)."""
        return self._runtime.resolve_path(path)

    def host_routes(self) -> tuple[RouteKind, ...]:
        """:meth:`Runtime.host_routes`."""
        return self._runtime.host_routes()

    # ------------------------------------------------------------------ operations

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
        stdin: bytes | str | Iterable[bytes] | AsyncIterable[bytes] | None = None,
        user: str | None = None,
        output_limit: int | None = None,
        on_output: Callable[[Stream, bytes], object] | None = None,
        keep_output: bool = True,
        check: bool = False,
    ) -> ExecResult:
        """:meth:`Runtime.exec`, blocking. ``stdin`` may also be a plain iterable of bytes
        (each item pulled in a worker thread, so it may block waiting for input);
        ``on_output`` is called in the portal thread, not the caller's. A
        ``KeyboardInterrupt`` while it waits kills the tree, then propagates.

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

    def read(self, path: PathLike, *, max_bytes: int | None = None) -> bytes:
        """:meth:`Runtime.read`. Raises: as it does."""
        return self._call(self._runtime.read, path, max_bytes=max_bytes)

    def write(self, path: PathLike, data: bytes | str) -> None:
        """:meth:`Runtime.write`. Raises: as it does."""
        self._call(self._runtime.write, path, data)

    def exists(self, path: PathLike) -> bool:
        """:meth:`Runtime.exists`. Raises: as it does."""
        return self._call(self._runtime.exists, path)

    def stat(self, path: PathLike) -> FileInfo:
        """:meth:`Runtime.stat`. Raises: as it does."""
        return self._call(self._runtime.stat, path)

    def list(self, path: PathLike = ".", *, max_entries: int = DEFAULT_MAX_ENTRIES) -> Files:
        """:meth:`Runtime.list`. Raises: as it does."""
        return self._call(self._runtime.list, path, max_entries=max_entries)

    def glob(self, pattern: str, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> Files:
        """:meth:`Runtime.glob`. Raises: as it does."""
        return self._call(self._runtime.glob, pattern, max_entries=max_entries)

    def remove(self, path: PathLike, *, missing_ok: bool = False) -> None:
        """:meth:`Runtime.remove`. Raises: as it does."""
        self._call(self._runtime.remove, path, missing_ok=missing_ok)

    def upload(self, local: PathLike, remote: PathLike) -> None:
        """:meth:`Runtime.upload`. Raises: as it does."""
        self._call(self._runtime.upload, local, remote)

    def download(
        self,
        remote: PathLike,
        local: PathLike,
        *,
        skip_unsafe: bool = False,
        links: Links = "contained",
    ) -> None:
        """:meth:`Runtime.download`. Raises: as it does."""
        self._call(self._runtime.download, remote, local, skip_unsafe=skip_unsafe, links=links)

    def stop_processes(self) -> int:
        """:meth:`Runtime.stop_processes`. Raises: as it does."""
        return self._call(self._runtime.stop_processes)

    def prepare_policy_user(self) -> str | None:
        """:meth:`Runtime.prepare_policy_user`. Raises: as it does."""
        return self._call(self._runtime.prepare_policy_user)

    def plan_host_route(self, via: str | None = None) -> tuple[RouteKind, str]:
        """:meth:`Runtime.plan_host_route`. Raises: as it does."""
        return self._call(self._runtime.plan_host_route, via)

    def expose_host(self, port: int, *, via: str | None = None) -> SyncHostRoute:
        """:meth:`Runtime.expose_host`, the route with a blocking ``close()``.
        Raises: as it does."""
        return SyncHostRoute(self, self._call(self._runtime.expose_host, port, via=via))

    def shell(
        self,
        *,
        pty: bool = False,
        size: tuple[int, int] = (24, 80),
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        interrupt_grace: float = 2.0,
        start_timeout: float = 30.0,
    ) -> SyncShellSession:
        """:meth:`Runtime.shell`, to use as ``with rt.shell() as sh: sh.run("make")``.

        Raises:
            As :meth:`Runtime.shell` (on entering the block: ShellSessionError, ...).
        """

        async def make() -> ShellSession:
            return self._runtime.shell(
                pty=pty,
                size=size,
                cwd=cwd,
                env=env,
                user=user,
                interrupt_grace=interrupt_grace,
                start_timeout=start_timeout,
            )

        return SyncShellSession(self, self._call(make))


class SyncShellSession:
    """A :class:`~runtimes.shell.ShellSession` for synchronous code, from
    :meth:`SyncRuntime.shell`: ``with rt.shell() as sh: r = sh.run("cd src && make")``.

    The session lives in one task on the runtime's portal thread from ``__enter__`` to
    :meth:`close`; each method blocks on its async namesake and raises what it raises.
    A ``KeyboardInterrupt`` during :meth:`run` interrupts the command (the session stays
    usable), during ``__enter__`` cancels the start (the shell is ended), then propagates.
    """

    def __init__(self, owner: SyncRuntime, session: ShellSession):
        self._owner = owner
        self._session = session
        self._held: HeldContext[ShellSession] | None = None
        self._lock = threading.Lock()

    @property
    def session(self) -> ShellSession:
        """The async session underneath (its coroutines run on the portal thread only)."""
        return self._session

    @property
    def alive(self) -> bool:
        """Whether ``run`` can be called (``ShellSession.alive``)."""
        return self._session.alive

    @property
    def pid(self) -> int | None:
        """The shell's process id in the sandbox, once it is ready."""
        return self._session.pid

    def __enter__(self) -> Self:
        """Start the shell.

        Raises:
            As ``ShellSession.__aenter__``: ShellSessionError (no bash or python3, not
            ready in time, entered before); SandboxUnavailableError (the
            runtime is closed); BlockingCallInEventLoopError (in async code).
        """
        with self._lock:
            if self._held is not None:
                raise ShellSessionError("a shell session can be entered only once")
            held = HeldContext(self._owner._portal("shell"), self._session)
            held.enter()
            self._held = held
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        output_limit: int | None = None,
        input: bytes | str | None = None,
    ) -> ExecResult:
        """``ShellSession.run``, blocking: the command's output and exit code.

        Raises:
            As ``ShellSession.run``: ExecTimeoutError, OutputLimitExceededError (the
            command interrupted, the session usable), ShellSessionError (dead),
            SandboxInvalidArgumentError; BlockingCallInEventLoopError (in async code).
        """
        return self._call(
            self._session.run, command, timeout=timeout, output_limit=output_limit, input=input
        )

    def resize(self, rows: int, cols: int) -> None:
        """``ShellSession.resize`` (pty mode). Raises: as it does."""
        self._call(self._session.resize, rows, cols)

    def _call(self, func: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Through the runtime's portal; once the runtime is closed, the ShellSessionError
        the async session raises then."""
        try:
            return self._owner._call(func, *args, **kwargs)
        except SandboxUnavailableError as exc:
            if not self._owner.closed:
                raise
            raise ShellSessionError(f"the shell session is closed: {exc}") from exc

    def close(self) -> None:
        """End the shell (``ShellSession.close``); idempotent. A session whose runtime was
        closed is already gone.

        Raises:
            BlockingCallInEventLoopError: called in async code.
        """
        refuse_inside_event_loop("close")
        with self._lock:
            held, self._held = self._held, None
            if held is None:
                return
            held.exit()  # a no-op once the runtime's close() ended the session with it


class SyncHostRoute:
    """A :class:`~runtimes.routes.HostRoute` whose :meth:`close` blocks; usable as a
    context manager. ``via``, ``host``, ``port``, ``address``, ``url()``, ``lost()`` and
    ``check()`` are the route's own."""

    def __init__(self, owner: SyncRuntime, route: HostRoute):
        self._owner = owner
        self.route = route

    @property
    def via(self) -> RouteKind:
        return self.route.via

    @property
    def host(self) -> str:
        return self.route.host

    @property
    def port(self) -> int:
        return self.route.port

    @property
    def address(self) -> str:
        return self.route.address

    @property
    def closed(self) -> bool:
        return self.route.closed

    def url(self, path: str = "") -> str:
        return self.route.url(path)

    def lost(self) -> str | None:
        return self.route.lost()

    def check(self) -> None:
        """:meth:`HostRoute.check`. Raises: HostRouteError, as it does."""
        self.route.check()

    def close(self) -> None:
        """:meth:`HostRoute.close` (idempotent; the runtime's close ends it too).
        Raises: as it does."""
        if self.route.closed or self._owner.closed:
            return
        self._owner._call(self.route.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
