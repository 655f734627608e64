"""Commands on SSH exec channels: the arguments of the one exec wrapper
(:mod:`runtimes.wrapper`) each command runs under (with the ``prlimit`` prefix of the config's
limits), the pump that reads a command's two streams (taking the wrapper's report out of
stderr) while its stdin is fed, and the channel agent's transport (an exec channel with stdin
attached).
"""

from __future__ import annotations

import contextlib
import dataclasses
import posixpath
import shlex
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread

from ..arguments import text_bytes
from ..channel import ChannelTransport
from ..errors import ProvisioningError
from ..models import ExecRequest, OutputSink, StdinSource, Stream
from ..resources import MIB
from ..stdin_feed import feed_stdin
from ..sweep import MARK_VAR
from ..wrapper import ReportReader, wrapper_argv
from .client import CHUNK, answer_within
from .config import SSHConfig
from .faults import paramiko_failures

if TYPE_CHECKING:
    import paramiko


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the remote helpers, found once at start (a command's own PATH
    from ``env=`` must not decide whether the wrapper finds ``setsid``)."""

    setsid: str
    env: str
    runuser: str | None

    @property
    def dirs(self) -> list[str]:
        """The directories the wrapper takes its tools from, each tool's own first."""
        found = (self.setsid, self.env, self.runuser)
        return list(dict.fromkeys(posixpath.dirname(tool) for tool in found if tool))


def wrapped_argv(
    request: ExecRequest, nonce: str, mark: str, tools: Tools, run_as: str | None
) -> list[str]:
    """The argv that runs ``request`` under the one exec wrapper (``runtimes/scripts/exec.sh``):
    ``wait`` mode (the command in a session of its own, the wrapper waits), ``runuser`` for
    ``user=``, the tools from where setup found them, the runtime's mark in the env (the
    runtime's own bookkeeping commands too: a kill owed to one is guarded by it)."""
    marked = dataclasses.replace(request, env={**request.env, MARK_VAR: mark})
    return wrapper_argv(marked, nonce, mode="wait", user=run_as, switch="runuser", tools=tools.dirs)


def command_line(argv: Sequence[str]) -> bytes:
    """``argv`` as an exec request's command for the login shell, in the bytes the host sees
    (lone surrogates back to the bytes they stand for).

    Raises:
        SandboxInvalidArgumentError: a lone surrogate that stands for no byte.
    """
    return text_bytes(shlex.join(argv), "the command")


class _Wakeup(threading.Event):
    """The event paramiko's buffers accept (``set_event``), shared by stdout and stderr.

    The buffers call ``clear()`` when one of them runs dry, which would lose a wake-up
    for the other: that call does nothing here, the pump ``reset()`` s it itself before
    looking at both buffers.
    """

    def clear(self) -> None:
        pass

    def reset(self) -> None:
        super().clear()


