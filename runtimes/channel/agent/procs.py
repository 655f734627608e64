"""The sandbox's processes as the agent sees them in ``/proc``: read, never forked for.

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host.
"""

from __future__ import annotations

import contextlib
import os
import signal


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold anything):
    ``[0]`` is the state, ``[1]`` the parent, ``[3]`` the session, ``[19]`` the start time
    (clock ticks since boot). ``None``: the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].decode("ascii", "replace").split()
    return fields if len(fields) > 19 else None


def process_ids() -> list[int]:
    """Every process of the sandbox (thread-group leaders), as listed at this moment."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    return [int(name) for name in names if name.isdigit()]


def is_running(fields: list[str] | None) -> bool:
    """Whether a process (its :func:`proc_stat`) still exists as more than a zombie."""
    return fields is not None and fields[0] not in ("Z", "X", "x")


def container_command() -> int | None:
    """PID 1's first child, the sandbox's keep-alive: when it exits, ``docker-init`` (PID 1)
    exits and the kernel kills everything left, this agent included."""
    first: tuple[int, int] | None = None
    for pid in process_ids():
        fields = proc_stat(pid)
        if fields is None or fields[1] != "1":
            continue
        started = int(fields[19])
        if first is None or (started, pid) < first:
            first = (started, pid)
    return None if first is None else first[1]


def kill_running(exclude: set[int]) -> int | None:
    """SIGKILL every running process not in ``exclude``; one of them, or None if none ran."""
    found = None
    for pid in process_ids():
        if pid not in exclude and is_running(proc_stat(pid)):
            found = pid
            with contextlib.suppress(OSError):  # gone since the listing
                os.kill(pid, signal.SIGKILL)
    return found
