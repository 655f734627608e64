"""The host side of a shell session (:meth:`runtimes.Runtime.shell`): one long ``exec`` of
the driver (:mod:`runtimes.shell.driver`) through the channel agent's bootstrap, fed its source
and then authenticated frames through an incremental stdin, read through ``on_output``
(:class:`~runtimes.shell.protocol.Link`), in a task group the session owns. See
``docs/shell.md``."""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Self

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..arguments import text_bytes
from ..errors import (
    ExecTimeoutError,
    OutputLimitExceededError,
    SandboxError,
    SandboxInvalidArgumentError,
    ShellSessionError,
)
from ..models import ExecResult, Stream
from . import protocol

if TYPE_CHECKING:
    from ..arguments import PathLike
    from ..base import Runtime

SESSION_STREAM_LIMIT = 1 << 62
"""The driver's exec is never capped as a whole: each ``run`` has its own cap."""
STDERR_TAIL = 4096
"""How much of the driver's own stderr is kept to explain a death."""
CLOSE_WAIT = 5.0
"""Seconds ``close()`` waits for the driver to clean up before the exec is killed."""
ANSWER_SLACK = 5.0
"""Seconds beyond the driver's own escalation (two grace periods) that an interrupt may take
before the host gives up on the driver and kills the session."""

_open: weakref.WeakKeyDictionary[Runtime, set[ShellSession]] = weakref.WeakKeyDictionary()


async def close_sessions(runtime: Runtime) -> None:
    """Close every session open on ``runtime`` (:meth:`Runtime.close` calls it first)."""
    for session in list(_open.pop(runtime, ())):
        await session.close()


@dataclass
class _Run:
    """One command in flight: its output (capped at ``limit``) and how it ended."""

    limit: int
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    done: anyio.Event = field(default_factory=anyio.Event)
    exit_code: int | None = None
    overflowed: bool = False

    def take(self, buffer: bytearray, data: bytes) -> bool:
        """Keep what fits under the cap; False once it is crossed."""
        room = self.limit - len(self.stdout) - len(self.stderr)
        buffer += data[: max(room, 0)]
        if len(data) > room and not self.overflowed:
            self.overflowed = True
            return False
        return True


