"""Telling an out-of-memory kill from a plain ``kill -9`` in a Docker sandbox.

A command that dies of SIGKILL exits 137 either way. When it does, the engine is asked
whether it logged an ``oom`` event for the container while the command ran: the kernel counts
each OOM kill in the container's memory cgroup (``memory.events`` ``oom_kill`` on cgroup v2,
``memory.oom_control`` on v1), containerd on the engine's host watches that counter, and the
engine logs one ``oom`` event per rise.

Why the engine's event log, not the counter read from inside the container: everything inside
may be hostile. An exec of ``cat /sys/fs/cgroup/memory.events`` runs the container's own
binaries (a root workload can replace them) and the channel agent is the workload's
neighbour; either could forge an OOM (turning a self-inflicted kill into an "infrastructure"
error) or hide one. The event log is written on the engine's side from the kernel's counter,
so only a real OOM kill in the container makes an event; and it answers the same way for a
local and a remote engine (``tcp://``, ``ssh://``), where the host's ``/sys/fs/cgroup`` is out
of reach.

Limits of this reading: the engine keeps its last 256 events, so on an engine logging more
than that in the seconds a check looks back over, an OOM can be missed (the 137 then stays a
result); and an OOM kill of another process of the same container during the command counts
too (the command died of SIGKILL while the limit was killing in its sandbox).
"""

from __future__ import annotations

import logging
import re
import time
from datetime import datetime
from typing import Any

import anyio

from ..errors import SandboxError
from ..resources import format_mib
from .client import ContainerRef, engine_call

__all__ = ["memory_kill_setting", "oom_killed_since"]

log = logging.getLogger("runtimes")

_LATE_EVENT = 0.5
"""Seconds to wait for an ``oom`` event logged just after the command's exit was seen."""
_CHECK_BOUND = 5.0
"""Seconds the whole check may take (it runs shielded from the caller's cancellation)."""


_FRACTION = re.compile(r"(\.\d{6})\d+")


async def memory_kill_setting(ref: ContainerRef, since: float) -> str | None:
    """For :meth:`~runtimes.primitives.Primitives._memory_kill`: the memory limit's setting
    (``"64MiB"``; ``""`` for an attached container's own limit) if the container's memory
    limit killed a process since ``time.monotonic()`` was ``since``, else ``None``.

    Never raises, and gives up after :data:`_CHECK_BOUND` seconds: when the engine cannot be
    asked, the command's 137 stays a result (and the failure is logged), rather than failing
    a command that finished.
    """
    killed: bool | None = None
    try:
        with anyio.move_on_after(_CHECK_BOUND):
            killed = await oom_killed_since(ref, since)
    except SandboxError as exc:
        log.warning("could not ask %s whether an exit 137 was an OOM kill: %s", ref.describe, exc)
        return None
    if killed is None:
        log.warning("%s did not say in time whether an exit 137 was an OOM kill", ref.describe)
    if not killed:
        return None
    memory = ref.config.memory
    return "" if memory is None else format_mib(memory)


async def oom_killed_since(ref: ContainerRef, since: float) -> bool:
    """Whether the engine logged an ``oom`` event for the container since ``time.monotonic()``
    was ``since`` (or within :data:`_LATE_EVENT` seconds from now) that no earlier check of
    this container took.

    The window is on the engine's clock: its time now, minus the time since ``since`` on
    ours, read after the engine answered (so the window starts no later than ``since``; the
    two clocks' offset does not matter). An event counts once: each check consumes the
    window up to the engine's time it read (or the event it found), so a ``kill -9`` right
    after an OOM kill is not blamed on the OOM before it even when the engine answered slowly.

    Raises:
        SandboxTransportError: the engine could not be reached.
    """

    def count() -> bool:
        now = _engine_time(ref.api.info())
        start = max(now - (time.monotonic() - since), _consumed.get(ref.id, 0.0))
        events = ref.api.events(
            since=f"{start:.9f}",
            until=f"{now + _LATE_EVENT:.9f}",
            filters={"type": ["container"], "container": [ref.id], "event": ["oom"]},
            decode=True,
        )
        try:
            for event in events:
                at = int(event.get("timeNano") or 0) / 1e9
                if at > start:
                    _consume(ref.id, max(now, at))
                    return True
        finally:
            events.close()
        _consume(ref.id, now)
        return False

    return await engine_call(count, ref.config, idempotent=True, abandon_on_cancel=True)


_consumed: dict[str, float] = {}
"""Container id -> the engine time up to which its ``oom`` events were taken by a check."""
_CONSUMED_KEPT = 4096


def _consume(container: str, upto: float) -> None:
    earlier = _consumed.pop(container, 0.0)  # re-inserted last: the dict's order is by use
    _consumed[container] = max(upto, earlier)
    while len(_consumed) > _CONSUMED_KEPT:  # the oldest-checked containers go first
        del _consumed[next(iter(_consumed))]


def _engine_time(info: dict[str, Any]) -> float:
    """The engine's clock (``SystemTime`` of ``/info``: RFC 3339 with nanoseconds) as a
    Unix timestamp, so the event window does not depend on the client's clock."""
    text = _FRACTION.sub(r"\1", str(info.get("SystemTime", "")).replace("Z", "+00:00"))
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return time.time()  # an engine that does not say: assume the clocks agree
