"""The freeze-then-kill sweep of /proc for what a sandbox's commands left running, and the
sweep of dead sandboxes' directories (``vf-sandbox cleanup``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path

from .. import ownership
from ..models import SandboxInfo
from ..ownership import proc_stat_fields
from ..sweep import MARK_VAR
from .config import META_FILE
from .files import CreatedDir, remove_sandbox_dir

log = logging.getLogger("runtimes.subprocess")

SINCE_MARGIN_TICKS = 50
"""Clock ticks before the sandbox's creation from which a process may belong to it."""
_SWEEP_SECONDS = 10.0
"""How long the freezing passes may go on before the sweep kills what it has."""
_REAP_SECONDS = 3.0
"""How long a SIGKILLed process may take to die before it counts as a survivor."""
_SWEEP_ATTEMPTS = 3
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_DELETED = " (deleted)"


class SweepTarget:
    """What identifies one sandbox's processes on the host.

    ``mark``: the value of ``VF_SANDBOX_RUNTIME`` its commands carry; ``dirs``: its
    directories (real paths); ``sessions``: session id -> start (clock ticks since boot)
    of the leader each command was started as; ``since``: processes started before this
    (clock ticks since boot) are never the sandbox's.
    """

    def __init__(
        self, mark: str | None, dirs: tuple[str, ...], sessions: dict[int, int], since: int
    ) -> None:
        self.mark = f"{MARK_VAR}={mark}".encode() if mark else None
        self.dirs = dirs
        self.sessions = sessions
        self.since = since

    def holds(self, path: str) -> bool:
        if path.endswith(_DELETED):
            path = path[: -len(_DELETED)]
        return any(path == d or path.startswith(d + "/") for d in self.dirs)


class _Stat:
    __slots__ = ("pgid", "ppid", "sid", "start", "state")

    def __init__(self, state: str, ppid: int, pgid: int, sid: int, start: int) -> None:
        self.state = state
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid
        self.start = start


def boot_ticks() -> int:
    with open("/proc/uptime", "rb") as fh:
        return int(float(fh.read().split()[0]) * _CLK_TCK)


def _proc_stat(pid: int) -> _Stat | None:
    fields = proc_stat_fields(pid)
    if fields is None:
        return None
    try:
        return _Stat(
            fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
        )
    except (IndexError, ValueError):
        return None


def start_ticks(pid: int) -> int:
    st = _proc_stat(pid)
    return st.start if st is not None else -1


def real_dirs(*dirs: Path) -> tuple[str, ...]:
    return tuple(dict.fromkeys(os.path.realpath(d) for d in dirs))


