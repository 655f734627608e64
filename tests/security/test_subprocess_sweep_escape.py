"""A forged mark does not take a leftover out of the subprocess sweep (attack class 6).

A process in a session one of the sandbox's commands started is the sandbox's, whatever
``VF_SANDBOX_RUNTIME`` value it carries: the sweep's exemption for "another sandbox's mark"
holds only for a session id that another live sandbox of this host process reused (it
recorded that session). Two variants of the forgery: the command's own process (the session
leader) ``exec``\\ s into a process with a forged mark, and a child with a forged mark is
left behind by a leader that exits. Neither survives ``stop_processes()`` nor ``close()``.
The regression: a live sandbox's processes in a session id the other sandbox recorded too
(the id reused) are still spared.

Every leftover carries a token in its argv; whatever still carries one is killed when the
test ends, pass or fail.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from runtimes import SubprocessConfig, open_runtime
from runtimes.errors import SandboxError

pytestmark = pytest.mark.anyio


def _token() -> str:
    return f"{random.randint(300, 999)}.{random.randint(10**5, 10**6 - 1)}"


def _pids(token: str) -> list[int]:
    """The running (not zombie) processes whose argv holds ``sleep TOKEN``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"sleep\0{token}".encode() not in (entry / "cmdline").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _wait_for(token: str, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = _pids(token)
        if pids:
            return pids
        time.sleep(0.01)
    raise AssertionError(f"no process `sleep {token}` started")


def _kill(token: str) -> None:
    for pid in _pids(token):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def tokens() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for token in made:
        _kill(token)


def _forged(token: str) -> str:
    """A process with a forged mark, out of the sandbox's directories."""
    return f"env -i VF_SANDBOX_RUNTIME=other sh -c 'cd /; exec sleep {token}'"


async def _exec_quietly(rt: object, argv: list[str]) -> None:
    with contextlib.suppress(SandboxError):
        await rt.exec(argv)  # type: ignore[attr-defined]


@pytest.mark.attack(6)
@pytest.mark.parametrize("ending", ["stop_processes", "close"])
async def test_an_execd_leader_with_a_forged_mark_is_swept(
    tmp_path: Path, tokens: list[str], ending: str
) -> None:
    """The command itself (its session's leader) becomes a process marked as another
    sandbox's: its session's leader is verified, so it is the sandbox's."""
    token = _token()
    tokens.append(token)
    rt = open_runtime(SubprocessConfig(root=str(tmp_path / "root")))
    await rt.start()
    killed = -1
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_exec_quietly, rt, ["sh", "-c", f"exec {_forged(token)}"])
            try:
                await anyio.to_thread.run_sync(_wait_for, token)
                if ending == "stop_processes":
                    killed = await rt.stop_processes()
                else:
                    await rt.close()
                survivors = _pids(token)
            finally:
                _kill(token)  # the exec returns, whatever the sweep did
        assert survivors == [], f"the forged leader survived {ending}()"
        assert ending == "close" or killed >= 1
    finally:
        await rt.close()


@pytest.mark.attack(6)
@pytest.mark.parametrize("ending", ["stop_processes", "close"])
async def test_a_forked_child_with_a_forged_mark_is_swept(
    tmp_path: Path, tokens: list[str], ending: str
) -> None:
    """A child marked as another sandbox's, left behind by a leader that exited: no live
    sandbox recorded its session, so the mark is forged and the child the sandbox's."""
    token = _token()
    tokens.append(token)
    rt = open_runtime(SubprocessConfig(root=str(tmp_path / "root")))
    await rt.start()
    try:
        command = f"{_forged(token)} >/dev/null 2>&1 </dev/null & exit 0"
        assert (await rt.exec(["sh", "-c", command])).exit_code == 0
        await anyio.to_thread.run_sync(_wait_for, token)
        if ending == "stop_processes":
            assert await rt.stop_processes() >= 1
        else:
            await rt.close()
        assert _pids(token) == [], f"the forged child survived {ending}()"
    finally:
        await rt.close()


@pytest.mark.attack(6)
async def test_a_session_id_another_live_sandbox_reused_is_spared(
    tmp_path: Path, tokens: list[str]
) -> None:
    """Sandbox A recorded a session id that sandbox B's command now leads (the id reused:
    A's session ended, B's command got the pid), and B's leader is gone: B's leftover
    there, with B's mark, is B's. A's sweep spares it; B's close sweeps it."""
    token = _token()
    tokens.append(token)
    a = open_runtime(SubprocessConfig(root=str(tmp_path / "a")))
    b = open_runtime(SubprocessConfig(root=str(tmp_path / "b")))
    await a.start()
    await b.start()
    try:
        leftover = f"cd /; sleep {token} >/dev/null 2>&1 </dev/null & exit 0"
        assert (await b.exec(["sh", "-c", leftover])).exit_code == 0
        (pid,) = await anyio.to_thread.run_sync(_wait_for, token)
        sid = os.getsid(pid)
        # A's record of the same id, from a session of A's that ended (another start).
        a_sessions = a.backend._sessions  # type: ignore[attr-defined]
        a_sessions[sid] = b.backend._sessions[sid] - 1  # type: ignore[attr-defined]
        assert await a.stop_processes() == 0
        await a.close()
        assert _pids(token) == [pid], "A's sweep killed the live sandbox B's process"
        await b.close()
        assert _pids(token) == []
    finally:
        await a.close()
        await b.close()
