"""Typed outcomes at the limits (issue 22): the runtime's own writes past the disk quota raise
``SandboxNoSpaceError`` (an ``OSError`` with ``ENOSPC``) and leave nothing behind; at the
process limit a command that cannot start raises ``SandboxProcessLimitError`` and
``stop_processes()`` still frees the sandbox (the channel's agent sweeps without forking);
a sandbox whose workdir is a volume refuses to be snapshotted.

Every hostile load is bounded (at most twice the quota written; at most 256 forks, each
process gone after ``HOLD`` seconds whatever happens) and starts only once its limit is seen
in force, from outside (the engine's inspect) and inside.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes.channel import core
from runtimes.channel.agent import serve, wire
from runtimes.channel.agent.output import Refused
from runtimes.channel.agent.wire import SweepHeader
from runtimes.docker import DockerRuntime
from runtimes.docker.files import archive_error
from runtimes.errors import (
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxNoSpaceError,
    SandboxProcessLimitError,
)
from runtimes.models import ExecRequest
from runtimes.pytest_plugin import DockerRuntimeFactory
from runtimes.snapshot import SnapshotUnsupportedError
from runtimes.sweep import CLOCK_TICK_SCRIPT, MARK_VAR, sweep_argv

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.usefixtures("no_leaks")]

MIB = 1 << 20
QUOTA = 16  # MiB of the workdir and of /tmp each
PIDS = 64
HOLD = 90.0
"""Seconds after which every process of the fork holder exits on its own."""

PIDS_MAX = "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max"

HOLDER = r"""
import errno, os, sys, time
budget, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
forks = 0
while forks < budget and time.monotonic() < deadline:
    try:
        pid = os.fork()
    except OSError as exc:
        if exc.errno != errno.EAGAIN:
            raise
        time.sleep(0.01)  # at the limit: take the next slot that frees
        continue
    if pid == 0:
        time.sleep(max(0.0, deadline - time.monotonic()))
        os._exit(0)
    forks += 1
time.sleep(max(0.0, deadline - time.monotonic()))
"""
"""Forks until the sandbox is at its process limit (at most ``argv[1]`` forks) and keeps it
there, re-forking whenever a slot frees; everything exits at ``argv[2]`` seconds."""


def host_config(docker_client: Any, rt: DockerRuntime) -> dict[str, Any]:
    config: dict[str, Any] = docker_client.api.inspect_container(rt.sandbox_id)["HostConfig"]
    return config


async def quota_in_force(rt: DockerRuntime, docker_client: Any) -> None:
    """The workdir and /tmp are tmpfs volumes of QUOTA MiB, seen from outside and inside."""
    mounts = docker_client.api.inspect_container(rt.sandbox_id)["Mounts"]
    assert {m["Destination"] for m in mounts if m["Type"] == "volume"} == {"/work", "/tmp"}
    sizes = await rt.exec(["sh", "-c", "df -k /work /tmp | tail -n 2"], timeout=30)
    assert [line.split()[1] for line in sizes.stdout.splitlines()] == [str(QUOTA * 1024)] * 2


async def pids_limit_in_force(rt: DockerRuntime, docker_client: Any) -> None:
    assert host_config(docker_client, rt)["PidsLimit"] == PIDS
    inside = await rt.exec(["sh", "-c", PIDS_MAX], timeout=30)
    assert inside.stdout.strip() == str(PIDS), inside


def pids_current(docker_client: Any, rt: DockerRuntime) -> int:
    """The container's task count, from the engine (never from inside the sandbox)."""
    stats = docker_client.api.stats(rt.sandbox_id, stream=False, one_shot=True)
    return int(stats["pids_stats"].get("current", 0))


