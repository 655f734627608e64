"""Attacks on the subprocess runtime's teardown: planted links (8), leftovers that left the
command's session or scrubbed their environment (9), and fork loops (6).

Every host sentinel lives under ``tmp_path``. Every process a test leaves carries a
token in its argv, and the ``reaper`` fixture freezes-then-kills whatever still carries one
when the test ends, pass or fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from runtimes import SubprocessConfig, open_runtime
from runtimes.base import MARK_VAR
from runtimes.cleanup import cleanup_sandboxes
from runtimes.subprocess import SubprocessRuntime

pytestmark = pytest.mark.anyio

PYTHON = shutil.which("python3") or sys.executable

# A fork loop: each generation sleeps a moment, forks, and exits; the child goes on. It
# writes its generation to a host-side file, so the test sees it live (ps and pgrep miss
# it: a generation is gone before they read its /proc entry).
LOOP = textwrap.dedent(
    """
    import os, sys, time
    n = 0
    while True:
        n += 1
        time.sleep(0.001)
        if os.fork():
            os._exit(0)
        with open(sys.argv[1], "w") as fh:
            fh.write(str(n))
    """
)


class Reaper:
    """Tokens for leftovers' argv, and a freeze-then-kill of whatever carries one."""

    def __init__(self) -> None:
        self.tokens: list[str] = []

    def token(self) -> str:
        value = f"{random.randint(100000, 999999)}.{random.randint(100, 999)}"
        self.tokens.append(value)
        return value

    def pids(self, token: str) -> list[int]:
        return [pid for pid, cmd in _cmdlines() if token.encode() in cmd]

    async def started(self, token: str) -> int:
        """The pid of the one process carrying ``token`` once it runs its final program: a
        shell that backgrounds a command returns before that command has exec'd, and the
        ``sh``/``env``/``setsid`` on the way carry the token in their argv too."""
        for _ in range(200):
            found = [
                pid
                for pid, cmd in _cmdlines()
                if token.encode() in cmd
                and os.path.basename(cmd.split(b"\0", 1)[0]) not in (b"sh", b"env", b"setsid")
            ]
            if found:
                [pid] = found
                return pid
            await anyio.sleep(0.025)
        raise AssertionError(f"no process carrying {token} started")

    def reap(self) -> None:
        keep = _ancestors()
        stopped: set[int] = set()
        quiet, deadline = 0, time.monotonic() + 10
        while quiet < 10 and time.monotonic() < deadline:
            found = False
            for pid, cmd in _cmdlines():
                if pid in keep or pid in stopped:
                    continue
                if any(t.encode() in cmd for t in self.tokens):
                    found = True
                    try:
                        os.kill(pid, signal.SIGSTOP)
                        stopped.add(pid)
                    except ProcessLookupError:
                        pass
            quiet = 0 if found else quiet + 1
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _cmdlines() -> Iterator[tuple[int, bytes]]:
    for pid in sorted((int(n) for n in os.listdir("/proc") if n.isdigit()), reverse=True):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                yield pid, fh.read()
        except OSError:
            continue


def _ancestors() -> set[int]:
    keep, pid = {os.getpid()}, os.getppid()
    while pid > 1:
        keep.add(pid)
        with open(f"/proc/{pid}/stat", "rb") as fh:
            pid = int(fh.read().rsplit(b")", 1)[1].split()[1])
    return keep


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    r = Reaper()
    yield r
    r.reap()


