"""The one kill (``runtimes/scripts/kill.sh``, every backend's): what it kills and what it spares.

A kill retried later (``--mark``) names process groups by ids the runtime recorded earlier. By then
the policy may have let those ids go and started processes that reuse them, dressed to look like
the runtime's: the kill must hit only a leader whose environment carries the runtime's mark as a
whole entry, never a look-alike. Run here with the host's ``sh`` against real processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping

import pytest

from runtimes.sweep import kill_argv

pytestmark = pytest.mark.attack(6)

MARK = "VF_SANDBOX_RUNTIME=runtime-mark"


def _alive(pid: int) -> bool:
    try:
        waited, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return waited == 0


def _gone_within(pid: int, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL) if _leads(proc.pid) else proc.kill()
        proc.wait()


def _leads(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except ProcessLookupError:
        return False


def _start(
    procs: list[subprocess.Popen[bytes]], env: Mapping[str, str], *, group: bool = True
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "60"], env=dict(env), start_new_session=group)
    procs.append(proc)
    return proc


def _kill(pids: list[int], mark: str | None = None) -> None:
    done = subprocess.run(kill_argv(pids, mark=mark), capture_output=True, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")


def test_the_marked_leader_and_its_group_die(started: list[subprocess.Popen[bytes]]) -> None:
    leader = _start(started, {"PATH": os.environ["PATH"], MARK.split("=")[0]: "runtime-mark"})
    _kill([leader.pid], mark=MARK)
    assert _gone_within(leader.pid)


@pytest.mark.parametrize(
    "environment",
    [
        {},  # no mark at all
        {"VF_SANDBOX_RUNTIME": "runtime-mark-2"},  # a longer value
        {"VF_SANDBOX_RUNTIME": "other"},  # another runtime's
        {"X": "VF_SANDBOX_RUNTIME=runtime-mark"},  # the mark inside another entry's value
        {"XVF_SANDBOX_RUNTIME": "runtime-mark"},  # a longer name
    ],
    ids=["unmarked", "longer-value", "other-runtime", "inside-a-value", "longer-name"],
)
def test_a_look_alike_that_reused_the_id_is_spared(
    started: list[subprocess.Popen[bytes]], environment: dict[str, str]
) -> None:
    reuser = _start(started, {"PATH": os.environ["PATH"], **environment})
    _kill([reuser.pid], mark=MARK)
    time.sleep(0.2)
    assert _alive(reuser.pid)


def test_without_a_mark_a_leader_not_yet_leading_its_group_dies(
    started: list[subprocess.Popen[bytes]],
) -> None:
    # Between fork and setsid() a command is not its group's leader yet: the kill names the
    # pid first, so it dies anyway; a group id already gone is no error.
    early = _start(started, {"PATH": os.environ["PATH"]}, group=False)
    _kill([early.pid, 2**22 - 7])
    assert _gone_within(early.pid)