class ShellSession:
    """A persistent ``bash`` in the sandbox; make one with :meth:`runtimes.Runtime.shell`
    and use it as ``async with rt.shell() as sh:``."""

    def __init__(
        self,
        runtime: Runtime,
        *,
        pty: bool = False,
        size: tuple[int, int] = (24, 80),
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        interrupt_grace: float = 2.0,
        start_timeout: float = 30.0,
    ) -> None:
        self._rows, self._cols = _check_size(size)
        self._grace = _check_seconds(interrupt_grace, "interrupt_grace", allow_zero=True)
        self._start_timeout = _check_seconds(start_timeout, "start_timeout")
        self._runtime = runtime
        self._pty = pty
        self._cwd = cwd
        self._env = env
        self._user = user
        self._send: MemoryObjectSendStream[bytes]
        self._receive: MemoryObjectReceiveStream[bytes]
        self._send, self._receive = anyio.create_memory_object_stream[bytes](math.inf)
        self._link = protocol.Link(pty=pty, rows=self._rows, cols=self._cols, grace=self._grace)
        self._lock = anyio.Lock()
        self._ready = anyio.Event()
        self._ready_or_dead = anyio.Event()
        self._start_error: SandboxInvalidArgumentError | None = None
        self._ended = anyio.Event()
        self._death: ShellSessionError | None = None
        self._current: _Run | None = None
        self._driver_stderr = bytearray()
        self._stack: AsyncExitStack | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._serve_scope = anyio.CancelScope(shield=True)
        """Around the driver's exec: the caller's cancellation must not kill the driver
        (that would skip its cleanup); ``close`` cancels it when the driver does not answer."""
        self._entered = False
        self._loop: anyio.lowlevel.EventLoopToken | None = None
        self.pid: int | None = None
        """The shell's process id in the sandbox, once it is ready."""

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        """Start the shell and wait until it is ready.

        Raises:
            ShellSessionError: no ``bash`` or ``python3`` in the sandbox, the shell did not
                become ready within ``start_timeout``, or the session was entered before.
        """
        if self._entered:
            raise ShellSessionError("a shell session can be entered only once")
        self._entered = True
        self._loop = anyio.lowlevel.current_token()
        stack = AsyncExitStack()
        self._task_group = await stack.enter_async_context(anyio.create_task_group())
        self._stack = stack
        try:
            self._task_group.start_soon(self._serve)
            with anyio.move_on_after(self._start_timeout):
                await self._ready_or_dead.wait()
        except BaseException:  # the caller was cancelled while the shell started
            await self.close()
            await stack.aclose()
            raise
        failure = self._start_failure()
        if failure is not None:
            await self.close()
            await stack.aclose()
            raise failure
        _open.setdefault(self._runtime, set()).add(self)
        return self

    def _start_failure(self) -> SandboxError | None:
        if self._start_error is not None:
            return self._start_error
        if self._death is None and not self._ready.is_set():
            self._die(f"the shell was not ready within {self._start_timeout}s")
        return None if self._death is None else self._dead()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
        if self._stack is not None:
            # the task group holds only _serve, which never raises: the block's own exception
            # goes on as it is (handing it to the task group would wrap it in a group)
            await self._stack.aclose()

    @property
    def alive(self) -> bool:
        """Whether ``run`` can be called: the shell is ready and the session not dead/closed."""
        return self._ready.is_set() and self._death is None

    async def close(self) -> None:
        """End the shell, every process it started (all of its session), and the driver.
        Idempotent; never raises (a driver that does not answer is killed with its exec)."""
        with anyio.CancelScope(shield=True):
            sessions = _open.get(self._runtime)
            if sessions is not None:
                sessions.discard(self)
            if self._death is None:
                self._death = ShellSessionError("the shell session is closed")
            if self._current is not None:
                self._current.done.set()
            if self._task_group is None or self._ended.is_set():
                return
            if anyio.lowlevel.current_token() != self._loop:
                return  # its event loop is gone (closing at exit): the sandbox goes with it
            self._send_frame(protocol.QUIT)
            self._send.close()
            with anyio.move_on_after(CLOSE_WAIT):
                await self._ended.wait()
            if not self._ended.is_set():
                self._serve_scope.cancel()

    # ---------------------------------------------------------------- commands

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        output_limit: int | None = None,
        input: bytes | str | None = None,
    ) -> ExecResult:
        """Run ``command`` (bash source: lines, pipes, heredocs) in the session's shell and
        wait for it; ``cd``, variables, functions and jobs persist to the next ``run``.

        Args:
            timeout: seconds; on expiry the command is interrupted (``SIGINT`` to its
                foreground group, ``SIGKILL`` after ``interrupt_grace``): the session lives.
            output_limit: cap on stdout + stderr, bytes (default: the runtime config's); a
                command going over it is interrupted the same way.
            input: bytes (or UTF-8 text) typed on the terminal once the command starts
                (``pty=True`` sessions only).

        Returns:
            The exit status (``130`` interrupted, ``128 + N`` killed by signal N) and the
            output, byte-exact (``pty``: everything the terminal wrote, in ``stdout``).

        Raises:
            ExecTimeoutError: ``timeout`` expired; the command was interrupted; the output
                so far is attached; the session is still usable.
            OutputLimitExceededError: the output went over the cap; the command was
                interrupted; the kept output is attached; the session is still usable.
            ShellSessionError: the session is dead (the shell exited, could not be
                interrupted, or the sandbox went away) or closed; raised again by every
                later ``run``.
            SandboxInvalidArgumentError: a NUL byte or a lone surrogate in ``command``, a bad
                ``timeout`` or ``output_limit``, ``input`` without ``pty``.

        Cancelling the awaiting task interrupts the command the same way (shielded), then
        lets the cancellation propagate.
        """
        script = _command_bytes(command)
        limit = self._run_limit(output_limit)
        if timeout is not None:
            _check_seconds(timeout, "timeout")
        typed = self._input_bytes(input)
        if self._death is not None:
            raise self._dead()
        async with self._lock:
            if self._death is not None or not self._ready.is_set():
                raise self._dead()
            return await self._run_locked(script, typed, limit, timeout)

    async def resize(self, rows: int, cols: int) -> None:
        """Set the terminal's size (``pty`` sessions); the foreground program gets
        ``SIGWINCH``.

        Raises:
            SandboxInvalidArgumentError: sizes outside 1..65535, or a session without ``pty``.
            ShellSessionError: the session is dead or closed.
        """
        rows, cols = _check_size((rows, cols))
        if not self._pty:
            raise SandboxInvalidArgumentError("resize needs a session opened with pty=True")
        if self._death is not None:
            raise self._dead()
        self._rows, self._cols = rows, cols
        self._send_frame(protocol.RESIZE, protocol.resize_payload(rows, cols))
        await anyio.lowlevel.checkpoint()

    async def _run_locked(
        self, script: bytes, typed: bytes, limit: int, timeout: float | None
    ) -> ExecResult:
        run = _Run(limit)
        self._current = run
        started = time.monotonic()
        timed_out = False
        try:
            self._send_frame(protocol.RUN, script)
            if typed:
                self._send_frame(protocol.INPUT, typed)
            with anyio.move_on_after(timeout) as scope:
                await run.done.wait()
            timed_out = scope.cancelled_caught
            if timed_out or run.overflowed:
                await self._interrupt(run)
        except BaseException:
            await self._interrupt(run)
            raise
        finally:
            self._current = None
        return self._outcome(run, timed_out, timeout, script, time.monotonic() - started)

    def _outcome(
        self, run: _Run, timed_out: bool, timeout: float | None, script: bytes, took: float
    ) -> ExecResult:
        out, err = bytes(run.stdout), bytes(run.stderr)
        if run.exit_code is None:
            dead = self._dead()
            raise ShellSessionError(dead.reason, out, err)
        if run.overflowed:
            raise OutputLimitExceededError(
                f"output of shell command {_preview(script)!r}",
                run.limit,
                stdout_bytes=out,
                stderr_bytes=err,
            )
        if timed_out:
            raise ExecTimeoutError(
                [script.decode("utf-8", "replace")],
                timeout,
                out,
                err,
                outcome="interrupted; the session is still usable",
            )
        return ExecResult(run.exit_code, out, err, took)

    async def _interrupt(self, run: _Run) -> None:
        """Interrupt ``run`` and wait for its end (shielded); a driver that does not answer
        in time takes the session down with it."""
        with anyio.CancelScope(shield=True):
            if run.done.is_set():
                return
            self._send_frame(protocol.INTERRUPT)
            with anyio.move_on_after(2 * max(self._grace, 1.0) + ANSWER_SLACK):
                await run.done.wait()
            if not run.done.is_set():
                self._die("the sandbox did not answer an interrupt; the session was killed")
                self._serve_scope.cancel()

    # ---------------------------------------------------------------- the driver

    async def _serve(self) -> None:
        """Run the driver until it ends; never raises into the user's block: a failure is
        the session's death, re-raised by ``run``."""
        reason = "the shell session's driver did not answer and was killed"
        try:
            with self._serve_scope:
                self._send.send_nowait(self._link.opening())
                result = await self._runtime.exec(
                    protocol.driver_command(),
                    stdin=self._receive,
                    on_output=self._on_output,
                    keep_output=False,
                    output_limit=SESSION_STREAM_LIMIT,
                    cwd=self._cwd,
                    env=self._env,
                    user=self._user,
                )
                reason = self._exit_reason(result.exit_code)
        except protocol.DriverProtocolError as exc:  # raised by _on_output: the exec was killed
            reason = f"the shell session's driver broke its protocol ({exc}); it was killed"
        except SandboxError as exc:
            if not self._ready.is_set():
                reason = f"the shell could not start: {exc}"
                if isinstance(exc, SandboxInvalidArgumentError):
                    self._start_error = exc
            else:
                reason = f"the shell session's process failed: {exc}"
        except Exception as exc:  # noqa: BLE001 -- recorded as the death, re-raised by run
            reason = f"the shell session failed unexpectedly: {exc!r}"
        finally:
            self._die(reason)
            self._ended.set()

    def _exit_reason(self, code: int) -> str:
        tail = self._driver_stderr.decode("utf-8", "replace").strip()
        if self._link.no_python or (code == 127 and not self._ready.is_set()):
            return "no python3 in the sandbox: a shell session needs it"
        detail = f": {tail[-500:]}" if tail else ""
        return f"the shell session's driver exited with status {code}{detail}"

    def _on_output(self, stream: Stream, chunk: bytes) -> None:
        if stream == "stderr":
            self._driver_stderr += chunk
            del self._driver_stderr[:-STDERR_TAIL]
            return
        reply, frames = self._link.feed(chunk)
        if reply:
            self._send_raw(reply)
        for kind, payload in frames:
            self._on_frame(kind, payload)

    def _on_frame(self, kind: int, payload: bytes) -> None:
        run = self._current
        if kind in (protocol.OUT, protocol.ERR):
            if run is not None and not run.done.is_set():
                buffer = run.stdout if kind == protocol.OUT else run.stderr
                if not run.take(buffer, payload):
                    self._send_frame(protocol.INTERRUPT)
        elif kind == protocol.END:
            if run is not None:
                run.exit_code = protocol.number(payload)
                run.done.set()
        elif kind == protocol.READY:
            self.pid = protocol.number(payload)
            self._ready.set()
            self._ready_or_dead.set()
        elif kind == protocol.DEAD:
            self._die(payload.decode("utf-8", "replace"))

    def _die(self, reason: str) -> None:
        """Record the session's death (the first reason wins) and wake whoever waits."""
        if self._death is None:
            self._death = ShellSessionError(reason)
        if self._current is not None:
            self._current.done.set()
        self._ready_or_dead.set()

    def _dead(self) -> ShellSessionError:
        death = self._death or ShellSessionError("the shell session is not open")
        return ShellSessionError(death.reason)

    def _send_frame(self, kind: int, payload: bytes = b"") -> None:
        data = self._link.seal(kind, payload)
        if data:
            self._send_raw(data)

    def _send_raw(self, data: bytes) -> None:
        # a driver that is gone has its end reported by _serve
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._send.send_nowait(data)

    def _run_limit(self, output_limit: int | None) -> int:
        limit = self._runtime.config.output_limit if output_limit is None else output_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise SandboxInvalidArgumentError(f"output_limit must be an int > 0, got {limit!r}")
        return limit

    def _input_bytes(self, typed: bytes | str | None) -> bytes:
        if typed is None:
            return b""
        if not self._pty:
            raise SandboxInvalidArgumentError("input= needs a session opened with pty=True")
        if isinstance(typed, str):
            return text_bytes(typed, "input")
        if isinstance(typed, bytes | bytearray | memoryview):
            return bytes(typed)
        raise SandboxInvalidArgumentError(f"input must be bytes or str, got {type(typed).__name__}")


def _command_bytes(command: str) -> bytes:
    if not isinstance(command, str):
        raise SandboxInvalidArgumentError(f"command must be str, got {type(command).__name__}")
    if "\0" in command:
        raise SandboxInvalidArgumentError(f"command contains a NUL byte: {command[:60]!r}")
    return text_bytes(command, "command")


def _check_size(size: tuple[int, int]) -> tuple[int, int]:
    try:
        rows, cols = size
    except (TypeError, ValueError):
        raise SandboxInvalidArgumentError(f"size must be (rows, cols), got {size!r}") from None
    for value in (rows, cols):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
            raise SandboxInvalidArgumentError(f"terminal sizes must be 1..65535, got {size!r}")
    return rows, cols


def _check_seconds(value: float, what: str, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise SandboxInvalidArgumentError(f"{what} must be a number of seconds, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or math.isinf(value):
        raise SandboxInvalidArgumentError(f"{what} must be finite and > 0, got {value!r}")
    return float(value)


def _preview(script: bytes, limit: int = 60) -> str:
    text = script.decode("utf-8", "replace")
    return text if len(text) <= limit else text[:limit] + "…"