def _beat(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _loop_alive(beat: Path, wait: float = 0.4) -> bool:
    first = _beat(beat)
    time.sleep(wait)
    return _beat(beat) != first


def _wait_for_beats(beat: Path) -> None:
    """The control: the loop beats (a new value within 10 s; under load 0.4 s was too short)."""
    deadline = time.monotonic() + 10
    while not _beat(beat) and time.monotonic() < deadline:
        time.sleep(0.02)
    first = _beat(beat)
    while _beat(beat) == first and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _beat(beat) != first, "the fork loop should be running"


def _gone(reaper: Reaper, token: str, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while reaper.pids(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not reaper.pids(token)


def _environ(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        return fh.read().split(b"\0")


def _session(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as fh:
        return int(fh.read().rsplit(b")", 1)[1].split()[4])


# ---------------------------------------------------------------------- 8: planted links


def _host_sentinels(tmp_path: Path) -> tuple[Path, Path]:
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    host_dir.chmod(0o755)
    (host_dir / "secret.txt").write_text("keep")
    host_file = tmp_path / "host-file"
    host_file.write_text("host")
    host_file.chmod(0o640)
    return host_dir, host_file


def _assert_host_untouched(host_dir: Path, host_file: Path) -> None:
    assert oct(host_dir.stat().st_mode & 0o7777) == oct(0o755)
    assert (host_dir / "secret.txt").read_text() == "keep"
    assert oct(host_file.stat().st_mode & 0o7777) == oct(0o640)
    assert host_file.read_text() == "host"


def _plant(host_dir: Path, host_file: Path) -> str:
    """The policy's shell: links to the host everywhere, locked directories and files."""
    return (
        f"ln -s {host_dir} d && ln -s {host_file} f && ln -s {host_dir} ../planted && "
        f"mkdir -p locked/inner && ln -s {host_dir} locked/inner/d && "
        f"ln -s {host_file} locked/f && echo x > sealed && "
        "chmod 000 sealed locked/inner locked"
    )


@pytest.mark.attack(8)
async def test_close_never_follows_planted_links(tmp_path: Path) -> None:
    host_dir, host_file = _host_sentinels(tmp_path)
    root = tmp_path / "root"
    async with open_runtime(SubprocessConfig(root=str(root))) as rt:
        result = await rt.exec(["sh", "-c", _plant(host_dir, host_file)])
        assert result.exit_code == 0, result
        # Control: the links do lead to the host.
        assert os.path.realpath(Path(rt.workdir) / "d") == str(host_dir)
        assert (Path(rt.workdir) / "f").read_text() == "host"
    assert list(root.iterdir()) == []
    _assert_host_untouched(host_dir, host_file)


@pytest.mark.attack(8)
async def test_close_leaves_host_alone_when_the_sandbox_dir_is_swapped(tmp_path: Path) -> None:
    """The policy moves its own sandbox directory away and plants a link at its name."""
    host_dir, host_file = _host_sentinels(tmp_path)
    root = tmp_path / "root"
    async with open_runtime(SubprocessConfig(root=str(root))) as rt:
        sbx = Path(rt.workdir).parent
        await rt.exec(["sh", "-c", _plant(host_dir, host_file)])
        result = await rt.exec(["sh", "-c", f"mv {sbx} {root}/moved && ln -s {host_dir} {sbx}"])
        assert result.exit_code == 0, result
        assert os.path.realpath(sbx) == str(host_dir)  # control: the swap happened
    _assert_host_untouched(host_dir, host_file)
    assert not os.path.lexists(sbx)
    assert sorted(p.name for p in host_dir.iterdir()) == ["secret.txt"]


_DAC_BOUND = textwrap.dedent(
    """
    import anyio, json, os, sys
    from runtimes import SubprocessConfig, open_runtime
    from runtimes.subprocess import SubprocessRuntime

    root, plant = sys.argv[1], sys.argv[2]
    out = {}

    async def main():
        config = SubprocessConfig(root=root)
        async with open_runtime(config) as rt:
            assert (await rt.exec(["sh", "-c", plant])).exit_code == 0
            try:
                os.listdir(os.path.join(rt.workdir, "locked"))
                out["dac_bound"] = False
            except PermissionError:
                out["dac_bound"] = True
        out["after_close"] = os.listdir(root)
        # The sweep of `vf-sandbox cleanup`: a sandbox nobody closed.
        rt = open_runtime(config)
        await rt.start()
        assert (await rt.exec(["sh", "-c", plant])).exit_code == 0
        [info] = [i for i in await SubprocessRuntime.list_sandboxes(config)
                  if i.id == rt.sandbox_id]
        await SubprocessRuntime.destroy_sandbox(info, config)
        out["after_destroy"] = os.listdir(root)
        await rt.close()

    anyio.run(main)
    print(json.dumps(out))
    """
)


@pytest.mark.attack(8)
async def test_close_and_cleanup_remove_locked_trees_as_a_dac_bound_host(tmp_path: Path) -> None:
    """Mode-000 directories and files need the permission fix; as root (CAP_DAC_OVERRIDE)
    they would not, so the host runs without capabilities here, as a plain user would."""
    host_dir, host_file = _host_sentinels(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    argv = [sys.executable, "-c", _DAC_BOUND, str(root), _plant(host_dir, host_file)]
    if os.geteuid() == 0:
        argv = ["setpriv", "--inh-caps=-all", "--bounding-set=-all", *argv]
    done = await anyio.run_process(argv, check=False, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr.decode()
    out = json.loads(done.stdout)
    assert out == {"dac_bound": True, "after_close": [], "after_destroy": []}
    _assert_host_untouched(host_dir, host_file)


_HOLDER = textwrap.dedent(
    """
    import sys, anyio
    from runtimes import SubprocessConfig, open_runtime

    async def main():
        rt = open_runtime(SubprocessConfig(root=sys.argv[1]))
        await rt.start()
        assert (await rt.exec(["sh", "-c", sys.argv[2]])).exit_code == 0
        for leftover in sys.argv[3:]:
            await rt.exec(["sh", "-c", leftover + " >/dev/null 2>&1 </dev/null &"])
        print("READY", flush=True)
        await anyio.sleep(600)

    anyio.run(main)
    """
)


@pytest.mark.attack(8, 9)
async def test_cleanup_of_a_dead_session_follows_no_link_and_leaves_no_process(
    tmp_path: Path, reaper: Reaper
) -> None:
    host_dir, host_file = _host_sentinels(tmp_path)
    root = tmp_path / "root"
    setsid_token, scrubbed_token = reaper.token(), reaper.token()
    holder = subprocess.Popen(  # noqa: ASYNC220 - a holder to SIGKILL
        [
            sys.executable,
            "-c",
            _HOLDER,
            str(root),
            _plant(host_dir, host_file),
            f"setsid sleep {setsid_token}",
            f"env -i setsid sleep {scrubbed_token}",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "READY"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert reaper.pids(setsid_token) and reaper.pids(scrubbed_token)  # control
    results = await cleanup_sandboxes([SubprocessConfig(root=str(root))])
    assert [r.action for r in results] == ["removed"]
    assert list(root.iterdir()) == []
    _assert_host_untouched(host_dir, host_file)
    assert _gone(reaper, setsid_token) and _gone(reaper, scrubbed_token)


# ---------------------------------------------------------------------- 9: close() leftovers


@pytest.mark.attack(9)
async def test_close_kills_a_setsid_leftover(tmp_path: Path, reaper: Reaper) -> None:
    token = reaper.token()
    async with open_runtime(SubprocessConfig(root=str(tmp_path))) as rt:
        await rt.exec(["sh", "-c", f"setsid sleep {token} >/dev/null 2>&1 </dev/null &"])
        pid = await reaper.started(token)
        assert isinstance(rt, SubprocessRuntime)
        assert _session(pid) not in rt.backend._sessions  # control: it left every session we made
    assert _gone(reaper, token)


@pytest.mark.attack(9)
async def test_close_kills_a_scrubbed_setsid_leftover_in_the_workdir(
    tmp_path: Path, reaper: Reaper
) -> None:
    token = reaper.token()
    async with open_runtime(SubprocessConfig(root=str(tmp_path))) as rt:
        await rt.exec(["sh", "-c", f"env -i setsid sleep {token} >/dev/null 2>&1 </dev/null &"])
        pid = await reaper.started(token)
        assert not any(v.startswith(MARK_VAR.encode()) for v in _environ(pid))  # control
    assert _gone(reaper, token)


@pytest.mark.attack(9)
async def test_close_kills_scrubbed_setsid_leftovers_that_left_the_workdir(
    tmp_path: Path, reaper: Reaper
) -> None:
    """cwd elsewhere, but an open file, or the executable, still in the sandbox."""
    by_fd, by_exe = reaper.token(), reaper.token()
    async with open_runtime(SubprocessConfig(root=str(tmp_path))) as rt:
        wd = rt.workdir
        await rt.exec(["sh", "-c", f"echo held > held && cp {shutil.which('sleep')} mysleep"])
        await rt.exec(
            [
                "sh",
                "-c",
                f"env -i setsid sh -c 'cd /; exec 3<{wd}/held; exec sleep {by_fd}' "
                ">/dev/null 2>&1 </dev/null &"
                f" env -i setsid sh -c 'cd /; exec {wd}/mysleep {by_exe}' "
                ">/dev/null 2>&1 </dev/null &",
            ]
        )
        assert os.readlink(f"/proc/{await reaper.started(by_fd)}/cwd") == "/"  # control
        assert os.readlink(f"/proc/{await reaper.started(by_exe)}/cwd") == "/"
    assert _gone(reaper, by_fd) and _gone(reaper, by_exe)


@pytest.mark.attack(9)
async def test_close_kills_a_leftover_that_left_no_trace_but_its_session(
    tmp_path: Path, reaper: Reaper
) -> None:
    """env -i, cd /, no file open, no setsid: its session is one the sandbox started."""
    token = reaper.token()
    async with open_runtime(SubprocessConfig(root=str(tmp_path))) as rt:
        await rt.exec(
            ["sh", "-c", f"env -i sh -c 'cd /; exec sleep {token}' >/dev/null 2>&1 </dev/null &"]
        )
        pid = await reaper.started(token)
        assert os.readlink(f"/proc/{pid}/cwd") == "/"  # control
    assert _gone(reaper, token)


@pytest.mark.attack(6, 9)
async def test_sweeps_spare_other_sandboxes_and_unrelated_host_processes(
    tmp_path: Path, reaper: Reaper
) -> None:
    other_token, host_token = reaper.token(), reaper.token()
    async with open_runtime(SubprocessConfig(root=str(tmp_path / "b"))) as other:
        await other.exec(["sh", "-c", f"setsid sleep {other_token} >/dev/null 2>&1 </dev/null &"])
        async with open_runtime(SubprocessConfig(root=str(tmp_path / "a"))) as rt:
            host = subprocess.Popen(["sleep", host_token], cwd=tmp_path)  # noqa: ASYNC220
            try:
                await rt.exec(["sh", "-c", f"sleep {reaper.token()} >/dev/null 2>&1 &"])
                assert await rt.stop_processes() == 1
            except BaseException:
                host.kill()
                raise
        assert reaper.pids(other_token) and host.poll() is None
        host.kill()
        host.wait()
    assert _gone(reaper, other_token)


# ---------------------------------------------------------------------- 6: fork loops


@pytest.mark.attack(6)
async def test_stop_processes_stops_a_fork_loop(tmp_path: Path, reaper: Reaper) -> None:
    token, beat = reaper.token(), tmp_path / "beat"
    async with open_runtime(SubprocessConfig(root=str(tmp_path / "root"))) as rt:
        await rt.exec(
            ["sh", "-c", f"{PYTHON} -c '{LOOP}' {beat} {token} >/dev/null 2>&1 </dev/null &"]
        )
        _wait_for_beats(beat)  # control: the loop runs (no setsid, no env -i)
        assert await rt.stop_processes() >= 1
        assert not _loop_alive(beat)
        assert not _loop_alive(beat, 0.5)
        assert (await rt.exec(["echo", "usable"])).stdout == "usable\n"
        assert await rt.stop_processes() == 0


@pytest.mark.attack(6)
async def test_close_stops_a_fork_loop(tmp_path: Path, reaper: Reaper) -> None:
    token, beat = reaper.token(), tmp_path / "beat"
    async with open_runtime(SubprocessConfig(root=str(tmp_path / "root"))) as rt:
        await rt.exec(
            ["sh", "-c", f"{PYTHON} -c '{LOOP}' {beat} {token} >/dev/null 2>&1 </dev/null &"]
        )
        _wait_for_beats(beat)
    assert not _loop_alive(beat)
    assert not _loop_alive(beat, 0.5)
    assert list((tmp_path / "root").iterdir()) == []


@pytest.mark.attack(6, 9)
async def test_stop_processes_stops_scrubbed_setsid_leftovers_and_loops(
    tmp_path: Path, reaper: Reaper
) -> None:
    """setsid and env -i, a sleeper and a fork loop that stays in the workdir."""
    sleeper, looper, beat = reaper.token(), reaper.token(), tmp_path / "beat"
    async with open_runtime(SubprocessConfig(root=str(tmp_path / "root"))) as rt:
        await rt.exec(
            [
                "sh",
                "-c",
                f"setsid sleep {sleeper} >/dev/null 2>&1 </dev/null & "
                f"env -i setsid {PYTHON} -c '{LOOP}' {beat} {looper} >/dev/null 2>&1 </dev/null &",
            ]
        )
        _wait_for_beats(beat)
        assert reaper.pids(sleeper)
        assert await rt.stop_processes() >= 2
        assert _gone(reaper, sleeper)
        assert not _loop_alive(beat)
        assert not _loop_alive(beat, 0.5)
