"""SWEEP: the one freeze-then-kill sweep of ``/proc`` in Python, and what a command that could
not be given a process reports (agent part).

:class:`ProcessSweep` is the sweep, whatever selects the processes: it freezes
(``SIGSTOP``) every matching process, newest pid first, until several passes in a row find
nothing new (a stopped process cannot fork), then ``SIGKILL``\\ s them all, waits for their
deaths and scans again to verify. Two users:

* the channel agent (:class:`Sweep`, the ``SWEEP`` request): ``stop_processes()`` without
  forking. At a sandbox's process limit (``pids_limit``) nothing new can be forked: the
  sweep script (``scripts/sweep.sh``) cannot even start, at the very moment a fork loop
  fills the sandbox. The agent is a process already; it walks ``/proc`` and signals from
  its main thread (a worker thread would be a new task too), selecting as the script does.
* the subprocess backend's host (:mod:`runtimes.subprocess.sweep`), whose sandbox is a
  directory: it selects by the environment mark, the sessions its commands started and
  what works in the sandbox's directories, since the sandbox's creation.

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8. The host imports it for the subprocess backend: that is the installed
package's code run by the machinery, never a copy from a place a sandbox could write.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING

from .procs import ProcStat, dying, newest_first, process_stat

if TYPE_CHECKING:
    from .wire import SweepHeader

SWEEP_SECONDS = 10.0
"""How long the freezing passes of one attempt may go on before the sweep kills what it
froze."""
MAX_PASSES = 500
"""As the script's: the agent's bound on the passes over /proc, whatever the sandbox does."""
QUIET_PASSES = 3
"""Consecutive passes that must find nothing new before the sweep kills what it froze."""
SWEEP_ATTEMPTS = 3
"""Freeze-kill-verify rounds before what is left counts as a survivor."""
DEATH_WAIT = 3.0
"""Seconds a sweep waits for the processes it killed to be gone."""
PIDS_MAX = ("/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/pids.max")
"""The sandbox's process limit: cgroup v1, then v2."""
DELETED = " (deleted)"
"""What ``/proc`` appends to the path of a link to a removed file."""
NOT_OURS, DESCENDANT, LOCATED = 0, 1, 2
"""What a process is to a sweep: not to be touched; started by the sandbox (its whole
process group is the sandbox's); found working in the sandbox's places."""
SENT, GONE, DENIED = "sent", "gone", "denied"

STARTS: dict[int, tuple[int, int]] = {}
"""pid -> (inode of /proc/PID, start in clock ticks since boot), kept across sweeps: a
process's start never changes, so each sweep reads the stat of new processes only."""


def pids_limit() -> str:
    """The process limit in force (``"64"``), ``""`` when none or unreadable: read, never
    forked for, so it works at the limit."""
    for path in PIDS_MAX:
        try:
            with open(path) as handle:
                value = handle.read().strip()
        except OSError:
            continue
        return "" if value == "max" else value
    return ""


def ancestors(pid: int) -> set[int]:
    """``pid`` and its ancestors (below PID 1)."""
    found = set()
    while pid > 1 and pid not in found:
        found.add(pid)
        st = process_stat(pid)
        if st is None:
            break
        pid = st.ppid
    return found


