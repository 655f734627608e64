"""paramiko's exception table: what each failure of a call on an SSH connection means.

paramiko types its failures by where they surface, not by cause: its own ``SSHException``
(a protocol or channel failure, also a refused global request), ``EOFError`` (a stream that
closed) and ``OSError`` (the socket's, or an SFTP status carrying its errno). The table below
says, for each, whether the connection failed or the server refused the one operation, and
:meth:`runtimes.ssh.connected.ConnectedRuntime._paramiko_calls` applies it at the boundary of
every call on a runtime's connection (the one-shot and handshake paths catch
:func:`paramiko_failures` and name their own error).
"""

from __future__ import annotations

import enum
import functools
from typing import Literal, NamedTuple

Request = Literal["channel", "global"]
"""What the call asked: a channel or SFTP request (exec, subsystem, a file operation), or a
global request on the transport (a port forward)."""


class Fault(enum.Enum):
    """What a paramiko failure means for the connection it happened on."""

    CONNECTION = "connection"
    """The connection failed: ``SandboxTransportError``, the connection marked broken (the
    next call reconnects)."""
    REFUSED = "refused"
    """The server refused this one operation: the call site's ``SandboxError``."""


class Row(NamedTuple):
    """One row of the table: a paramiko failure and its meaning per kind of request."""

    raised: type[BaseException]
    channel: Fault
    global_: Fault


@functools.cache
def paramiko_table() -> tuple[Row, ...]:
    """paramiko's exception table, first match wins, for a transport that is still up (on a
    dead one every failure is the connection's)."""
    import paramiko

    return (
        # A refused global request has no type of its own: SSHException("... denied").
        Row(paramiko.SSHException, Fault.CONNECTION, Fault.REFUSED),
        Row(EOFError, Fault.CONNECTION, Fault.CONNECTION),
        # answer_within() gave up waiting for the server.
        Row(TimeoutError, Fault.CONNECTION, Fault.CONNECTION),
        # An SFTP status (its errno) or a refused exec request.
        Row(OSError, Fault.REFUSED, Fault.CONNECTION),
    )


def paramiko_failures() -> tuple[type[BaseException], ...]:
    """Every class the table covers: what a call on a connection may raise when it fails."""
    return tuple(row.raised for row in paramiko_table())


def fault(exc: BaseException, request: Request, alive: bool) -> Fault:
    """What ``exc`` means for a ``request`` on a connection that is (``alive``) still up."""
    if alive:
        for row in paramiko_table():
            if isinstance(exc, row.raised):
                return row.channel if request == "channel" else row.global_
    return Fault.CONNECTION


def timed_out(exc: BaseException) -> bool:
    """Whether paramiko gave up waiting for an answer (it has no type of its own for an
    unanswered channel open)."""
    return isinstance(exc, TimeoutError) or str(exc).startswith("Timeout opening channel")