def _protected() -> set[int]:
    """This process and its ancestors (and init): never signalled."""
    keep = {0, 1, os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in keep:
        keep.add(pid)
        st = _proc_stat(pid)
        if st is None:
            break
        pid = st.ppid
    return keep


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _environ_marks(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    prefix = MARK_VAR.encode() + b"="
    return [item for item in data.split(b"\0") if item.startswith(prefix)]


def _located_under(pid: int, target: SweepTarget, own_mnt: str | None) -> bool:
    """cwd, root, executable, an open file or a mapping under the sandbox's directories.
    Only in this process's mount namespace, where paths mean the same."""
    base = f"/proc/{pid}"
    if own_mnt is None or _readlink(f"{base}/ns/mnt") != own_mnt:
        return False
    for link in ("cwd", "root", "exe"):
        found = _readlink(f"{base}/{link}")
        if found is not None and target.holds(found):
            return True
    try:
        fds = os.listdir(f"{base}/fd")
    except OSError:
        fds = []
    for fd in fds:
        found = _readlink(f"{base}/fd/{fd}")
        if found is not None and found.startswith("/") and target.holds(found):
            return True
    try:
        with open(f"{base}/maps", "rb") as fh:
            maps = fh.read().decode("utf-8", "surrogateescape")
    except OSError:
        return False
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and target.holds(parts[5]):
            return True
    return False


_NOT_OURS, _DESCENDANT, _LOCATED = 0, 1, 2


def _belongs(pid: int, st: _Stat, target: SweepTarget, own_mnt: str | None) -> int:
    """``_DESCENDANT``: started by the sandbox (its mark, or a session one of its commands
    started); ``_LOCATED``: cwd, root, executable, open file or mapping in its directories;
    else ``_NOT_OURS``. Processes started before the sandbox, and zombies, are not ours.
    The cheapest sufficient test (the cwd, one syscall) comes first: a fork loop's
    generation lives for a moment only."""
    if st.start < target.since or st.state in ("Z", "X"):
        return _NOT_OURS
    cwd = _readlink(f"/proc/{pid}/cwd")
    if cwd is not None and target.holds(cwd) and _same_mnt(pid, own_mnt):
        return _LOCATED
    if _descends(pid, st, target):
        return _DESCENDANT
    return _LOCATED if _located_under(pid, target, own_mnt) else _NOT_OURS


def _same_mnt(pid: int, own_mnt: str | None) -> bool:
    return own_mnt is not None and _readlink(f"/proc/{pid}/ns/mnt") == own_mnt


def _descends(pid: int, st: _Stat, target: SweepTarget) -> bool:
    """Started by the sandbox: carries its mark, or is in a session one of its commands
    started (unless that session id was reused since: its leader alive but not the
    process we started, or the process marked as another sandbox's)."""
    marks = _environ_marks(pid)
    if marks and target.mark is not None and target.mark in marks:
        return True
    if st.sid in target.sessions and not marks:
        leader = _proc_stat(st.sid)
        if leader is None or leader.start == target.sessions[st.sid]:
            return True
    return False


def _pids_newest_first() -> list[tuple[int, int]]:
    """(pid, inode of /proc/<pid>), most recently allocated pid first: a fork loop's live
    generation is among the newest, and must be reached before it forks again and exits.
    Pids are allocated upwards from the last one (``/proc/loadavg``'s last field) and
    wrap. The inode tells a reused pid from the process once seen (procfs flushes a
    process's entry when it exits)."""
    with os.scandir("/proc") as it:
        pids = sorted(((int(e.name), e.inode()) for e in it if e.name.isdigit()), reverse=True)
    try:
        with open("/proc/loadavg", "rb") as fh:
            last = int(fh.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return pids
    return [p for p in pids if p[0] <= last] + [p for p in pids if p[0] > last]


_STARTS: dict[int, tuple[int, int]] = {}
"""pid -> (inode of /proc/<pid>, start in clock ticks since boot), kept across sweeps: a
process's start never changes, so each sweep reads the stat of new processes only."""


def _fresh_stat(pid: int, inode: int, since: int) -> _Stat | None:
    """The process's stat, or None if it is gone or started before ``since`` (known from
    the cache without reading anything)."""
    known = _STARTS.get(pid)
    if known is not None and known[0] == inode and known[1] < since:
        return None
    st = _proc_stat(pid)
    if st is not None:
        _STARTS[pid] = (inode, st.start)
        if st.start < since:
            return None
    return st


def _prune_starts(listing: list[tuple[int, int]]) -> None:
    if len(_STARTS) > 2 * len(listing) + 1024:
        live = dict(listing)
        for pid in list(_STARTS):
            if live.get(pid) != _STARTS.get(pid, (None,))[0]:
                _STARTS.pop(pid, None)


def _matching(target: SweepTarget, keep: set[int]) -> dict[int, _Stat]:
    own_mnt = _readlink("/proc/self/ns/mnt")
    found: dict[int, _Stat] = {}
    listing = _pids_newest_first()
    for pid, inode in listing:
        if pid in keep:
            continue
        st = _fresh_stat(pid, inode, target.since)
        if st is not None and _belongs(pid, st, target, own_mnt):
            found[pid] = st
    _prune_starts(listing)
    return found


_SENT, _GONE, _DENIED = "sent", "gone", "denied"


def _signal(pid: int, start: int, sig: signal.Signals) -> str:
    """Signal the process ``pid`` started at ``start`` through a pidfd, so a reused pid is
    never hit: ``_SENT``, ``_GONE`` (exited, or the pid is another process now) or
    ``_DENIED`` (another user's process, e.g. a set-user-ID program)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return _GONE
    try:
        now = _proc_stat(pid)
        if now is None or now.start != start:
            return _GONE
        signal.pidfd_send_signal(pidfd, sig)
        return _SENT
    except ProcessLookupError:
        return _GONE
    except PermissionError:
        return _DENIED
    finally:
        os.close(pidfd)


_QUIET_PASSES = 3
"""Consecutive passes that must find nothing new before the sweep kills what it froze."""


def sweep_target(target: SweepTarget) -> tuple[int, list[int]]:
    """Freeze-then-kill every process of ``target``; return (killed, survivors' pids).

    Each pass walks /proc newest pid first and SIGSTOPs every matching process at once
    (through a pidfd) - and, for a process the sandbox started, its whole process group,
    atomically, so a loop forking within its group is stopped mid-fork. Passes repeat
    until several in a row find no new match (a stopped process cannot fork), then
    everything frozen is SIGKILLed and the scan repeated to verify. Raises OSError if
    /proc cannot be listed.
    """
    keep = _protected()
    keep_groups = {os.getpgrp()} | {st.pgid for p in keep if (st := _proc_stat(p)) is not None}
    keep_groups |= {0, 1}
    own_mnt = _readlink("/proc/self/ns/mnt")
    killed: set[tuple[int, int]] = set()
    denied: set[tuple[int, int]] = set()
    for _ in range(_SWEEP_ATTEMPTS):
        frozen: dict[int, int] = {}
        cleared: set[tuple[int, int]] = set()  # (pid, inode) judged not ours this attempt
        deadline = time.monotonic() + _SWEEP_SECONDS
        quiet = 0
        while quiet < _QUIET_PASSES and time.monotonic() < deadline:
            moving = False
            for pid, inode in _pids_newest_first():
                if pid in keep or (pid, inode) in cleared:
                    continue
                st = _fresh_stat(pid, inode, target.since)
                if st is None or (pid, st.start) in denied:
                    continue
                if frozen.get(pid) == st.start and st.state in ("T", "t"):
                    continue
                kind = _belongs(pid, st, target, own_mnt)
                if kind == _NOT_OURS:
                    cleared.add((pid, inode))  # the verifying scan looks again
                    continue
                moving = True
                outcome = _signal(pid, st.start, signal.SIGSTOP)
                if outcome == _SENT:
                    frozen[pid] = st.start
                elif outcome == _DENIED:
                    denied.add((pid, st.start))
                # The sandbox's own process: stop its whole group at once too, so that a
                # loop forking within it is caught mid-fork. (A group only holds processes
                # of its session, and every process of a session the sandbox started is
                # the sandbox's.)
                if st.pgid not in keep_groups and (
                    kind == _DESCENDANT or _descends(pid, st, target)
                ):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(st.pgid, signal.SIGSTOP)
            quiet = 0 if moving else quiet + 1
        for pid, start in frozen.items():
            if _signal(pid, start, signal.SIGKILL) == _SENT:
                killed.add((pid, start))
        _wait_gone(frozen)
        left = [pid for pid, st in _matching(target, keep).items() if (pid, st.start) not in denied]
        if not left:
            break
    survivors = sorted(pid for pid, _start in denied if _proc_stat(pid) is not None)
    if left:
        survivors = sorted({*survivors, *left})
    return len(killed), survivors


def _wait_gone(processes: dict[int, int]) -> None:
    deadline = time.monotonic() + _REAP_SECONDS
    pending = dict(processes)
    while pending and time.monotonic() < deadline:
        for pid, start in list(pending.items()):
            st = _proc_stat(pid)
            if st is None or st.start != start or st.state in ("Z", "X"):
                del pending[pid]
        if pending:
            time.sleep(0.005)


def scan_root(root: Path) -> list[SandboxInfo]:
    found: list[SandboxInfo] = []
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            continue
        meta = read_meta(entry)
        if not meta:
            continue
        raw_labels = meta.get("labels")
        if not isinstance(raw_labels, dict):
            raw_labels = {}
        labels = {str(k): str(v) for k, v in raw_labels.items()}
        found.append(
            SandboxInfo(
                backend="subprocess",
                id=entry.name,
                labels=labels,
                state="present",
                created=labels.get(ownership.CREATED),
            )
        )
    return found


def destroy_dir(directory: Path) -> None:
    """Kill processes still running of a leaked sandbox (the same freeze-then-kill sweep as
    ``close()``, by the mark, start time and workdir its ``meta.json`` recorded, and by its
    directories), then remove it, and the workdir its ``create_workdir`` start created,
    without following links."""
    meta = read_meta(directory)
    workdir = directory / "work"
    declared = meta.get("workdir")
    if isinstance(declared, str) and declared.startswith("/") and declared.strip("/"):
        workdir = Path(declared)
    mark = meta.get("mark")
    since = meta.get("since")
    target = SweepTarget(
        mark=mark if isinstance(mark, str) and mark else None,
        dirs=real_dirs(directory, workdir),
        sessions={},
        since=since if isinstance(since, int) else 0,
    )
    try:
        _killed, survivors = sweep_target(target)
    except OSError as exc:
        log.warning("%s: process sweep failed: %s", directory, exc)
    else:
        if survivors:
            log.warning("%s: processes still running after the sweep: %s", directory, survivors)
    created = _created_workdir(directory, meta)
    if created is not None:
        created.remove()
    remove_sandbox_dir(directory, None)


def _created_workdir(directory: Path, meta: dict[str, object]) -> CreatedDir | None:
    """The workdir a leaked sandbox's start created, as its ``meta.json`` recorded it.

    Trusted only from a ``meta.json`` this user owns: a command run as another ``user=``
    cannot make this process remove a directory of its choosing (one run as this user
    could remove it itself)."""
    created = CreatedDir.from_meta(meta.get("created"))
    if created is None:
        return None
    try:
        owner = os.stat(directory / META_FILE, follow_symlinks=False).st_uid
    except OSError:
        return None
    return created if owner == os.geteuid() else None


def read_meta(directory: Path) -> dict[str, object]:
    """The sandbox's ``meta.json``, read without following a link; {} if unreadable."""
    try:
        fd = os.open(directory / META_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as fh:
            meta = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}