def link_target(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def send_signal(pid: int, start: int, sig: int) -> str:
    """Signal the process ``pid`` started at ``start`` (through a pidfd where Python and the
    kernel have them, so a reused pid is never hit): ``SENT``, ``GONE`` (exited, or the pid
    is another process now) or ``DENIED`` (another user's process)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return GONE
    except (AttributeError, OSError):  # Python < 3.9, or no pidfd to be had: kill(2)
        pidfd = -1
    try:
        now = process_stat(pid)
        if now is None or now.start != start:
            return GONE
        if pidfd < 0:
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(pidfd, sig)
        return SENT
    except ProcessLookupError:
        return GONE
    except PermissionError:
        return DENIED
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def wait_gone(processes: dict[int, int]) -> None:
    """A SIGKILLed process dies when it next runs: wait (at most ``DEATH_WAIT`` s) until
    none of ``processes`` (pid -> start) runs, so that the caller finds them gone."""
    deadline = time.monotonic() + DEATH_WAIT
    pending = dict(processes)
    while pending and time.monotonic() < deadline:
        for pid, start in list(pending.items()):
            st = process_stat(pid)
            if st is None or st.start != start or st.state in ("Z", "X", "x"):
                del pending[pid]
        if pending:
            time.sleep(0.002)


def prune_starts(listing: list[tuple[int, int]]) -> None:
    """Forget the starts of processes gone since (``listing``: every process now), once
    :data:`STARTS` holds many more than run."""
    if len(STARTS) > 2 * len(listing) + 1024:
        live = dict(listing)
        for pid in list(STARTS):
            if live.get(pid) != STARTS[pid][0]:
                del STARTS[pid]


class ProcessSweep:
    """One sweep. A process matches when it started at ``since`` (clock ticks since boot) or
    later, is in none of the ``spared`` sessions, and: with ``anything``, always; else when
    it carries ``mark`` (one ``NAME=value`` item of its environment), is in one of the
    ``sessions`` (session id -> start of the leader the sandbox started; not if it carries
    another ``mark_var`` value, or the id was reused since), is owned by one of ``uids``,
    works in ``home``, or has its cwd, root, executable, an open file or a mapping under
    one of ``dirs`` (real paths; in this process's mount namespace only). With ``groups``,
    a process the sandbox started has its whole process group stopped at once, so that a
    loop forking within its group is caught mid-fork. This process and its ancestors are
    spared. ``spawner``: the pid of the process that starts the sandbox's commands (the host,
    for the subprocess backend): a child of it is never the sandbox's for a file it holds.
    ``recorded``: session id -> (mark item, leader start) of every session the sandboxes of
    this host process started (shared by them, as it grows): what tells a session id reused
    by another live sandbox from a forged mark (:meth:`descends`)."""

    max_passes: int | None = None
    """A bound on the passes over /proc of one attempt (the deadline bounds them anyway)."""
    short_passes: bool = False
    """The subprocess host sweep's: a selective sweep ends by ``anything``'s rule too (a
    pass, not the first, that froze nothing and read every new process), and a whole pass
    before anything is frozen is the verifying scan (:meth:`freeze`)."""

    def __init__(
        self,
        *,
        since: int = 0,
        anything: bool = False,
        spared: tuple[int, ...] = (),
        mark: bytes = b"",
        mark_var: bytes = b"",
        sessions: dict[int, int] | None = None,
        uids: tuple[int, ...] = (),
        home: str = "",
        dirs: tuple[str, ...] = (),
        groups: bool = False,
        spawner: int | None = None,
        recorded: dict[int, tuple[bytes, int]] | None = None,
    ) -> None:
        self.since = since
        self.anything = anything
        self.spared = set(spared)
        self.mark = mark
        self.mark_var = mark_var or mark[: mark.find(b"=") + 1]
        self.sessions = {} if sessions is None else sessions  # the caller's, as it grows
        self.uids = set(uids)
        self.home = home
        self.dirs = dirs
        self.groups = groups
        self.spawner = spawner
        self.recorded = {} if recorded is None else recorded  # the caller's, as it grows

    def sweep(self) -> tuple[int, list[int]]:
        """Freeze-then-kill every matching process; (how many it killed, the pids of those
        still running: not signallable, or still appearing at the deadline). A process
        already dying (a ``SIGKILL`` pending or exiting: a timed-out command's, whose kill
        the loaded machine has not yet run) is waited for like the others, not counted.

        Raises:
            OSError: /proc cannot be listed.
        """
        keep = ancestors(os.getpid()) | {0, 1}
        keep_groups = {0, 1, os.getpgrp()}
        for pid in keep:
            st = process_stat(pid)
            if st is not None:
                keep_groups.add(st.pgid)
        own_mnt = link_target("/proc/self/ns/mnt")
        killed: set[tuple[int, int]] = set()
        denied: set[tuple[int, int]] = set()
        left: list[int] = []
        for _ in range(SWEEP_ATTEMPTS):
            frozen, verified = self.freeze(keep, keep_groups, denied, own_mnt)
            if verified:  # its last pass was a whole scan that found nothing to freeze
                left = []
                break
            for pid, start in frozen.items():
                doomed = dying(pid)  # a timed-out command's, killed already: not counted
                if send_signal(pid, start, signal.SIGKILL) == SENT and not doomed:
                    killed.add((pid, start))
            wait_gone(frozen)
            found = self.matching(keep, own_mnt)
            left = [pid for pid, st in found.items() if (pid, st.start) not in denied]
            if not left:
                break
        survivors = {pid for pid, _start in denied if process_stat(pid) is not None}
        return len(killed), sorted(survivors.union(left))

    def freeze(
        self,
        keep: set[int],
        keep_groups: set[int],
        denied: set[tuple[int, int]],
        own_mnt: str | None,
    ) -> tuple[dict[int, int], bool]:
        """SIGSTOP every match, pass after pass, until the sweep may end (or the deadline);
        (pid -> start of those frozen, verified). With ``anything`` (a sandbox of the
        backend's own) it ends after a pass, not the first, that froze nothing and read
        every process new since the pass before: one that forked and exited between two
        passes leaves its child in the next listing. Beside a host's other processes, which
        come and go all the time, it ends after ``QUIET_PASSES`` in a row that froze
        nothing; with ``short_passes``, or by ``anything``'s rule, whichever comes first.

        With ``short_passes``, until something is frozen every pass judges every process
        again (those a pass found not the sandbox's included), so a last pass that froze
        nothing and read every new process is the verifying scan itself (``verified``:
        nothing to kill, nothing to scan again). Once something is frozen, a process found
        not the sandbox's is not looked at again until the verifying scan
        (:meth:`matching`): a fork loop's passes stay short."""
        frozen: dict[int, int] = {}
        cleared: set[tuple[int, int]] = set()  # (pid, inode) not ours: not looked at again
        deadline = time.monotonic() + SWEEP_SECONDS
        quiet = passes = 0
        listed: set[int] = set()
        while time.monotonic() < deadline:
            if self.max_passes is not None and passes >= self.max_passes:
                break
            passes += 1
            moving = unsure = False
            whole = self.short_passes and not frozen and not denied
            listing = newest_first()
            before, listed = listed, {pid for pid, _inode in listing}
            # New processes first (a fork loop's live member is among them), newest first.
            fresh = [entry for entry in listing if entry[0] not in before]
            for pid, inode in fresh + [entry for entry in listing if entry[0] in before]:
                if pid in keep or (not whole and (pid, inode) in cleared):
                    continue
                st = self.fresh_stat(pid, inode)
                if pid not in before and (st is None or st.state in ("Z", "X", "x")):
                    known = STARTS.get(pid)  # gone, unless known to be older than `since`
                    older = known is not None and known[0] == inode and known[1] < self.since
                    unsure = unsure or st is not None or not older
                if st is None or (pid, st.start) in denied:
                    continue
                if frozen.get(pid) == st.start and st.state in ("T", "t"):
                    continue
                kind = self.belongs(pid, st, own_mnt)
                if kind == NOT_OURS:
                    cleared.add((pid, inode))  # the verifying scan looks again
                    continue
                moving = True
                outcome = send_signal(pid, st.start, signal.SIGSTOP)
                if outcome == SENT:
                    frozen[pid] = st.start
                elif outcome == DENIED:
                    denied.add((pid, st.start))
                # A group only holds processes of its session, and every process of a
                # session the sandbox started is the sandbox's.
                if (
                    self.groups
                    and st.pgid not in keep_groups
                    and (kind == DESCENDANT or self.descends(pid, st))
                ):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(st.pgid, signal.SIGSTOP)
            done = not moving and not unsure
            if passes > 1 and done and (self.anything or self.short_passes):
                prune_starts(listing)
                return frozen, whole
            if not self.anything:
                quiet = 0 if moving else quiet + 1
                if quiet >= QUIET_PASSES:
                    prune_starts(listing)
                    return frozen, whole and done
        return frozen, False

    def matching(self, keep: set[int], own_mnt: str | None) -> dict[int, ProcStat]:
        """Every process that matches now (the verifying scan)."""
        found: dict[int, ProcStat] = {}
        listing = newest_first()
        for pid, inode in listing:
            if pid in keep:
                continue
            st = self.fresh_stat(pid, inode)
            if st is not None and self.belongs(pid, st, own_mnt):
                found[pid] = st
        prune_starts(listing)
        return found

    def fresh_stat(self, pid: int, inode: int) -> ProcStat | None:
        """The process's stat, or None if it is gone or started before ``since`` (known
        from ``STARTS`` without reading anything)."""
        known = STARTS.get(pid)
        if known is not None and known[0] == inode and known[1] < self.since:
            return None
        st = process_stat(pid)
        if st is not None:
            STARTS[pid] = (inode, st.start)
            if st.start < self.since:
                return None
        return st

    def belongs(self, pid: int, st: ProcStat, own_mnt: str | None) -> int:
        """``DESCENDANT``, ``LOCATED`` or ``NOT_OURS`` (zombies included). The cheapest
        sufficient test (the cwd, one syscall) comes first: a fork loop's generation lives
        for a moment only."""
        if st.start < self.since or st.state in ("Z", "X", "x") or st.sid in self.spared:
            return NOT_OURS
        if self.anything:
            return LOCATED
        if self.dirs:
            cwd = link_target(f"/proc/{pid}/cwd")
            if cwd is not None and self.holds(cwd) and self.same_mnt(pid, own_mnt):
                return LOCATED
        if self.descends(pid, st):
            return DESCENDANT
        if self.owned_by_user(pid) or self.works_in_home(pid):
            return LOCATED
        if st.ppid == self.spawner:
            # The files a child of the process that starts the sandbox's commands holds are
            # that process's: a fork not yet exec'd (another sandbox's command on its way)
            # holds every file the spawner has open, this sandbox's among them (the soak saw
            # another sandbox's fresh command die with 137).
            return NOT_OURS
        return LOCATED if self.located_under(pid, own_mnt) else NOT_OURS

    def descends(self, pid: int, st: ProcStat) -> bool:
        """Started by the sandbox: carries its mark, or is in a session one of its commands
        started. Whatever mark a process carries, it is the sandbox's when its session's
        leader is verified (alive, a zombie included, and started when the recorded one
        did): a session holds only what its leader and its descendants started, so a mark
        in it is forged (``env -i VF_SANDBOX_RUNTIME=other ...``). A leader alive but not
        the one started means the session id was reused: not this sandbox's session (the
        kernel frees a pid only once no process has it as session id, so the sandbox's
        session had ended). With the leader gone, a process carrying another mark is
        spared only when that mark's live sandbox recorded this session id since
        (``recorded``: the sandboxes of this host process): the id was reused and the
        other sandbox's session is what remains. Otherwise the other mark is forged and
        the process is the sandbox's.

        What remains: a session id reused by a sandbox of *another* host process (whose
        records this process cannot see) is taken as this sandbox's when that session's
        leader is gone and its processes carry the other process's mark: they are swept
        (killed, never spared wrongly the other way round)."""
        if not self.mark and st.sid not in self.sessions:
            return False
        start = self.sessions.get(st.sid)
        if start is not None:
            leader = process_stat(st.sid)
            if leader is not None and leader.start == start:
                return True
            if leader is None:
                marks = self.marks(pid)
                if not marks or (self.mark and self.mark in marks):
                    return True
                return not self.reused_by_another(st.sid, start, marks)
        if not self.mark:
            return False
        marks = self.marks(pid)
        return marks is not None and self.mark in marks

    def reused_by_another(self, sid: int, start: int, marks: list[bytes]) -> bool:
        """Whether another live sandbox of this host process recorded session ``sid`` (a
        leader started at another time than ``start``) with one of ``marks``."""
        other = self.recorded.get(sid)
        return other is not None and other[1] != start and other[0] in marks

    def marks(self, pid: int) -> list[bytes] | None:
        """The items of the process's environment that name ``mark_var``."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                data = handle.read()
        except OSError:
            return None
        return [item for item in data.split(b"\0") if item.startswith(self.mark_var)]

    def owned_by_user(self, pid: int) -> bool:
        if not self.uids:
            return False
        try:
            with open(f"/proc/{pid}/status") as handle:
                for line in handle:
                    if line.startswith("Uid:"):
                        return int(line.split()[1]) in self.uids
        except (OSError, ValueError, IndexError):
            pass
        return False

    def works_in_home(self, pid: int) -> bool:
        if not self.home:
            return False
        try:
            return os.path.samefile(f"/proc/{pid}/cwd", self.home)
        except OSError:
            return False

    def holds(self, path: str) -> bool:
        """Whether ``path`` (as /proc shows it) is one of ``dirs`` or under one."""
        if path.endswith(DELETED):
            path = path[: -len(DELETED)]
        return any(path == d or path.startswith(d + "/") for d in self.dirs)

    def same_mnt(self, pid: int, own_mnt: str | None) -> bool:
        return own_mnt is not None and link_target(f"/proc/{pid}/ns/mnt") == own_mnt

    def located_under(self, pid: int, own_mnt: str | None) -> bool:
        """cwd, root, executable, an open file or a mapping under ``dirs``. Only in this
        process's mount namespace, where paths mean the same."""
        base = f"/proc/{pid}"
        if not self.dirs or not self.same_mnt(pid, own_mnt):
            return False
        for link in ("cwd", "root", "exe"):
            found = link_target(f"{base}/{link}")
            if found is not None and self.holds(found):
                return True
        try:
            fds = os.listdir(f"{base}/fd")
        except OSError:
            fds = []
        for fd in fds:
            found = link_target(f"{base}/fd/{fd}")
            if found is not None and found.startswith("/") and self.holds(found):
                return True
        try:
            with open(f"{base}/maps", "rb") as handle:
                maps = handle.read().decode("utf-8", "surrogateescape")
        except OSError:
            return False
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/") and self.holds(parts[5]):
                return True
        return False


class Sweep(ProcessSweep):
    """The agent's SWEEP: ``scripts/sweep.sh``'s rule for the mode (``all``: not in session
    1; ``since:T``: started at tick T or later; ``mark``: carrying the mark, owned by one of
    the users (comma-separated), or working in ``home``). The agent's session is spared."""

    max_passes = MAX_PASSES

    def __init__(self, header: SweepHeader) -> None:
        mode = header.mode
        since = int(mode[6:]) if mode.startswith("since:") else 0
        own = os.getsid(0)
        selective = mode != "all" and not mode.startswith("since:")
        super().__init__(
            since=since,
            anything=not selective,
            spared=(own, 1) if mode == "all" else (own,),
            mark=header.mark.encode("utf-8", "surrogateescape") if selective else b"",
            uids=tuple(u for u in map(user_id, header.user.split(",")) if u is not None),
            home=header.home if selective else "",
        )

    def run(self) -> int:
        """Freeze until quiet, then kill; how many were killed."""
        return self.sweep()[0]


def user_id(user: str) -> int | None:
    """The uid all of whose processes match (``None``: no such user, none named, or the
    agent's own: its processes are not all the policy's)."""
    if not user:
        return None
    if user.isdigit():
        uid = int(user)
    else:
        import pwd

        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            return None
    return None if uid == os.geteuid() else uid
