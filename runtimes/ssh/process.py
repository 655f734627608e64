"""Commands on SSH exec channels: the arguments of the one exec wrapper
(:mod:`runtimes.wrapper`) each command runs under, the pump that reads a command's two
streams (taking the wrapper's report out of stderr), and the channel agent's transport (an
exec channel with stdin attached).
"""

from __future__ import annotations

import contextlib
import dataclasses
import posixpath
import shlex
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio.from_thread

from ..arguments import text_bytes
from ..channel import BOOTSTRAP, PROBE, ChannelTransport
from ..models import ExecRequest, OutputSink, Stream
from ..wrapper import ReportReader, wrapper_argv
from .client import _CHUNK, _answer_within

if TYPE_CHECKING:
    import paramiko

_MARKER_VAR = "VF_SANDBOX_ID"
"""The environment variable that marks every process of the sandbox (its directory's name)."""


@dataclass(frozen=True)
class _Tools:
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


def _wrapper_argv(
    request: ExecRequest, nonce: str, marker: str, tools: _Tools, run_as: str | None
) -> list[str]:
    """The argv that runs ``request`` under the one exec wrapper (``runtimes/scripts/exec.sh``):
    ``wait`` mode (the command in a session of its own, the wrapper waits), ``runuser`` for
    ``user=``, the tools from where setup found them, the sandbox's marker in the env."""
    marked = dataclasses.replace(request, env={**request.env, _MARKER_VAR: marker})
    return wrapper_argv(marked, nonce, mode="wait", user=run_as, switch="runuser", tools=tools.dirs)


def _command_line(argv: Sequence[str]) -> bytes:
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


class _AgentTransport(ChannelTransport):
    """The SSH channel the channel agent runs on, for blocking use by the channel's threads."""

    def __init__(self, channel: paramiko.Channel) -> None:
        self._channel = channel

    def recv(self) -> bytes:
        return self._channel.recv(_CHUNK)

    def send(self, data: bytes) -> None:
        self._channel.sendall(data)

    def close(self) -> None:
        self._channel.close()

    def diagnostics(self) -> str:
        if not self._channel.recv_stderr_ready():
            return ""
        return self._channel.recv_stderr(4096).decode("utf-8", "replace").strip()[-500:]


def _agent_command_line(marker: str, interpreter: str | None = None) -> str:
    """The agent's command for the login shell; the marker lets close() find it. Later
    starts run the interpreter pinned at the first one, by absolute path."""
    q = shlex.quote
    if interpreter is not None:
        return f"export {_MARKER_VAR}={q(marker)}; exec {q(interpreter)} -I -S -B -c {q(BOOTSTRAP)}"
    return f"export {_MARKER_VAR}={q(marker)}; exec sh -c {q(PROBE)} sh {q(BOOTSTRAP)}"


class _RemoteCommand:
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
        import paramiko

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
                    data = channel.recv_stderr(_CHUNK)
                    if not self.header_seen.is_set():
                        data = self._take_header(data)
                    if data and not header_only and not self._deliver("stderr", data):
                        return
                if channel.recv_ready():
                    progressed = True
                    data = channel.recv(_CHUNK)
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
        except (OSError, EOFError, paramiko.SSHException) as exc:
            self.failure = exc
        finally:
            self.header_seen.set()
            self.done.set()

    def send_stdin(self, data: bytes) -> None:
        import paramiko

        try:
            view = memoryview(data)
            for offset in range(0, len(view), _CHUNK):
                # paramiko's stub says bytes; any buffer works, and a view slices in O(1)
                # (sendall re-slices what it is given: a big bytes object is quadratic).
                self.channel.sendall(view[offset : offset + _CHUNK])  # type: ignore[arg-type]
            self.channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command exited (or was killed) without reading all of its stdin

    def send_chunk(self, data: bytes) -> bool:
        """Send one chunk of an incremental stdin; ``False`` once the command no longer
        reads it (it exited, was killed, or closed its stdin)."""
        import paramiko

        try:
            self.channel.sendall(data)
        except (OSError, EOFError, paramiko.SSHException):
            return False
        return True

    def close_stdin(self) -> None:
        import paramiko

        with contextlib.suppress(OSError, EOFError, paramiko.SSHException):
            self.channel.shutdown_write()

    def _take_header(self, data: bytes) -> bytes:
        rest = self.reader.feed(data)
        report = self.reader.report
        if report is not None:
            self.pgid = report.pgid
            self.header_seen.set()
        return rest


def _start_command(
    channel: paramiko.Channel, command: bytes, close_stdin: bool, timeout: float
) -> None:
    try:
        with _answer_within(channel, timeout):
            channel.exec_command(command)
        if close_stdin:
            channel.shutdown_write()
    except BaseException:
        channel.close()
        raise


_EXIT_LOOK = 0.05
"""Seconds between looks for the exit-status message while the output is still open."""


def _sink_exited(sink: OutputSink) -> Callable[[int], None]:
    """Tell the sink of the exit on the event loop thread."""

    def exited(code: int) -> None:
        with contextlib.suppress(RuntimeError):  # the event loop is gone
            anyio.from_thread.run_sync(sink.exited, code)

    return exited


def _sink_feeder(sink: OutputSink) -> Callable[[Stream, bytes], bool]:
    """Feed the sink on the event loop thread (it may cancel the exec's scope)."""

    def feed(stream: Stream, data: bytes) -> bool:
        try:
            return anyio.from_thread.run_sync(sink.feed, stream, data)
        except RuntimeError:
            return False  # the event loop is gone: this call was abandoned long ago

    return feed
