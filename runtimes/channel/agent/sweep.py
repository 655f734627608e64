"""SWEEP in the agent: ``stop_processes()`` without forking, and what a command that could
not be given a process reports (agent part).

At a sandbox's process limit (``pids_limit``) nothing new can be forked: the sweep script
(``scripts/sweep.sh``) cannot even start, at the very moment a fork loop fills the sandbox.
The agent is a process already; it walks ``/proc`` and signals from its main thread (a
worker thread would be a new task too), with the script's rules: freeze (``SIGSTOP``) every
matching process until a pass finds none running and none it had not seen, then ``SIGKILL``
them all.

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING

from .procs import is_running, proc_stat, process_ids

if TYPE_CHECKING:
    from .wire import SweepHeader

DEATH_WAIT = 1.0
"""Seconds a sweep waits for the processes it killed to be gone."""
MAX_PASSES = 500
"""As the script's: a bound on the passes over /proc, whatever the sandbox does."""
PIDS_MAX = ("/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/pids.max")
"""The sandbox's process limit: cgroup v1, then v2."""


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
        fields = proc_stat(pid)
        if fields is None:
            break
        pid = int(fields[1])
    return found


class Sweep:
    """One SWEEP: which processes match is the script's rule for the mode (``all``: not in
    session 1; ``since:T``: started at tick T or later; ``mark``: carrying the mark, owned
    by one of the users (comma-separated), or working in ``home``). The agent's session and
    ancestors are spared."""

    def __init__(self, header: SweepHeader) -> None:
        self.mode = header.mode
        self.since = int(header.mode[6:]) if header.mode.startswith("since:") else None
        self.mark = header.mark.encode("utf-8", "surrogateescape")
        self.home = header.home
        self.uids = {u for u in map(user_id, header.user.split(",")) if u is not None}
        self.session = os.getsid(0)
        self.kept = ancestors(os.getpid())
        self.seen: set[int] = set()
        self.other: set[tuple[int, str]] = set()
        self.running = 0
        self.unsure = False

    def run(self) -> int:
        """Freeze until quiet, then kill; how many were killed."""
        listed: set[int] = set()
        quiet = 0
        for number in range(1, MAX_PASSES + 1):
            before, listed = listed, set(process_ids())
            self.running, self.unsure = 0, False
            # New processes first: a fork loop's live member is among them, about to exit.
            for pid in sorted(listed - before):
                self.look(pid, True)
            for pid in sorted(listed & before):
                self.look(pid, False)
            quiet = quiet + 1 if self.running == 0 else 0
            if self.mode == "mark":
                if quiet >= 3:
                    break
            elif self.running == 0 and not self.unsure and number > 1:
                break
        killed = 0
        for pid in self.seen:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
        self.wait_for_deaths()
        return killed

    def wait_for_deaths(self) -> None:
        """A SIGKILLed process dies when it next runs: wait (at most ``DEATH_WAIT`` s) until
        none of the killed still runs, so that the caller finds them gone."""
        deadline = time.monotonic() + DEATH_WAIT
        while any(is_running(proc_stat(pid)) for pid in self.seen):
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)

    def look(self, pid: int, new: bool) -> None:
        """Freeze ``pid`` if it matches (``new``: the pass before did not list it)."""
        if pid in self.kept:
            return
        fields = proc_stat(pid)
        if fields is None or fields[0] in ("Z", "X", "x"):
            self.unsure = self.unsure or new  # it may have left a child the next pass lists
            return
        started = fields[19]
        if (pid, started) in self.other:
            return
        if not self.matches(pid, int(fields[3]), int(started)):
            self.other.add((pid, started))
            return
        self.seen.add(pid)
        if fields[0] not in ("T", "t"):
            try:
                os.kill(pid, signal.SIGSTOP)
                self.running += 1
            except OSError:
                pass

    def matches(self, pid: int, session: int, started: int) -> bool:
        if session == self.session:
            return False
        if self.mode == "all":
            return session != 1
        if self.since is not None:
            return started >= self.since
        return self.owned_by_user(pid) or self.works_in_home(pid) or self.carries_mark(pid)

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

    def carries_mark(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/environ", "rb") as handle:
                return self.mark in handle.read().split(b"\0")
        except OSError:
            return False


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
