"""The persistent channel: one long-lived stream to a small agent inside the sandbox.

Starting a process through a backend's own exec API costs a full API round trip (Docker's
``exec_create`` + ``exec_start`` + ``exec_inspect``: ~50 ms; an SSH channel; a Modal exec).
A :class:`Channel` pays that once per sandbox: it starts the agent
(:mod:`runtimes.channel.agent`, standard library only) over ONE exec stream with stdin
attached, sends the agent's source through that stream (so nothing is installed and no
request costs an extra round trip), and then multiplexes every exec, read, write, stat and
remove over it as binary frames. See ``docs/channel.md``.

Host side, per channel: one reader thread (blocking reads of the stream, frames parsed and
handed to the event loop in batches), one writer thread (frames queued by the event loop,
written in batches), and per request an anyio memory stream. It works the same under asyncio
and trio; a channel is bound to the event loop that started it.

:class:`ChannelSupervisor` is what a runtime holds: it starts the channel at ``start()``,
routes each call through it, and falls back to the backend's plain path when the sandbox has
no ``python3`` (probed once), when the channel died (restarted on the next call, at most
:data:`MAX_RESTARTS` times per :data:`RESTART_WINDOW` seconds), or when the agent cannot serve
a request (switching users without root). A request in flight on a channel that died is
retried through the plain path only when it is idempotent (read, exists); otherwise it fails
with :class:`~runtimes.errors.SandboxTransportError`, or
:class:`~runtimes.errors.SandboxUnavailableError` when the sandbox itself is gone.

The package: :mod:`.bootstrap` (how the agent starts), :mod:`.agent` (the agent, whose
:mod:`~.agent.wire` and :mod:`~.agent.stream` parts the host shares), :mod:`.protocol` (the
host's bounds, internal failures, the transport interface, the agent's errors as typed
errors), :mod:`.framing` (the authenticated frame stream), :mod:`.core` (:class:`Channel`:
the requests), :mod:`.relay` (relayed connections), :mod:`.hooks` (what a backend gives the
supervisor) and :mod:`.supervisor` (:class:`ChannelSupervisor`: routing, fallback, restart).
"""

from __future__ import annotations

from .bootstrap import BOOTSTRAP, PROBE, agent_command, agent_source
from .core import Channel
from .hooks import ABSENT, UNKNOWN, ChannelHooks, ChannelInfo, verify_by_reading
from .protocol import (
    CHUNK,
    FIRST_PROBE,
    INLINE,
    KILL_WAIT,
    MAX_BACKLOG,
    MAX_FRAME,
    MAX_RELAYED,
    MAX_RESTARTS,
    NEXT_PROBE,
    RELAY_CONNECT_TIMEOUT,
    RELAY_WINDOW,
    RESTART_WINDOW,
    START_TIMEOUT,
    WINDOW,
    ChannelLost,
    ChannelRefused,
    ChannelStalled,
    ChannelTransport,
    ChannelUnsupported,
    SandboxGone,
)
from .relay import RelayListener
from .supervisor import ChannelSupervisor

__all__ = [
    "ABSENT",
    "BOOTSTRAP",
    "CHUNK",
    "FIRST_PROBE",
    "INLINE",
    "KILL_WAIT",
    "MAX_BACKLOG",
    "MAX_FRAME",
    "MAX_RELAYED",
    "MAX_RESTARTS",
    "NEXT_PROBE",
    "PROBE",
    "RELAY_CONNECT_TIMEOUT",
    "RELAY_WINDOW",
    "RESTART_WINDOW",
    "START_TIMEOUT",
    "UNKNOWN",
    "WINDOW",
    "Channel",
    "ChannelHooks",
    "ChannelInfo",
    "ChannelLost",
    "ChannelRefused",
    "ChannelStalled",
    "ChannelSupervisor",
    "ChannelTransport",
    "ChannelUnsupported",
    "RelayListener",
    "SandboxGone",
    "agent_command",
    "agent_source",
    "verify_by_reading",
]
