"""The channel: one agent, one stream, many concurrent requests (exec, read, write, stat,
remove, relay listeners), each a typed header and a conversation of frames."""

from __future__ import annotations

import logging
import struct
from collections.abc import AsyncIterable, Mapping
from dataclasses import dataclass, field

import anyio

from ..errors import (
    HostRouteError,
    OutputLimitExceededError,
    SandboxError,
    SandboxProcessLimitError,
)
from ..models import ExecRequest, OutputSink
from ..stdin_feed import feed_stdin, run_beside
from .agent import wire
from .agent.wire import (
    I32,
    U16,
    U32,
    ErrorReport,
    ExecHeader,
    ListenHeader,
    PathHeader,
    ReadHeader,
    SweepHeader,
    WriteHeader,
)
from .framing import LOST, Frame, FramedStream, PendingRequest
from .protocol import (
    CHUNK,
    FIRST_PROBE,
    INLINE,
    MAX_RELAYED,
    NEXT_PROBE,
    RELAY_WINDOW,
    WINDOW,
    ChannelLost,
    ChannelStalled,
    SandboxGone,
    exec_error,
    file_error,
)
from .relay import RelayListener

log = logging.getLogger("runtimes.channel")


OUTBOX_FRAMES = 32
"""Frames waiting for the stream above which an incremental stdin is not pulled on."""
OUTBOX_POLL = 0.001
"""Seconds between looks at a full outbox (only while the stream does not take frames)."""


@dataclass
class _ExecState:
    """What an exec's frames loop and its stdin feeder share."""

    data: memoryview
    sent: int
    in_flight: int = 0
    pgid: int | None = None
    finished: bool = False
    stdin_closed: bool = False
    window_opened: anyio.Event = field(default_factory=anyio.Event)
    started: anyio.Event = field(default_factory=anyio.Event)


