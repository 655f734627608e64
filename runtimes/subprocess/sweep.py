"""What a sandbox's commands left running, found by the one freeze-then-kill sweep of /proc
(:mod:`runtimes.channel.agent.sweep`, the channel agent's, imported from the installed
package) with this backend's criteria; and the sweep of dead sandboxes' directories
(``vf-sandbox cleanup``)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from .. import ownership
from ..channel.agent.procs import process_stat
from ..channel.agent.sweep import ProcessSweep
from ..models import SandboxInfo
from ..sweep import MARK_VAR
from .config import META_FILE
from .files import CreatedDir, remove_sandbox_dir

log = logging.getLogger("runtimes.subprocess")

SINCE_MARGIN_TICKS = 50
"""Clock ticks before the sandbox's creation from which a process may belong to it."""
_CLK_TCK = os.sysconf("SC_CLK_TCK")

SESSIONS: dict[int, tuple[bytes, int]] = {}
"""Session id -> (the mark item its commands carry, start of its leader) of every session a
subprocess sandbox of this host process started, while that sandbox lives (a kept one's
stay): what tells a session id another live sandbox reused from a forged mark
(:meth:`~runtimes.channel.agent.sweep.ProcessSweep.descends`)."""


def record_session(mark: bytes, sid: int, start: int) -> None:
    """Note the session ``sid`` (its leader started at ``start``) as a sandbox's, whose
    commands carry ``mark``."""
    SESSIONS[sid] = (mark, start)


def forget_sessions(sessions: dict[int, int]) -> None:
    """Drop the records of ``sessions`` (session id -> leader start) of a sandbox that is
    gone; a record another sandbox made since (the id reused) stays."""
    for sid, start in sessions.items():
        entry = SESSIONS.get(sid)
        if entry is not None and entry[1] == start:
            del SESSIONS[sid]


class SweepTarget(ProcessSweep):
    """The sweep of one sandbox's processes on the host (the one freeze-then-kill sweep,
    :class:`~runtimes.channel.agent.sweep.ProcessSweep`, with its criteria).

    ``mark``: the value of ``VF_SANDBOX_RUNTIME`` its commands carry; ``dirs``: its
    directories (real paths); ``sessions``: session id -> start (clock ticks since boot)
    of the leader each command was started as (the runtime's own dict, as it grows);
    ``since``: processes started before this (clock ticks since boot) are never the
    sandbox's. A process the sandbox started has its whole process group stopped at once.
    A child of the host process (every sandbox's command, a fork on its way to ``exec``) is
    never the sandbox's for a file it holds: it may be the host's file. A process in one of
    its sessions is the sandbox's whatever mark it carries, unless the session id was reused
    by another live sandbox of this host process (:data:`SESSIONS`). Its passes are short
    (:attr:`~runtimes.channel.agent.sweep.ProcessSweep.short_passes`): a sweep that finds
    nothing is two passes over ``/proc``, the second the verifying scan.
    """

    short_passes = True

    def __init__(
        self, mark: str | None, dirs: tuple[str, ...], sessions: dict[int, int], since: int
    ) -> None:
        super().__init__(
            since=since,
            mark=f"{MARK_VAR}={mark}".encode() if mark else b"",
            mark_var=f"{MARK_VAR}=".encode(),
            sessions=sessions,
            dirs=dirs,
            groups=True,
            spawner=os.getpid(),
            recorded=SESSIONS,
        )


def boot_ticks() -> int:
    with open("/proc/uptime", "rb") as fh:
        return int(float(fh.read().split()[0]) * _CLK_TCK)


def start_ticks(pid: int) -> int:
    st = process_stat(pid)
    return st.start if st is not None else -1


def real_dirs(*dirs: Path) -> tuple[str, ...]:
    return tuple(dict.fromkeys(os.path.realpath(d) for d in dirs))


def unlinked_dirs(*dirs: Path) -> tuple[str, ...]:
    """Each directory as its parent's real path and its own name, its own last name not
    followed: a directory the sandbox's code replaced by a link (``work -> /``) names no
    process's whereabouts, not the link's target."""
    return tuple(dict.fromkeys(os.path.join(os.path.realpath(d.parent), d.name) for d in dirs))


def sweep_target(target: SweepTarget) -> tuple[int, list[int]]:
    """Freeze-then-kill every process of ``target``; return (killed, survivors' pids).

    Each pass walks /proc (new processes first, newest pid first) and SIGSTOPs every
    matching process at once (through a pidfd) - and, for a process the sandbox started,
    its whole process group, atomically, so a loop forking within its group is stopped
    mid-fork. Passes repeat
    until several in a row find no new match (a stopped process cannot fork), then
    everything frozen is SIGKILLed and the scan repeated to verify. Raises OSError if
    /proc cannot be listed.
    """
    return target.sweep()


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
        dirs=unlinked_dirs(directory, workdir),
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
