"""Commands as tasks of their own: ``exec`` returning when the command exits, and
background processes (:meth:`Runtime.spawn <runtimes.base.Runtime.spawn>`).

Every backend runs a command until its output ends, and output ends only when every process
holding the pipes closed them: a server started with ``&`` holds them for its whole life.
So the backend's run goes into a task of its own (:class:`Detached`), and the caller waits
for the command itself: backends report its exit on the sink (:meth:`OutputSink.exited
<runtimes.models.OutputSink.exited>`) as soon as they see it, output still written to the
pipes is taken for :data:`EXIT_GRACE` more, then the caller returns. The run goes on in its
task, reading and discarding, so the processes left behind neither block on a full pipe nor
die of ``SIGPIPE``; it ends when they close the pipes (they exited, ``stop_processes()``
killed them) or when the runtime closes. ``docs/processes.md`` has the user's side.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio

from .channel.agent.wire import EXIT_GRACE
from .errors import CommandFailedError, ExecTimeoutError, OutputLimitExceededError
from .models import ExecRequest, ExecResult, MiB, OutputSink, Stream

if TYPE_CHECKING:
    from .base import Runtime

log = logging.getLogger("runtimes")

T = TypeVar("T")


BACKGROUND_BUFFER = 1 * MiB
"""Default bytes a :class:`BackgroundProcess` keeps: of each stream's tail, and of chunks
not yet taken by ``async for``."""

UNCAPPED = 1 << 62
"""The output cap of a background process: its output is never kept whole, so never capped."""

__all__ = [
    "BACKGROUND_BUFFER",
    "EXIT_GRACE",
    "BackgroundProcess",
    "Detached",
    "background_processes",
    "close_processes",
    "run_command",
    "start_background",
]


class Detached(Generic[T]):
    """``fn()`` run in a task of its own on the running event loop (asyncio or trio), so it
    may outlive the caller that started it. :meth:`cancel` cancels it; :attr:`done` is set
    once it ended; :meth:`outcome` returns its value or raises its error."""

    def __init__(self, fn: Callable[[], Awaitable[T]], on_done: Callable[[], None]) -> None:
        self.scope = anyio.CancelScope()
        self.done = anyio.Event()
        self._fn = fn
        self._on_done = on_done
        self._value: T | None = None
        self._error: BaseException | None = None
        self._task: object = None
        self.sink: OutputSink | None = None
        """The output sink of the command it runs (detached before a kept sandbox's close)."""
        self.awaited = False
        """Whether a caller still waits for it (an ``exec`` in flight): closing the runtime
        leaves it to end as the backend's close ends its command, as before it had a task."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            import trio

            # As asyncio's create_task does, the task runs in a copy of the caller's context.
            trio.lowlevel.spawn_system_task(self._main, context=contextvars.copy_context())
        else:
            self._task = loop.create_task(
                self._main()
            )  # held: a task only weakly referenced may vanish

    async def _main(self) -> None:
        try:
            with self.scope:
                self._value = await self._fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to whoever awaits the outcome
            self._error = exc
        finally:
            self.done.set()
            self._on_done()

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` stopped it."""
        return self.scope.cancelled_caught

    def cancel(self) -> None:
        self.scope.cancel()

    def outcome(self) -> T:
        """The value ``fn`` returned (``None`` if it was cancelled); re-raises its error."""
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    async def stop(self) -> None:
        """Cancel it and wait until it ended (shielded: the kill is always awaited)."""
        self.cancel()
        with anyio.CancelScope(shield=True):
            await self.done.wait()


_runs: weakref.WeakKeyDictionary[Runtime, set[Detached[Any]]] = weakref.WeakKeyDictionary()
"""Per runtime, the runs still going on: commands whose caller returned while processes
they left still held their pipes, and background processes."""


def _track(runtime: Runtime, fn: Callable[[], Awaitable[T]]) -> Detached[T]:
    runs = _runs.setdefault(runtime, set())
    run: Detached[T] = Detached(fn, lambda: runs.discard(run))
    runs.add(run)
    return run


async def close_processes(runtime: Runtime, *, keep: bool = False) -> None:
    """End every run still going on in ``runtime`` (:meth:`Runtime.close` calls it): a
    backend kills the process tree of a command still running when its run is cancelled,
    never once the command exited and its caller returned (``sink.detached``). With
    ``keep`` (the sandbox outlives the runtime, processes and all) every sink is detached
    first, so nothing is killed."""
    for run in list(_runs.pop(runtime, ())):
        if run.awaited:
            continue
        if keep and run.sink is not None:
            run.sink.detach()
        await run.stop()
        if run.done.is_set() and not run.cancelled:
            try:
                run.outcome()
            except Exception:
                log.debug(
                    "a background run of %s ended in an error", runtime.describe(), exc_info=True
                )


def running_count(runtime: Runtime) -> int:
    """How many runs are still going on in ``runtime`` (tests, ``processes()``)."""
    return len(_runs.get(runtime, ()))


async def run_command(
    runtime: Runtime,
    request: ExecRequest,
    sink: OutputSink,
    timeout: float | None,
    run: Callable[[ExecRequest, OutputSink], Awaitable[int]],
    *,
    check: bool = False,
) -> ExecResult:
    """``exec``'s wait: ``run(request, sink)`` in a task of its own, the result once the
    command exited and its output ended or :data:`EXIT_GRACE` passed.

    Raises:
        ExecTimeoutError: ``timeout`` expired while the command ran; the tree was killed.
        OutputLimitExceededError: output went over the cap; the tree was killed.
        CommandFailedError: ``check`` and a non-zero exit.
        SandboxError: whatever ``run`` raised (typed).
    """
    started = time.monotonic()
    wake = anyio.Event()
    task = _track(runtime, lambda: run(request, sink))  # starts at the next checkpoint
    task.awaited = True
    task.sink = sink

    def on_exit() -> None:
        task.scope.deadline = math.inf  # the timeout covers the command only
        wake.set()

    sink.on_exit = on_exit
    sink.on_overflow = task.cancel
    if timeout is not None:
        task.scope.deadline = anyio.current_time() + timeout
    try:
        await _first(wake, task.done)
        if not task.done.is_set():
            with anyio.move_on_after(EXIT_GRACE):
                await task.done.wait()
    except BaseException:
        await task.stop()  # the caller was cancelled: the backend kills the tree
        raise
    finally:
        task.awaited = False
    if not task.done.is_set():
        sink.detach()  # the run goes on, discarding, until the pipes close or close()
        assert sink.exit_code is not None
        code = sink.exit_code
    else:
        code = task.outcome()
    if sink.failure is not None:
        raise sink.failure
    if sink.overflowed:
        raise OutputLimitExceededError(
            f"output of {request.argv[0]!r}",
            request.output_limit,
            stdout_bytes=bytes(sink.stdout),
            stderr_bytes=bytes(sink.stderr),
        )
    if task.cancelled:
        raise ExecTimeoutError(list(request.argv), timeout, bytes(sink.stdout), bytes(sink.stderr))
    result = ExecResult(code, bytes(sink.stdout), bytes(sink.stderr), time.monotonic() - started)
    if check and code != 0:
        raise CommandFailedError(list(request.argv), result)
    return result


async def _first(wake: anyio.Event, done: anyio.Event) -> None:
    """Until ``wake`` or ``done`` is set, whichever comes first."""
    if done.is_set():
        return
    async with anyio.create_task_group() as tg:

        async def on_done() -> None:
            await done.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(on_done)
        await wake.wait()
        tg.cancel_scope.cancel()


class BackgroundProcess:
    """A command started by :meth:`Runtime.spawn <runtimes.base.Runtime.spawn>`, running
    while the caller goes on.

    Its output is taken as it comes: ``on_output`` (if given) sees every chunk; the last
    ``buffer`` bytes of each stream are kept for :meth:`wait`'s result; and chunks wait for
    ``async for stream, chunk in proc`` in a queue of at most ``buffer`` bytes, the oldest
    dropped (counted in :attr:`dropped`) when nobody takes them. Host memory stays bounded
    however much it writes.
    """

    def __init__(
        self,
        runtime: Runtime,
        request: ExecRequest,
        run: Callable[[ExecRequest, OutputSink], Awaitable[int]],
        *,
        on_output: Callable[[Stream, bytes], object] | None,
        buffer: int,
    ) -> None:
        self.argv: list[str] = list(request.argv)
        self._buffer = buffer
        self._tails: dict[Stream, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}
        self._queue: deque[tuple[Stream, bytes]] = deque()
        self._queued = 0
        self.dropped = 0
        """Bytes dropped from the ``async for`` queue because nobody took them in time."""
        self._more = anyio.Event()
        self._user_output = on_output
        self._started = time.monotonic()
        self._killed = False
        self._sink = OutputSink(UNCAPPED, on_output=self._take, keep=False)
        self._exited = anyio.Event()
        self._sink.on_exit = self._on_exit
        self._task = _track(runtime, lambda: run(request, self._sink))
        self._sink.on_overflow = self._task.cancel
        self._task.sink = self._sink

    @property
    def pid(self) -> int | None:
        """The command's pid inside the sandbox (also its process group: it runs in a session
        of its own) once the backend reported it; ``None`` until then, or where the
        backend's path does not report it (see ``docs/processes.md``)."""
        return self._sink.pid

    @property
    def exit_code(self) -> int | None:
        """The exit status once the command exited (``128 + N``: killed by signal N)."""
        if self._sink.exit_code is not None:
            return self._sink.exit_code
        if self._task.done.is_set():
            return 137 if self._killed or self._task.cancelled else self._outcome_code()
        return None

    @property
    def running(self) -> bool:
        """Whether the command itself is still running (``False`` too for one that could
        not start: :meth:`wait` raises why)."""
        return self._sink.exit_code is None and not self._task.done.is_set()

    def _outcome_code(self) -> int | None:
        try:
            return self._task.outcome()
        except Exception:  # noqa: BLE001 -- reported by wait()
            return None

    def _on_exit(self) -> None:
        self._exited.set()
        self._more.set()

    def _take(self, stream: Stream, data: bytes) -> None:
        if self._user_output is not None:
            self._user_output(stream, data)  # an error stops the call (OutputSink.fail)
        tail = self._tails[stream]
        tail += data
        del tail[: max(0, len(tail) - self._buffer)]
        self._queue.append((stream, data))
        self._queued += len(data)
        while self._queued > self._buffer:  # the oldest bytes go (a chunk keeps its tail)
            kind, old = self._queue.popleft()
            cut = min(len(old), self._queued - self._buffer)
            if cut < len(old):
                self._queue.appendleft((kind, old[cut:]))
            self._queued -= cut
            self.dropped += cut
        self._more.set()

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """Wait for the command to exit (its background processes' output taken for
        :data:`EXIT_GRACE`, as ``exec`` does).

        Args:
            timeout: seconds to wait; the process goes on running when it expires.

        Returns:
            The exit status (``137`` after :meth:`kill`) and the last ``buffer`` bytes of
            each stream.

        Raises:
            ExecTimeoutError: ``timeout`` expired; the process still runs (``outcome`` says
                so) and the output so far is attached.
            SandboxError: the backend failed to run it (typed, as for ``exec``), or the
                ``on_output`` callback's error once the tree was killed.
        """
        with anyio.move_on_after(timeout) as scope:
            await _first(self._exited, self._task.done)
            if not self._task.done.is_set():
                with anyio.move_on_after(EXIT_GRACE):
                    await self._task.done.wait()
        if scope.cancelled_caught:
            raise ExecTimeoutError(
                self.argv,
                timeout,
                bytes(self._tails["stdout"]),
                bytes(self._tails["stderr"]),
                outcome="the process is still running",
            )
        if self._sink.failure is not None:
            raise self._sink.failure
        if self._task.done.is_set() and not self._task.cancelled:
            self._task.outcome()  # re-raises the backend's error
        code = self.exit_code
        return ExecResult(
            137 if code is None else code,
            bytes(self._tails["stdout"]),
            bytes(self._tails["stderr"]),
            time.monotonic() - self._started,
        )

    async def kill(self) -> None:
        """Kill the command's process tree (everything in its process group) and wait for
        it to go; a no-op once it ended.

        Raises:
            Nothing: a backend that cannot deliver the kill retries it before the runtime's
            next command (as for a timed-out ``exec``).
        """
        if not self._task.done.is_set():
            self._killed = self._sink.exit_code is None
        await self._task.stop()
        self._exited.set()
        self._more.set()

    def __aiter__(self) -> AsyncIterator[tuple[Stream, bytes]]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[tuple[Stream, bytes]]:
        """``(stream, chunk)`` as the command writes them, until it exited and its output
        ended (or :data:`EXIT_GRACE` after its exit)."""
        grace_end: float | None = None
        while True:
            while self._queue:
                stream, data = self._queue.popleft()
                self._queued -= len(data)
                yield stream, data
            if self._task.done.is_set():
                return
            if self._exited.is_set():
                grace_end = grace_end or anyio.current_time() + EXIT_GRACE
                if anyio.current_time() >= grace_end:
                    return
            self._more = anyio.Event()
            if self._queue:
                continue
            with anyio.move_on_after(
                math.inf if grace_end is None else max(0.0, grace_end - anyio.current_time())
            ):
                await _first(self._more, self._task.done)

    def __repr__(self) -> str:
        state = "running" if self.running else f"exited {self.exit_code}"
        return f"BackgroundProcess(argv={self.argv!r}, pid={self.pid}, {state})"


def background_processes(runtime: Runtime) -> list[BackgroundProcess]:
    """The background processes of ``runtime`` whose command still runs."""
    return [p for p in _handles.get(runtime, ()) if p.running]


_handles: weakref.WeakKeyDictionary[Runtime, list[BackgroundProcess]] = weakref.WeakKeyDictionary()


def start_background(
    runtime: Runtime,
    request: ExecRequest,
    run: Callable[[ExecRequest, OutputSink], Awaitable[int]],
    *,
    on_output: Callable[[Stream, bytes], object] | None,
    buffer: int,
) -> BackgroundProcess:
    """A :class:`BackgroundProcess` for ``request``, listed for ``runtime`` (handles whose
    command ended are dropped from the list as new ones come)."""
    handles = _handles.setdefault(runtime, [])
    handles[:] = [p for p in handles if p.running]
    process = BackgroundProcess(runtime, request, run, on_output=on_output, buffer=buffer)
    handles.append(process)
    return process