class Channel(FramedStream):
    """One agent, one stream, many concurrent requests. Bound to the event loop that
    started it. Use through :class:`~runtimes.channel.supervisor.ChannelSupervisor`."""

    async def _next(self, request: PendingRequest, *, file: bool = False) -> Frame:
        """The request's next frame. A silence is met with the backend's liveness probe;
        a file request (never silent for long) fails after the stall timeout."""
        stall = self._stall_timeout if file else None
        waited = 0.0
        wait = FIRST_PROBE
        while True:
            step = wait if stall is None else min(wait, stall - waited)
            with anyio.move_on_after(step):
                return await self._receive(request)
            waited += step
            if stall is not None and waited >= stall:
                raise ChannelStalled(f"{self.label}: no answer for {stall:g}s")
            if self._probe_dead is not None and await self._probe_dead():
                raise SandboxGone(f"{self.label}: the sandbox stopped")
            wait = NEXT_PROBE

    def _malformed(self, what: str, pgid: int | None = None) -> ChannelLost:
        """A frame the real agent never sends, yet authenticated (sent with the key: the agent
        was replaced, or its memory read by root): the channel is tampered with, and the
        request fails with the error to raise (the supervisor types it)."""
        self._tamper(f"the agent sent a malformed {what}: it is not the agent the host started")
        return ChannelLost(f"{self.label}: {self.tampered}", pgid)

    def _number(
        self, kind: struct.Struct, payload: bytes, frame: str, pgid: int | None = None
    ) -> int:
        """The one number a ``STARTED``, ``EXIT``, ``ACK`` or ``DONE`` frame carries.

        Raises:
            ChannelLost: the payload is not exactly that number (the channel is tampered).
        """
        if len(payload) != kind.size:
            raise self._malformed(f"{frame} frame ({len(payload)} bytes, not {kind.size})", pgid)
        return int(kind.unpack(payload)[0])

    def _report(self, payload: bytes, pgid: int | None = None) -> ErrorReport:
        """An ``ERROR`` frame's report.

        Raises:
            ChannelLost: the payload is no report (the channel is tampered).
        """
        try:
            return ErrorReport.from_wire(payload)
        except (struct.error, ValueError, IndexError):
            raise self._malformed(f"ERROR frame ({len(payload)} bytes)", pgid) from None

    def _acked(self, in_flight: int, payload: bytes) -> int:
        """The window after an ``ACK``; one acknowledging more than was sent is a forgery."""
        in_flight -= self._number(U32, payload, "ACK")
        if in_flight < 0:
            self._tamper("the agent acknowledged bytes the host never sent")
        return in_flight

    def _send_more(self, rid: int, data: memoryview, sent: int, in_flight: int) -> tuple[int, int]:
        """Queue stdin / content frames while the window allows; EOF after the last."""
        total = len(data)
        while sent < total and in_flight < WINDOW:
            piece = data[sent : sent + CHUNK]
            self.send_frame(wire.DATA, rid, bytes(piece))
            sent += len(piece)
            in_flight += len(piece)
            if sent == total:
                self.send_frame(wire.EOF, rid)
        return sent, in_flight

    # ------------------------------------------------------------------ requests

    async def exec(self, request: ExecRequest, sink: OutputSink, env: Mapping[str, str]) -> int:
        """Run a command through the agent; on cancellation kill its group and confirm.

        A stdin given as an async iterable is sent as ``DATA`` frames as it yields, under
        the same window as bytes, then ``EOF``; the exit stops the pulling.

        Raises:
            ChannelRefused / ChannelLost / SandboxGone: for the supervisor to handle.
            SandboxError subclasses: the command could not start (typed, as documented on
                :meth:`runtimes.base.Runtime.exec`).
        """
        # The agent forwards at most the cap and the chunk that crossed it.
        pending = self._open(request.output_limit + wire.PIPE_CHUNK)
        stdin = request.stdin
        source: AsyncIterable[bytes] | None = None
        if stdin is None or isinstance(stdin, bytes):
            data = memoryview(stdin or b"")
        else:
            source, data = stdin, memoryview(b"")
        inline = data[:INLINE]
        header = ExecHeader(
            list(request.argv),
            request.cwd,
            {**request.env, **env},
            request.user,
            request.output_limit,
            has_stdin=bool(data) or source is not None,
            stdin_complete=source is None and len(inline) == len(data),
        ).to_wire()
        state = _ExecState(data, len(inline))
        try:
            self._send_with_header(wire.EXEC, pending.rid, header, inline)
            if source is None:
                return await self._exec_frames(pending, request, sink, state)
            return await run_beside(
                lambda: self._exec_frames(pending, request, sink, state),
                lambda: self._feed_stdin(pending.rid, source, sink, state),
            )
        except BaseException as exc:
            if not state.finished and not isinstance(exc, SandboxGone) and not sink.detached:
                with anyio.CancelScope(shield=True):
                    await self._kill(pending, state.pgid)
            raise
        finally:
            self.finish(pending)

    async def _exec_frames(
        self, pending: PendingRequest, request: ExecRequest, sink: OutputSink, state: _ExecState
    ) -> int:
        """The frames of a running exec until its exit (bytes stdin sent as the window
        allows)."""
        while True:
            state.sent, state.in_flight = self._send_more(
                pending.rid, state.data, state.sent, state.in_flight
            )
            kind, payload = await self._next(pending)
            if kind == wire.STDOUT:
                sink.feed("stdout", payload)
            elif kind == wire.STDERR:
                sink.feed("stderr", payload)
            elif kind == wire.ACK:
                state.in_flight = self._acked(state.in_flight, payload)
                state.window_opened.set()
            elif kind == wire.STARTED:
                state.pgid = sink.pid = self._number(U32, payload, "STARTED")
                state.started.set()
            elif kind == wire.STDIN_CLOSED:
                state.stdin_closed = True
                state.window_opened.set()
            elif kind == wire.EXIT:
                state.finished = True
                return self._number(I32, payload, "EXIT", state.pgid)
            elif kind == wire.ERROR:
                state.finished = True
                raise _exec_error(self._report(payload, state.pgid), request)
            elif kind == LOST:
                state.finished = True
                raise ChannelLost(f"{self.label}: the channel died during an exec", state.pgid)

    async def _feed_stdin(
        self, rid: int, source: AsyncIterable[bytes], sink: OutputSink, state: _ExecState
    ) -> None:
        """Send what ``source`` yields as ``DATA`` frames under the window, then ``EOF``.

        Nothing is pulled before the agent said the command started (``STARTED`` comes
        within milliseconds): an exec it refuses takes the plain path with the iterable
        untouched."""
        await state.started.wait()

        def backlogged() -> bool:
            return self._queued >= OUTBOX_FRAMES and self.usable

        async def write(chunk: bytes) -> bool:
            while state.in_flight >= WINDOW and not state.stdin_closed:
                state.window_opened = anyio.Event()
                await state.window_opened.wait()
            # An agent that acknowledges without reading its stream would have an endless
            # iterable pile up in the outbox: the stream itself must take the frames too.
            while backlogged() and not state.stdin_closed:  # noqa: ASYNC110 - a thread's count
                await anyio.sleep(OUTBOX_POLL)
            if state.stdin_closed or not self.usable:
                return False  # the command stopped reading, or the frames loop reports a loss
            self.send_frame(wire.DATA, rid, chunk)
            state.in_flight += len(chunk)
            return True

        async def close() -> None:
            if self.usable:
                self.send_frame(wire.EOF, rid)

        await feed_stdin(source, sink, write, close, size=CHUNK)

    async def _kill(self, pending: PendingRequest, pgid: int | None) -> None:
        """Kill the request's process group (timeout, output cap, cancellation).

        The agent kills it and confirms with the exit; when the channel died or the agent
        does not confirm in time, the backend's plain path kills the group instead.
        """
        if self.usable:
            self.send_frame(wire.KILL, pending.rid)
            with anyio.move_on_after(self._kill_wait):
                while True:
                    kind, payload = await self._receive(pending)
                    if kind == wire.STARTED:
                        try:
                            pgid = self._number(U32, payload, "STARTED")
                        except ChannelLost:
                            break  # tampered with: the plain path kills what it knows of
                    elif kind in (wire.EXIT, wire.ERROR):
                        return
                    elif kind == LOST:
                        break
        if pgid is None or self._kill_group is None:
            log.warning(
                "%s: a command may be left running (its kill was not confirmed)", self.label
            )
            return
        try:
            with anyio.move_on_after(self._kill_wait):
                await self._kill_group(pgid)
        except SandboxError as exc:
            log.warning("%s: could not kill process group %s: %s", self.label, pgid, exc)

    async def read(self, path: str, limit: int) -> bytes:
        """A file's bytes (``limit`` enforced by the agent).

        Raises:
            SandboxFileNotFoundError, SandboxIsADirectoryError, SandboxNotADirectoryError,
            SandboxPermissionError, OutputLimitExceededError: as for ``Runtime.read``.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        pending = self._open(limit)
        done = False
        try:
            self.send_frame(wire.READ, pending.rid, ReadHeader(path, limit).to_wire())
            parts: list[bytes] = []
            received = 0
            while True:
                kind, payload = await self._next(pending, file=True)
                if kind == wire.CHUNK:
                    received += len(payload)
                    if received > limit:
                        # The agent checks the cap before it sends: one that sends more is
                        # not the agent the host started. Nothing more is buffered.
                        parts.clear()
                        self._tamper(f"the agent sent more than the {limit} bytes a read allows")
                        raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
                    parts.append(payload)
                elif kind == wire.DONE:
                    done = True
                    return b"".join(parts)
                elif kind == wire.ERROR:
                    done = True
                    raise _file_error(self._report(payload), path, limit)
                elif kind == LOST:
                    done = True
                    raise ChannelLost(f"{self.label}: the channel died during a read")
        finally:
            if not done and self.usable:
                self.send_frame(wire.KILL, pending.rid)
            self.finish(pending)

    async def write(self, path: str, data: bytes) -> None:
        """Write a file (parents created), streamed under the window.

        Raises:
            SandboxIsADirectoryError, SandboxNotADirectoryError, SandboxPermissionError:
                as for ``Runtime.write``.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        pending = self._open()
        view = memoryview(data)
        inline = view[:INLINE]
        done = False
        try:
            complete = len(inline) == len(view)
            header = WriteHeader(path, complete).to_wire()
            self._send_with_header(wire.WRITE, pending.rid, header, inline)
            sent, in_flight = len(inline), 0
            while True:
                sent, in_flight = self._send_more(pending.rid, view, sent, in_flight)
                kind, payload = await self._next(pending, file=True)
                if kind == wire.ACK:
                    in_flight = self._acked(in_flight, payload)
                elif kind == wire.DONE:
                    done = True
                    return
                elif kind == wire.ERROR:
                    done = True
                    raise _file_error(self._report(payload), path, 0)
                elif kind == LOST:
                    done = True
                    raise ChannelLost(f"{self.label}: the channel died during a write")
        finally:
            if not done and self.usable:
                self.send_frame(wire.KILL, pending.rid)
            self.finish(pending)

    async def exists(self, path: str) -> bool:
        """Whether anything is at ``path`` (``lstat``).

        Raises:
            SandboxPermissionError: a parent cannot be searched.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        payload = await self._simple(wire.STAT, path)
        return payload == b"\x01"

    async def remove(self, path: str) -> None:
        """Remove a file, a link or a whole tree.

        Raises:
            SandboxFileNotFoundError, SandboxPermissionError: as for ``Runtime.remove``.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        await self._simple(wire.REMOVE, path)

    async def halt(self) -> None:
        """Have the agent SIGKILL every process it may signal but itself and PID 1.

        Raises:
            SandboxError: the agent could not (its ``kill(-1)`` failed, or a process outlived
                its SIGKILL: ``ETIMEDOUT``).
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        pending = self._open()
        try:
            self.send_frame(wire.HALT, pending.rid, b"")
            answer, payload = await self._next(pending, file=True)
            if answer == wire.ERROR:
                raise file_error(self._report(payload), "kill(-1)", 0)
            if answer != wire.DONE:
                raise ChannelLost(f"{self.label}: the channel died during a halt")
        finally:
            self.finish(pending)

    async def sweep(self, header: SweepHeader) -> int:
        """Have the agent stop the processes ``header`` selects (as ``scripts/sweep.sh``
        would), forking nothing; return how many it killed.

        Raises:
            SandboxError: the agent could not.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        pending = self._open()
        try:
            self.send_frame(wire.SWEEP, pending.rid, header.to_wire())
            # Not a file request: a sweep of a fork loop may take its time (bounded passes).
            answer, payload = await self._next(pending)
            if answer == wire.DONE:
                return self._number(U32, payload, "DONE")
            if answer == wire.ERROR:
                raise _file_error(self._report(payload), "stop_processes", 0)
            raise ChannelLost(f"{self.label}: the channel died during a sweep")
        finally:
            self.finish(pending)

    async def lstat(self, path: str, limit: int) -> wire.PathInfo:
        """What is at ``path`` (never following a link there); a regular file's first
        ``limit + 1`` bytes read through ``O_NOFOLLOW``.

        Raises:
            SandboxPermissionError: a parent cannot be searched, or the file not read.
            ChannelLost / SandboxGone: for the supervisor to handle (a malformed answer marks
                the channel tampered: the agent is ours, so only a forger sends one).
        """
        payload = await self._simple(wire.LSTAT, path, wire.ReadHeader(path, limit).to_wire())
        try:
            info = wire.PathInfo.from_wire(payload)
        except (ValueError, IndexError, struct.error, UnicodeDecodeError):
            raise self._malformed(f"LSTAT answer ({len(payload)} bytes)") from None
        if len(info.content) > limit + 1:
            raise self._malformed(f"LSTAT answer ({len(info.content)} bytes past a {limit} cap)")
        return info

    async def mkdir(self, path: str, mode: int, uid: int, gid: int) -> None:
        """Make one fresh directory (see :class:`~runtimes.channel.agent.wire.MkdirHeader`).

        Raises:
            SandboxError: something is at the path already (EEXIST), the parent is a
                link or missing (typed by errno), or the agent may not.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        await self._simple(wire.MKDIR, path, wire.MkdirHeader(path, mode, uid, gid).to_wire())

    async def _simple(self, kind: int, path: str, payload: bytes | None = None) -> bytes:
        pending = self._open()
        try:
            self.send_frame(
                kind, pending.rid, PathHeader(path).to_wire() if payload is None else payload
            )
            answer, payload = await self._next(pending, file=True)
            if answer == wire.DONE:
                return payload
            if answer == wire.ERROR:
                raise _file_error(self._report(payload), path, 0)
            raise ChannelLost(f"{self.label}: the channel died during a file operation")
        finally:
            self.finish(pending)

    async def listen(
        self, target: tuple[str, int], *, port: int = 0, max_connections: int = MAX_RELAYED
    ) -> RelayListener:
        """A TCP listener on the sandbox's loopback (``port``, 0: a free one) whose every
        connection is relayed over this channel to ``target`` on the host.

        Raises:
            HostRouteError: the agent could not listen (the port is taken...).
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        pending = self._open()
        listener = RelayListener(self, pending, target, max_connections)
        self.relay.add(listener)  # before LISTEN: OPENED may overtake its DONE
        ready = False
        try:
            header = ListenHeader(max_connections, RELAY_WINDOW, port)
            self.send_frame(wire.LISTEN, pending.rid, header.to_wire())
            kind, answer = await self._next(pending, file=True)
            if kind == wire.DONE:
                listener.sandbox_port = self._number(U16, answer, "DONE")
                ready = True
                return listener
            if kind == wire.ERROR:
                message = self._report(answer).message
                raise HostRouteError(
                    f"{self.label}: the agent cannot listen on 127.0.0.1:{port}: {message}",
                    via="channel",
                )
            raise ChannelLost(f"{self.label}: the channel died while the relay started")
        finally:
            if not ready:
                self.relay.remove(listener, "the relay never started")
                self.finish(pending)


# ---------------------------------------------------------------------- the agent's errors


def _process_limit(report: ErrorReport, program: str) -> SandboxProcessLimitError:
    """The agent could make no process (or thread) for ``program``: the process limit, whose
    value the agent read from the cgroup (``""``: unknown)."""
    setting = report.message if report.message.isdigit() else None
    return SandboxProcessLimitError(program, setting)


def _exec_error(report: ErrorReport, request: ExecRequest) -> Exception:
    """As :func:`~.protocol.exec_error`, with the process limit typed."""
    if report.what == "pids":
        return _process_limit(report, request.argv[0])
    return exec_error(report, request)


def _file_error(report: ErrorReport, path: str, limit: int) -> SandboxError:
    """As :func:`~.protocol.file_error`, with the process limit typed."""
    if report.what == "pids":
        return _process_limit(report, path)
    return file_error(report, path, limit)