class AgentTransport(ChannelTransport):
    """The SSH channel the channel agent runs on, for blocking use by the channel's threads."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel

    def recv(self) -> bytes:
        return self._channel.recv(CHUNK)

    def send(self, data: bytes) -> None:
        self._channel.sendall(data)

    def close(self) -> None:
        self._channel.close()

    def diagnostics(self) -> str:
        if not self._channel.recv_stderr_ready():
            return ""
        return self._channel.recv_stderr(4096).decode("utf-8", "replace").strip()[-500:]


def agent_command_line(mark: str, argv: Sequence[str]) -> str:
    """The agent's command for the login shell (``argv``:
    :func:`runtimes.channel.bootstrap.agent_command`); the runtime's mark lets close() find
    it."""
    return f"export {MARK_VAR}={shlex.quote(mark)}; exec {shlex.join(argv)}"


class RemoteCommand:
    """One exec channel. One pump thread reads both streams; the wrapper's report line is
    taken out of stderr by :attr:`reader` (``reader.preamble``: a login shell's noise before
    it; ``reader.held``: what came when the stream ended without one)."""

    def __init__(
        self,
        channel: paramiko.Channel,
        nonce: str,
        deliver: Callable[[Stream, bytes], bool],
        exited: Callable[[int], None] = lambda code: None,
    ):
        self.channel = channel
        self.reader = ReportReader(nonce)
        self._deliver = deliver
        self._exited = exited
        self._exit_told = False
        self.pgid: int | None = None
        self.exit_status: int | None = None
        self.failure: BaseException | None = None
        self.header_seen = threading.Event()
        self.started = False
        self.done = threading.Event()

    @property
    def finished(self) -> bool:
        return self.exit_status is not None and self.done.is_set()

    def pump(self, header_only: bool = False) -> None:
        """Feed both streams to the sink until EOF, then wait for the exit status.

        Stops early when the sink refuses more output, or (``header_only``) once the
        header is in.
        """
        self.started = True
        channel = self.channel
        wake = _Wakeup()
        try:
            channel.in_buffer.set_event(wake)
            channel.in_stderr_buffer.set_event(wake)
            while not (header_only and self.header_seen.is_set()):
                wake.reset()
                ended = channel.eof_received or channel.closed
                progressed = False
                if channel.recv_stderr_ready():
                    progressed = True
                    data = channel.recv_stderr(CHUNK)
                    if not self.header_seen.is_set():
                        data = self._take_header(data)
                    if data and not header_only and not self._deliver("stderr", data):
                        return
                if channel.recv_ready():
                    progressed = True
                    data = channel.recv(CHUNK)
                    if data and not header_only and not self._deliver("stdout", data):
                        return
                if progressed:
                    continue
                if ended:
                    self.header_seen.set()  # EOF: no header is coming any more
                    self.exit_status = channel.recv_exit_status()
                    return
                if not self._exit_told and channel.exit_status_ready():
                    # sshd tells the exit when the wrapper exits, before the pipes its
                    # background processes inherited close.
                    self._exit_told = True
                    if not header_only:
                        self._exited(channel.recv_exit_status())
                # The exit-status message sets no buffer event: look again soon for it.
                wake.wait(1.0 if self._exit_told else _EXIT_LOOK)
        except paramiko_failures() as exc:
            self.failure = exc
        finally:
            self.header_seen.set()
            self.done.set()

    def send_stdin(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            for offset in range(0, len(view), CHUNK):
                # paramiko's stub says bytes; any buffer works, and a view slices in O(1)
                # (sendall re-slices what it is given: a big bytes object is quadratic).
                self.channel.sendall(view[offset : offset + CHUNK])  # type: ignore[arg-type]
            self.channel.shutdown_write()
        except paramiko_failures():
            pass  # the command exited (or was killed) without reading all of its stdin

    def send_chunk(self, data: bytes) -> bool:
        """Send one chunk of an incremental stdin; ``False`` once the command no longer
        reads it (it exited, was killed, or closed its stdin)."""
        try:
            self.channel.sendall(data)
        except paramiko_failures():
            return False
        return True

    def close_stdin(self) -> None:
        with contextlib.suppress(*paramiko_failures()):
            self.channel.shutdown_write()

    def _take_header(self, data: bytes) -> bytes:
        rest = self.reader.feed(data)
        report = self.reader.report
        if report is not None:
            self.pgid = report.pgid
            self.header_seen.set()
        return rest


def limit_options(config: SSHConfig) -> list[str]:
    """``prlimit`` options for the config's limits (soft and hard alike, so a command cannot
    raise them again): ``memory`` as address space in bytes, ``pids_limit`` as processes of
    the user."""
    options = []
    if config.memory is not None:
        options.append(f"--as={config.memory * MIB}")
    if config.pids_limit is not None:
        options.append(f"--nproc={config.pids_limit}")
    return options


def limits_prefix(config: SSHConfig, prlimit: str | None, where: str) -> list[str]:
    """The argv prefix that runs a command under the config's limits ([] without any).

    Raises:
        ProvisioningError: limits are set and the host has no ``prlimit``.
    """
    options = limit_options(config)
    if not options:
        return []
    if prlimit is None:
        raise ProvisioningError(
            f"{where}: memory/pids_limit are set with prlimit, which the host does not have: "
            "install util-linux there or drop the limits"
        )
    return [prlimit, *options, "--"]


async def run_streams(
    remote: RemoteCommand,
    stdin: StdinSource | None,
    sink: OutputSink,
    limiter: anyio.CapacityLimiter | None,
) -> None:
    """Feed the command its stdin and pump both output streams into ``sink`` until they end
    (each blocking step on a worker thread under ``limiter``, abandoned on cancellation)."""

    async def in_thread(fn: Callable[..., None], *args: Any) -> None:
        await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True, limiter=limiter)

    async def send_chunk(data: bytes) -> bool:
        return await anyio.to_thread.run_sync(
            remote.send_chunk, data, abandon_on_cancel=True, limiter=limiter
        )

    async with anyio.create_task_group() as tg:
        if isinstance(stdin, bytes):
            if stdin:
                tg.start_soon(in_thread, remote.send_stdin, stdin)
        elif stdin is not None:
            close = partial(in_thread, remote.close_stdin)
            tg.start_soon(partial(feed_stdin, stdin, sink, send_chunk, close, size=CHUNK))
        await in_thread(remote.pump)
        if stdin is not None and not isinstance(stdin, bytes):
            tg.cancel_scope.cancel()  # the command ended: the iterable is not pulled on


def start_command(
    channel: paramiko.Channel, command: bytes, close_stdin: bool, timeout: float
) -> None:
    try:
        with answer_within(channel, timeout):
            channel.exec_command(command)
        if close_stdin:
            channel.shutdown_write()
    except BaseException:
        channel.close()
        raise


_EXIT_LOOK = 0.05
"""Seconds between looks for the exit-status message while the output is still open."""


def sink_exited(sink: OutputSink) -> Callable[[int], None]:
    """Tell the sink of the exit on the event loop thread."""

    def exited(code: int) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone
            anyio.from_thread.run_sync(sink.exited, code)

    return exited


def sink_feeder(sink: OutputSink) -> Callable[[Stream, bytes], bool]:
    """Feed the sink on the event loop thread (it may cancel the exec's scope)."""

    def feed(stream: Stream, data: bytes) -> bool:
        try:
            return anyio.from_thread.run_sync(sink.feed, stream, data)
        except RuntimeError:
            return False  # the event loop is gone: this call was abandoned long ago

    return feed