def kill_holder(docker_client: Any, rt: DockerRuntime) -> None:
    """SIGKILL every process of the fork holder, by its host pid (the engine's ``top``), each
    only once this host's ``/proc`` shows that pid running the holder. Where the test cannot
    signal it (another pid namespace, not root), the holder's own deadline still ends it."""
    top = docker_client.api.top(rt.sandbox_id, ps_args="-eo pid")
    for (pid,) in top["Processes"]:
        with contextlib.suppress(ProcessLookupError, PermissionError, FileNotFoundError):
            if b"budget, deadline" in Path(f"/proc/{int(pid)}/cmdline").read_bytes():
                os.kill(int(pid), signal.SIGKILL)


async def wait_until_full(docker_client: Any, rt: DockerRuntime) -> None:
    with anyio.fail_after(60):
        while await anyio.to_thread.run_sync(pids_current, docker_client, rt) < PIDS:  # noqa: ASYNC110 - the engine has no event for it
            await anyio.sleep(0.2)


async def leftovers(rt: DockerRuntime) -> list[str]:
    """Names of the runtime's temporary files left in the workdir and /tmp."""
    found = await rt.exec(["sh", "-c", "ls -A /work /tmp | grep -F .vf-sandbox-write-"])
    return found.stdout.split()


async def used_kib(rt: DockerRuntime, where: str) -> int:
    result = await rt.exec(["sh", "-c", f"df -k {where} | tail -n 1"], timeout=30)
    return int(result.stdout.split()[2])


# ------------------------------------------------------------------ disk quota


@pytest.mark.parametrize(
    ("user", "channel"),
    [
        pytest.param(None, True, id="root-channel"),
        pytest.param(None, False, id="root-archive"),
        pytest.param("nobody", True, id="nobody-channel"),
    ],
)
async def test_a_write_past_the_quota_is_enospc_and_leaves_no_temp_file(
    docker_runtime_factory: DockerRuntimeFactory,
    docker_client: Any,
    user: str | None,
    channel: bool,
) -> None:
    async with docker_runtime_factory(disk=QUOTA, user=user, channel=channel) as rt:
        await quota_in_force(rt, docker_client)
        assert rt.channel_info.state == ("running" if channel else "disabled")
        for where in ("/work", "/tmp"):
            with pytest.raises(SandboxNoSpaceError) as info:
                await rt.write(f"{where}/over", b"\0" * (2 * QUOTA * MIB))
            err = info.value
            assert isinstance(err, OSError) and isinstance(err, SandboxError)
            assert err.errno == errno.ENOSPC
            assert err.filename == f"{where}/over"
            assert "No space left on device" in str(err)
            # Nothing of the failed write holds the quota: a write of most of it fits at once.
            assert await leftovers(rt) == []
            assert await used_kib(rt, where) < 1024
            await rt.write(f"{where}/fits", b"\1" * (QUOTA * MIB * 3 // 4))
            assert (await rt.exec(["rm", f"{where}/fits"])).exit_code == 0


async def test_a_write_as_a_non_root_user_without_the_channel_is_enospc(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    """The plain path of a non-root sandbox writes through ``cat`` as that user, in place (a
    failed write leaves the target partly written: no temporary file to remove)."""
    async with docker_runtime_factory(disk=QUOTA, user="nobody", channel=False) as rt:
        await quota_in_force(rt, docker_client)
        with pytest.raises(SandboxNoSpaceError) as info:
            await rt.write("over", b"\0" * (2 * QUOTA * MIB))
        assert info.value.errno == errno.ENOSPC


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "archive"])
async def test_an_upload_past_the_quota_is_enospc(
    docker_runtime_factory: DockerRuntimeFactory,
    docker_client: Any,
    tmp_path: Any,
    channel: bool,
) -> None:
    big = tmp_path / "big.bin"
    big.write_bytes(b"\0" * (2 * QUOTA * MIB))
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "big.bin").write_bytes(b"\0" * (2 * QUOTA * MIB))
    async with docker_runtime_factory(disk=QUOTA, channel=channel) as rt:
        await quota_in_force(rt, docker_client)
        with pytest.raises(SandboxNoSpaceError) as info:
            await rt.upload(big, "big.bin")
        assert info.value.errno == errno.ENOSPC
        assert await leftovers(rt) == []
        with pytest.raises(SandboxNoSpaceError):
            await rt.upload(tree, "tree")


