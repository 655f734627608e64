"""The sandbox's processes as the agent sees them in ``/proc``: read, never forked for.

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8. The subprocess backend's host sweep imports it too (with :mod:`.sweep`).
"""

from __future__ import annotations

import contextlib
import os
import signal


def proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (which may hold anything):
    ``[0]`` is the state, ``[1]`` the parent, ``[3]`` the session, ``[6]`` the kernel's flags,
    ``[19]`` the start time (clock ticks since boot). ``None``: the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2 :].decode("ascii", "replace").split()
    return fields if len(fields) > 19 else None


class ProcStat:
    """The fields of ``/proc/PID/stat`` a sweep reads."""

    __slots__ = ("flags", "pgid", "ppid", "sid", "start", "state")

    def __init__(self, fields: list[str]) -> None:
        self.state = fields[0]
        self.ppid = int(fields[1])
        self.pgid = int(fields[2])
        self.sid = int(fields[3])
        self.flags = int(fields[6])
        self.start = int(fields[19])


PF_EXITING = 0x4
"""The kernel's flag (``/proc/PID/stat``'s ninth field) of a process on its way out."""


def pending_signals(pid: int) -> set[int]:
    """The signals pending for process ``pid`` (``/proc/PID/status``: its own, ``SigPnd``,
    and its thread group's, ``ShdPnd``); empty when it is gone or unreadable."""
    found: set[int] = set()
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            for line in handle:
                if line.startswith((b"SigPnd:", b"ShdPnd:")):
                    mask = int(line.split()[1], 16)
                    found.update(n + 1 for n in range(mask.bit_length()) if mask >> n & 1)
    except (OSError, ValueError, IndexError):
        return set()
    return found


def dying(pid: int) -> bool:
    """Whether process ``pid`` is already on its way out: exiting, or with a ``SIGKILL``
    pending (sent, not yet acted on: a process dies when it next runs, which on a loaded
    machine may be a while). Neither can be undone, nor faked by the process itself."""
    st = process_stat(pid)
    if st is None:
        return False
    return bool(st.flags & PF_EXITING) or signal.SIGKILL in pending_signals(pid)


def process_stat(pid: int) -> ProcStat | None:
    """:func:`proc_stat`, parsed; ``None``: the process is gone (or its stat unreadable)."""
    fields = proc_stat(pid)
    try:
        return None if fields is None else ProcStat(fields)
    except ValueError:
        return None


def newest_first() -> list[tuple[int, int]]:
    """(pid, inode of ``/proc/PID``) of every process, the most recently allocated pid first:
    a fork loop's live generation is among the newest, and must be reached before it forks
    again and exits. Pids are allocated upwards from the last one (``/proc/loadavg``'s last
    field) and wrap. The inode tells a reused pid from the process once seen (procfs gives
    a new process a new entry). Raises OSError if ``/proc`` cannot be listed."""
    with os.scandir("/proc") as entries:
        pids = [(int(e.name), e.inode()) for e in entries if e.name.isdigit()]
    pids.sort(reverse=True)
    try:
        with open("/proc/loadavg", "rb") as handle:
            last = int(handle.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return pids
    return [p for p in pids if p[0] <= last] + [p for p in pids if p[0] > last]


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
