"""The host's side of the channel protocol: its bounds, the failures the supervisor handles
(never seen by callers), the transport a backend supplies, and the agent's ``ERROR`` frames
as typed errors. The wire format itself is :mod:`runtimes.channel.agent.wire`, shared with
the agent."""

from __future__ import annotations

import abc

from ..errors import (
    OutputLimitExceededError,
    SandboxError,
    SandboxInvalidArgumentError,
    error_for_errno,
)
from ..models import ExecRequest
from ..wrapper import report_error
from .agent.wire import ErrorReport

CHUNK = 256 * 1024
"""Bytes of stdin or file content per frame."""
INLINE = 64 * 1024
"""Stdin or file content up to this size travels inside the request's own frame."""
WINDOW = 4 * 1024 * 1024
"""Unacknowledged stdin / write bytes per request: bounds the agent's memory."""
MAX_FRAME = 1024 * 1024
"""The longest frame the agent may send (its largest is a 256 KiB chunk): a header announcing
more is refused before anything of it is buffered, and the channel is dropped as tampered."""
MAX_BACKLOG = 16 * 1024 * 1024
"""Bytes received from the agent and not yet taken by their request: past this the reader
thread stops reading (the stream pushes back), so a flood cannot grow the host's memory."""
START_TIMEOUT = 20.0
"""Seconds for the agent to say hello after its stream opened."""
KILL_WAIT = 10.0
"""Seconds to wait for the agent to confirm a kill before the plain path kills instead."""
HALT_WAIT = 2.0
"""Seconds close() waits for the agent's HALT before it freezes the sandbox instead."""
FIRST_PROBE = 1.0
NEXT_PROBE = 5.0
"""A request that hears nothing for this long asks the backend whether the sandbox still runs
(a paused or stopped container never answers: it must not hang the caller)."""
MAX_RESTARTS = 3
RESTART_WINDOW = 60.0
RELAY_WINDOW = 256 * 1024
"""Unacknowledged bytes per relayed connection and direction: what either side may hold of
a connection whose reader is slow. Host memory for relays: at most this times 2 times
:data:`MAX_RELAYED` per channel."""
MAX_RELAYED = 32
"""Relayed connections open at once per listener; the agent closes more at once."""
RELAY_CONNECT_TIMEOUT = 10.0
"""Seconds for the host's service to accept a relayed connection."""


# ---------------------------------------------------------------------- failures (internal)


class ChannelLost(Exception):
    """The stream ended or broke while a request was in flight (``sent=False``: before
    anything of the request was sent, so it may safely take the plain path)."""

    def __init__(self, message: str, pgid: int | None = None, *, sent: bool = True) -> None:
        super().__init__(message)
        self.pgid = pgid
        self.sent = sent


class ChannelStalled(ChannelLost):
    """A file request heard nothing for the backend's I/O timeout: the channel is dropped."""


class ChannelRefused(Exception):
    """The agent cannot serve this request (nothing was started): use the plain path."""


class ChannelUnsupported(Exception):
    """The sandbox cannot run the agent (no python3 >= 3.8)."""


class SandboxGone(Exception):
    """The backend's liveness probe says the sandbox stopped while a request waited."""


# ---------------------------------------------------------------------- transports


class ChannelTransport(abc.ABC):
    """The byte stream to the agent's stdin and stdout. Blocking calls, from the channel's
    own threads: ``recv`` from the reader thread, ``send`` from the writer thread, ``close``
    from any thread (it must unblock a pending ``recv``)."""

    @abc.abstractmethod
    def recv(self) -> bytes:
        """The next bytes of the agent's stdout; ``b""`` once it ended."""

    @abc.abstractmethod
    def send(self, data: bytes) -> None:
        """Write to the agent's stdin. Raises ``OSError`` (or anything) when broken."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the stream (idempotent); the agent then kills what it runs and exits."""

    def try_send(self, data: bytes) -> int:
        """Write what can be written without blocking, from the event loop's thread; return
        how much. The default (0) sends everything through the writer thread."""
        return 0

    def diagnostics(self) -> str:
        """What the agent said on stderr (its last lines), for failure messages."""
        return ""


# ---------------------------------------------------------------------- the agent's errors


def exec_error(report: ErrorReport, request: ExecRequest) -> Exception:
    """The error an exec's ``ERROR`` frame (parsed: ``report``) stands for:
    :class:`ChannelRefused` (the plain path serves it), or the typed ``SandboxError`` every
    backend's wrapper report maps to (:func:`runtimes.wrapper.report_error`)."""
    if report.what == "unsupported":
        return ChannelRefused(report.message)
    if report.what == "internal":
        program = request.argv[0]
        return SandboxError(f"the channel agent could not run {program!r}: {report.message}")
    return report_error(report.num, report.what, request, detail=report.message)


def file_error(report: ErrorReport, path: str, limit: int) -> SandboxError:
    """The typed error a file request's ``ERROR`` frame (parsed: ``report``) stands for
    (``limit``: a read's)."""
    num, what, message = report.num, report.what, report.message
    if what == "internal":
        return SandboxError(f"the channel agent failed on {path!r}: {message}")
    if what == "special":
        return SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
    if what == "limit":
        return OutputLimitExceededError(f"read of {path!r}", limit, path=path)
    return error_for_errno(num, path, None)
