"""Running one command as a local process group: output pumping, exit, kill, spawn errors."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
from collections.abc import AsyncIterable
from typing import IO

import anyio
import anyio.abc

from ..errors import (
    SandboxError,
)
from ..models import ExecRequest, OutputSink, Stream
from ..stdin_feed import feed_stdin, run_beside
from ..wrapper import report_error
from .config import READ_CHUNK
from .sweep import start_ticks


class ExitWatch:
    """Waits for a child's exit: readiness of a pidfd (Linux >= 5.3), else a worker thread.
    Kills the child's process group only while it is still the child's (:meth:`kill_group`)."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        self.pidfd: int | None = None
        self.leader_start = start_ticks(process.pid)
        """When the child (the leader of its process group) started, in clock ticks."""

    def kill_group(self) -> None:
        """SIGKILL the child's process group, unless its number now leads another one."""
        kill_group(self._process.pid, self.leader_start)

    def open_pidfd(self) -> int | None:
        """The child's pidfd (readable once it exited), ``None`` where there is none."""
        if self.pidfd is None:
            with contextlib.suppress(AttributeError, OSError):
                self.pidfd = os.pidfd_open(self._process.pid)
        return self.pidfd

    async def wait(self) -> int:
        process = self._process
        if (code := process.poll()) is not None:
            return code
        self.open_pidfd()
        if self.pidfd is None:
            return await anyio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
        while (code := process.poll()) is None:
            await anyio.wait_readable(self.pidfd)
        return code

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


HAS_EPOLL = hasattr(select, "epoll")
_EXIT_SPINS = 64
"""Polls of the exit status after the pipes closed before waiting on the event loop: the
kernel reports the exit microseconds after it closed the pipes."""