async def test_a_command_past_the_quota_gets_enospc_in_its_own_output(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    async with docker_runtime_factory(disk=QUOTA) as rt:
        await quota_in_force(rt, docker_client)
        filled = await rt.exec(["sh", "-c", f"head -c {2 * QUOTA}M /dev/zero > big"], timeout=60)
        assert filled.exit_code != 0
        assert "No space left on device" in filled.stderr, filled


# ------------------------------------------------------------------ process limit


async def test_at_the_process_limit_exec_is_typed_and_stop_processes_frees_the_sandbox(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    async with docker_runtime_factory(pids_limit=PIDS) as rt:
        assert rt.channel_info.state == "running"
        await pids_limit_in_force(rt, docker_client)
        script = 'python3 -c "$1" 256 "$2" >/dev/null 2>&1 &'
        started = await rt.exec(["sh", "-c", script, "sh", HOLDER, str(HOLD)], timeout=30)
        assert started.exit_code == 0, started
        await wait_until_full(docker_client, rt)

        with pytest.raises(SandboxProcessLimitError) as info:
            await rt.exec(["true"], timeout=30)
        err = info.value
        assert isinstance(err, BlockingIOError) and isinstance(err, SandboxError)
        assert err.errno == errno.EAGAIN
        assert (err.filename, err.limit, err.setting) == ("true", "pids", str(PIDS))
        assert "process limit (pids_limit) of 64" in str(err)

        killed = await rt.stop_processes()
        assert killed >= PIDS - 8, "the holder and its children (the agent and init are spared)"
        after = await rt.exec(["true"], timeout=30)
        assert after.exit_code == 0
        assert await rt.stop_processes() == 0
        assert rt.channel_info.state == "running"


async def test_a_fork_loop_at_the_limit_is_stopped_through_the_channel_only(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    """Without the channel the sweep is a script, which cannot fork at the limit: it fails
    (typed, saying so) or gets through, never hangs; once the holder is gone it works."""
    async with docker_runtime_factory(pids_limit=PIDS, channel=False) as rt:
        await pids_limit_in_force(rt, docker_client)
        script = 'python3 -c "$1" 256 "$2" >/dev/null 2>&1 &'
        await rt.exec(["sh", "-c", script, "sh", HOLDER, "20"], timeout=30)
        await wait_until_full(docker_client, rt)
        with anyio.fail_after(60):
            try:
                await rt.stop_processes()
            except SandboxError as exc:
                assert "could not" in str(exc) or "fork" in str(exc).lower(), exc
        # The holder is ended from the host (nothing can start inside the full sandbox)
        # instead of waiting for its own deadline (20 s).
        with anyio.fail_after(60):
            while await anyio.to_thread.run_sync(pids_current, docker_client, rt) >= PIDS:
                await anyio.to_thread.run_sync(kill_holder, docker_client, rt)
                await anyio.sleep(0.2)
        await rt.stop_processes()
        assert (await rt.exec(["true"], timeout=30)).exit_code == 0


# ------------------------------------------------------------------ the agent's sweep


SCENARIO = r"""
exec >/dev/null 2>&1  # the sleeps must not hold the command's output open
sleep 300 &                                   # A: carries the mark, works in /work
sleep 0.2
sh -c "$CLOCK" > /tmp/tick                    # T: A started before, B and C after
sleep 0.2
cd /tmp && setsid env -i sleep 301 &          # B: no mark, in /tmp
# C: nobody's, no mark, in /
cd / && setsid setpriv --reuid=nobody --regid=nogroup --clear-groups env -i sleep 302 &
sleep 0.2
"""


async def survivors(rt: DockerRuntime) -> set[str]:
    listed = await rt.exec(["sh", "-c", "ps -eo args | grep -E '^sleep 30[0-2]$' || true"])
    return set(listed.stdout.split("\n")) - {""}


@pytest.mark.parametrize(
    ("mode", "user", "home", "left"),
    [
        pytest.param("all", "", "", set(), id="all"),
        pytest.param("mark", "", "", {"sleep 301", "sleep 302"}, id="mark"),
        pytest.param("mark", "nobody", "", {"sleep 301"}, id="mark-user"),
        pytest.param("mark", "", "/tmp", {"sleep 302"}, id="mark-home"),
        pytest.param("since", "", "", {"sleep 300"}, id="since"),
    ],
)
@pytest.mark.parametrize("by", ["agent", "script"])
async def test_the_agent_sweeps_as_the_script_does(
    docker_runtime_factory: DockerRuntimeFactory,
    mode: str,
    user: str,
    home: str,
    left: set[str],
    by: str,
) -> None:
    """The agent's sweep selects what ``scripts/sweep.sh`` selects, mode by mode (the script
    runs too, as the control that the expectation is right)."""
    async with docker_runtime_factory(policy_user=None) as rt:
        env = {"CLOCK": CLOCK_TICK_SCRIPT}
        made = await rt.exec(["sh", "-c", SCENARIO], env=env, timeout=60)
        assert made.exit_code == 0, made
        assert len(await survivors(rt)) == 3
        tick = (await rt.read("/tmp/tick")).decode().strip()
        full = f"since:{tick}" if mode == "since" else mode
        mark = f"{MARK_VAR}={rt._mark}"
        if by == "agent":
            killed = await rt._sweep_by_agent(SweepHeader(full, mark, user, home))
            assert killed is not None
        else:
            argv = sweep_argv(full, mark, keep=rt.channel_info.agent_pid, user=user, home=home)
            swept = await rt.exec(argv, user="0", timeout=60)
            killed = int(swept.stdout)
        assert killed >= 3 - len(left)  # the sleeps, and any shell still waiting on one
        assert await survivors(rt) == left
        await rt.stop_processes()


# ------------------------------------------------------------------ no thread to be had


def agent_frames(read_end: int) -> list[tuple[int, int, bytes]]:
    """The frames an agent wrote so far: (kind, request id, payload)."""
    data = b""
    while select.select([read_end], [], [], 0)[0]:
        data += os.read(read_end, 1 << 16)
    frames, pos = [], 0
    while pos < len(data):
        kind, rid, size = wire.HEADER.unpack_from(data, pos)
        start = pos + wire.HEADER.size
        frames.append((kind, rid, data[start : start + size]))
        pos = start + size + wire.TAG
    return frames


@pytest.fixture
def agent() -> Iterator[tuple[serve.Agent, int]]:
    """An agent (run here, on the host: it is standard library only) whose output is a pipe."""
    read_end, write_end = os.pipe()
    try:
        yield serve.Agent(-1, write_end, b"k" * wire.KEY), read_end
    finally:
        os.close(read_end)
        os.close(write_end)


def no_thread(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("can't start new thread")  # what clone's EAGAIN becomes in Python


def test_workers_refuse_when_no_thread_can_be_made_and_queue_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workers = serve.Workers()
    ran: list[str] = []
    done = threading.Event()
    with monkeypatch.context() as patch:
        patch.setattr(threading.Thread, "start", no_thread)
        with pytest.raises(Refused) as info:
            workers.submit(ran.append, "refused")
    assert (info.value.num, info.value.what) == (errno.EAGAIN, "pids")
    workers.submit(lambda: (ran.append("served"), done.set()))
    assert done.wait(10)
    assert ran == ["served"], "the refused task never runs later"


def test_an_exec_the_agent_cannot_serve_is_killed_and_reported_as_the_limit(
    agent: tuple[serve.Agent, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    server, read_end = agent
    launched: list[Any] = []
    launch = serve.Exec.launch

    def recorded(command: Any) -> bool:
        launched.append(command)
        return launch(command)

    monkeypatch.setattr(serve.Exec, "launch", recorded)

    def refuse(*args: Any) -> None:
        raise Refused(errno.EAGAIN, "pids", "64")

    monkeypatch.setattr(server.workers, "submit", refuse)
    header = wire.ExecHeader(["sleep", "30"], str(tmp_path), {}, None, 1 << 20, False, True)
    server.dispatch(wire.EXEC, 7, wire.prefixed(header.to_wire()))

    (proc,) = [command.proc for command in launched]
    assert proc.returncode == -signal.SIGKILL, "the command it could not serve was killed"
    errors = [p for kind, rid, p in agent_frames(read_end) if (kind, rid) == (wire.ERROR, 7)]
    report = wire.ErrorReport.from_wire(errors[0])
    assert (report.num, report.what, report.message) == (errno.EAGAIN, "pids", "64")
    assert server.requests == {}


def test_a_file_request_without_a_thread_is_refused_as_the_limit(
    agent: tuple[serve.Agent, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, read_end = agent
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    server.dispatch(wire.STAT, 3, wire.PathHeader("/").to_wire())
    server.dispatch(wire.READ, 4, wire.ReadHeader("/etc/hostname", 1 << 20).to_wire())
    reports = {
        rid: wire.ErrorReport.from_wire(p)
        for kind, rid, p in agent_frames(read_end)
        if kind == wire.ERROR
    }
    assert {rid: (r.num, r.what) for rid, r in reports.items()} == {
        3: (errno.EAGAIN, "pids"),
        4: (errno.EAGAIN, "pids"),
    }
    assert server.requests == {}


@pytest.mark.parametrize("setting", ["64", ""])
def test_the_host_types_the_agents_process_limit_report(setting: str) -> None:
    payload = wire.ErrorReport(errno.EAGAIN, "pids", setting or "Resource temporarily unavailable")
    request = ExecRequest(("make", "-j"), "/work", {}, None, None, None, 1 << 20)
    err = core._exec_error(payload, request)
    assert isinstance(err, SandboxProcessLimitError)
    assert (err.filename, err.setting) == ("make", setting or None)
    read = core._file_error(payload, "/work/f", 0)
    assert isinstance(read, SandboxProcessLimitError) and read.filename == "/work/f"


def test_the_engines_no_space_text_is_typed() -> None:
    message = (
        "Error processing tar file(exit status 1): write /work/.vf-sandbox-write-ab12: "
        "no space left on device"
    )
    full = archive_error(500, message, "/work/f")
    assert type(full) is SandboxNoSpaceError and full.errno == errno.ENOSPC
    quota = archive_error(500, "write /work/x: disk quota exceeded", "/work/f")
    assert type(quota) is SandboxNoSpaceError and quota.errno == errno.EDQUOT


# ------------------------------------------------------------------ snapshots


@pytest.mark.parametrize(
    "fields",
    [{"disk": QUOTA}, {"read_only": True, "policy_user": None}],
    ids=["disk", "read_only"],
)
async def test_a_sandbox_with_its_workdir_in_a_volume_refuses_a_snapshot(
    docker_runtime_factory: DockerRuntimeFactory, fields: dict[str, Any]
) -> None:
    async with docker_runtime_factory(**fields) as rt:
        before = await DockerRuntime.list_snapshots(rt.config)
        with pytest.raises(SnapshotUnsupportedError) as info:
            await rt.snapshot()
        assert isinstance(info.value, SandboxInvalidArgumentError)
        assert next(iter(fields)) in str(info.value) and "workdir" in str(info.value)
        assert await DockerRuntime.list_snapshots(rt.config) == before, "nothing committed"
        assert (await rt.exec(["true"])).exit_code == 0
