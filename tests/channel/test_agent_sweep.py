"""The one freeze-then-kill sweep (:mod:`runtimes.channel.agent.sweep`): the channel agent's
SWEEP and the subprocess backend's host sweep are the same code, and it runs where the agent
may (Python 3.8, whose ``os`` has no ``pidfd_open``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimes.channel.agent import joined_source
from runtimes.channel.agent import sweep as agent_sweep
from runtimes.channel.agent.procs import dying, pending_signals
from runtimes.channel.agent.sweep import ProcessSweep, Sweep
from runtimes.channel.agent.wire import SweepHeader
from runtimes.subprocess.sweep import SweepTarget, real_dirs, start_ticks, sweep_target
from runtimes.sweep import MARK_VAR


def test_the_subprocess_backend_sweeps_with_the_agents_code() -> None:
    assert issubclass(SweepTarget, ProcessSweep)
    assert "\nclass ProcessSweep:" in joined_source()
    assert "\nclass Sweep(ProcessSweep):" in joined_source()


@pytest.fixture
def sleeper() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start ``sleep 60`` processes, each in its own session (the sweep spares its caller's);
    all reaped at the end."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def sleep(
    started: list[subprocess.Popen[bytes]],
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(["sleep", "60"], env=env, cwd=cwd, start_new_session=True)
    started.append(process)
    return process


def gone(process: subprocess.Popen[bytes]) -> bool:
    """Killed by the sweep (a zombie until reaped here)."""
    return process.wait(timeout=10) == -9


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "python-3.8"])
def test_the_agents_mark_sweep_kills_the_marked_and_those_at_home(
    sleeper: list[subprocess.Popen[bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    pidfd: bool,
) -> None:
    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    mark = f"{MARK_VAR}={uuid.uuid4().hex}"
    name, value = mark.split("=", 1)
    marked = sleep(sleeper, env={**os.environ, name: value})
    at_home = sleep(sleeper, cwd=tmp_path)
    other = sleep(sleeper, env={**os.environ, name: "another-sandbox"})
    killed = Sweep(SweepHeader("mark", mark, "", str(tmp_path))).run()
    assert killed == 2
    assert gone(marked) and gone(at_home)
    assert other.poll() is None


def test_the_host_sweep_selects_by_session_and_directory(
    sleeper: list[subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    """The subprocess backend's criteria: a session one of its commands started (not one
    whose id was reused since by another sandbox's command, marked as that sandbox's), a
    process working in its directories; a process of neither, or started before the
    sandbox, is spared."""
    since = start_ticks(os.getpid())
    in_session = sleep(sleeper)
    in_dir = sleep(sleeper, cwd=tmp_path)
    elsewhere = sleep(sleeper)
    marked_elsewhere = sleep(sleeper, env={**os.environ, MARK_VAR: "another-sandbox"})
    sessions = {
        in_session.pid: start_ticks(in_session.pid),
        # The id recorded from a session of the sandbox's that ended (its leader started at
        # another time), reused since: a verified leader's session is the sandbox's
        # whatever mark its processes carry (tests/security/test_subprocess_sweep_escape.py).
        marked_elsewhere.pid: start_ticks(marked_elsewhere.pid) - 1,
    }
    target = SweepTarget(uuid.uuid4().hex, real_dirs(tmp_path), sessions, since)
    killed, survivors = sweep_target(target)
    assert (killed, survivors) == (2, [])
    assert gone(in_session) and gone(in_dir)
    assert elsewhere.poll() is None and marked_elsewhere.poll() is None
    early = sleep(sleeper, cwd=tmp_path)
    later = SweepTarget(None, real_dirs(tmp_path), {}, start_ticks(early.pid) + 1)
    assert sweep_target(later) == (0, [])
    assert early.poll() is None


def test_pending_signals_reads_what_a_process_has_not_yet_acted_on() -> None:
    """What tells a process a kill already doomed: its pending signals, read from /proc
    (here a SIGUSR1 it blocks, the one kind a test can hold pending)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import signal, sys, time\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        assert signal.SIGUSR1 not in pending_signals(holder.pid)
        os.kill(holder.pid, signal.SIGUSR1)
        assert signal.SIGUSR1 in pending_signals(holder.pid)
        assert not dying(holder.pid)
    finally:
        holder.kill()
        holder.wait()
    assert pending_signals(holder.pid) == set() and not dying(holder.pid)


def test_a_process_already_dying_is_killed_but_not_counted(
    sleeper: list[subprocess.Popen[bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timed-out command's process whose SIGKILL the loaded machine has not yet run is
    not one the sweep found running: ``stop_processes()`` after a timeout reports 0 (seen in
    CI, 1 left). It is still killed and waited for."""
    doomed = sleep(sleeper, cwd=tmp_path)
    alive = sleep(sleeper, cwd=tmp_path)
    monkeypatch.setattr(agent_sweep, "dying", lambda pid: pid == doomed.pid)
    killed = Sweep(SweepHeader("mark", f"{MARK_VAR}=none", "", str(tmp_path))).run()
    assert killed == 1
    assert gone(doomed) and gone(alive)