class EpollPump:
    """Feeds stdin, drains stdout and stderr and waits for the exit in ONE task (Linux).

    The pipes (non-blocking) share an epoll instance, and the event loop watches that
    instance's own fd: one registration per wait instead of one per pipe, and no task
    group. Output over the sink's cap stops the reading and kills the group. Once the pipes
    closed, the exit is polled for a few microseconds before the pidfd is waited for.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        stdin: bytes | None,
        sink: OutputSink,
        exit_watch: ExitWatch,
    ) -> None:
        assert process.stdout is not None and process.stderr is not None
        self._process = process
        self._sink = sink
        self._exit_watch = exit_watch
        self._epoll = select.epoll()
        self._outputs: dict[int, Stream] = {}
        for pipe, name in ((process.stdout, "stdout"), (process.stderr, "stderr")):
            self._watch(pipe.fileno(), select.EPOLLIN)
            self._outputs[pipe.fileno()] = name  # type: ignore[assignment]
        self._pending = memoryview(stdin or b"")
        self._stdin_fd: int | None = None
        if process.stdin is not None:
            self._stdin_fd = process.stdin.fileno()
            self._watch(self._stdin_fd, select.EPOLLOUT)
        # The exit is reported the moment it happens (the pipes may outlive it: background
        # processes inherited them), where a pidfd can be had.
        self._pidfd = exit_watch.open_pidfd()
        if self._pidfd is not None:
            self._epoll.register(self._pidfd, select.EPOLLIN)

    def _watch(self, fd: int, events: int) -> None:
        os.set_blocking(fd, False)
        self._epoll.register(fd, events)

    async def run(self) -> int:
        try:
            while self._outputs or self._stdin_fd is not None:
                await self._step()
        finally:
            self._epoll.close()
        for _ in range(_EXIT_SPINS):
            if (code := self._process.poll()) is not None:
                return code
            os.sched_yield()
        return await self._exit_watch.wait()

    async def _step(self) -> None:
        events = self._epoll.poll(0)
        if not events:
            await anyio.wait_readable(self._epoll.fileno())
            return
        for fd, _ in events:
            if fd == self._stdin_fd:
                self._feed()
            elif fd in self._outputs:
                self._read(fd)
            elif fd == self._pidfd and (code := self._process.poll()) is not None:
                self._epoll.unregister(fd)
                self._pidfd = None
                self._sink.exited(128 - code if code < 0 else code)

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        if not data:
            self._epoll.unregister(fd)
            del self._outputs[fd]
        elif not self._sink.feed(self._outputs[fd], data):
            for watched in self._outputs:
                self._epoll.unregister(watched)
            self._outputs.clear()
            self._exit_watch.kill_group()

    def _feed(self) -> None:
        assert self._stdin_fd is not None and self._process.stdin is not None
        try:
            written = os.write(self._stdin_fd, self._pending[:READ_CHUNK])
            self._pending = self._pending[written:]
        except BlockingIOError:
            return
        except OSError:  # EPIPE: the process exited or closed its stdin without reading it all
            self._pending = memoryview(b"")
        if not self._pending:
            self._epoll.unregister(self._stdin_fd)
            self._stdin_fd = None
            with contextlib.suppress(OSError):
                self._process.stdin.close()


async def feed_pipe(pipe: IO[bytes], data: bytes | None) -> None:
    fd = pipe.fileno()
    os.set_blocking(fd, False)
    view = memoryview(data or b"")
    try:
        while view:
            try:
                view = view[os.write(fd, view[:READ_CHUNK]) :]
            except BlockingIOError:
                await anyio.wait_writable(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the process exited or closed its stdin without reading everything
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


async def pump_with_stdin_source(
    process: subprocess.Popen[bytes],
    source: AsyncIterable[bytes],
    sink: OutputSink,
    exit_watch: ExitWatch,
) -> int:
    """Drain the output and wait for the exit while ``source`` feeds stdin chunk by chunk;
    the exit ends the feeding (the source is left unfinished)."""
    assert process.stdin is not None and process.stdout is not None
    assert process.stderr is not None
    stdin, stdout, stderr = process.stdin, process.stdout.fileno(), process.stderr.fileno()

    async def outputs_then_exit() -> int:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain_fd, stderr, sink, "stderr")
            tg.start_soon(report_exit, exit_watch, sink)
            await drain_fd(stdout, sink, "stdout")
        return await exit_watch.wait()

    return await run_beside(outputs_then_exit, lambda: _feed_stdin_source(stdin, source, sink))


async def _feed_stdin_source(
    pipe: IO[bytes], source: AsyncIterable[bytes], sink: OutputSink
) -> None:
    fd = pipe.fileno()
    os.set_blocking(fd, False)

    async def write(chunk: bytes) -> bool:
        view = memoryview(chunk)
        try:
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    await anyio.wait_writable(fd)
        except (BrokenPipeError, ConnectionResetError):
            return False  # the process exited or closed its stdin: stop, no error
        return True

    async def close() -> None:
        with contextlib.suppress(OSError):
            pipe.close()

    await feed_stdin(source, sink, write, close, size=READ_CHUNK)


async def drain_fd(fd: int, sink: OutputSink, name: Stream) -> None:
    os.set_blocking(fd, False)
    while True:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        if not data or not sink.feed(name, data):
            return


async def report_exit(exit_watch: ExitWatch, sink: OutputSink) -> None:
    """Tell the sink the command exited as soon as it does (its pipes may stay open)."""
    code = await exit_watch.wait()
    sink.exited(128 - code if code < 0 else code)


def kill_group(pgid: int, leader_start: int) -> None:
    """SIGKILL process group ``pgid``, the group of a command whose leader started at
    ``leader_start`` (clock ticks, ``/proc``), unless the number now leads another group.

    Once the leader was reaped and the group's last member exited, the kernel may give the
    number to a new process, which (``start_new_session``: every command here) leads a group
    of the same number: a kill by number would end an unrelated command (seen in the soak
    under load, a fresh command dying with 137). A living leader, its zombie, or any member
    still in the group keeps the number reserved, so the check holds until the kill."""
    now = start_ticks(pgid)
    if now != -1 and now != leader_start:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def spawn_error(exc: OSError, request: ExecRequest) -> SandboxError:
    """The typed error for a command ``Popen`` could not start: the child failed to enter
    ``cwd`` (the error names it) or to exec the program."""
    what = "cwd" if exc.filename == request.cwd else "prog"
    return report_error(exc.errno or 0, what, request, detail=exc.strerror)


# ---------------------------------------------------------------------- file helpers
