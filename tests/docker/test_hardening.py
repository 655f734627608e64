"""Hardened defaults of owned Docker sandboxes (issue 22): what the engine was asked for
(its inspect, which the sandbox cannot forge), what is in force inside, each override, the
OCI runtime check, the read-only root filesystem, the disk quota and the pids limit.

Every hostile command is bounded in time (``timeout=``) and size (at most twice the quota,
at most a few hundred forks), and runs only after the limit it tests was seen in force."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from runtimes import ProvisioningError, RuntimeConfigError, SandboxError, open_runtime
from runtimes.docker.config import DEFAULT_CAPABILITIES
from runtimes.pytest_plugin import DockerRuntimeFactory
from runtimes.reaper import drain_removals
from runtimes.registry import resolve_runtime_config
from tests.docker.conftest import IMAGE, session_containers

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.usefixtures("no_leaks")]

GIB = 1 << 30
MIB = 1 << 20

# capabilities(7) bit numbers, for CapBnd in /proc/self/status
CAP_BITS = {
    "CHOWN": 0, "DAC_OVERRIDE": 1, "DAC_READ_SEARCH": 2, "FOWNER": 3, "FSETID": 4, "KILL": 5,
    "SETGID": 6, "SETUID": 7, "SETPCAP": 8, "NET_BIND_SERVICE": 10, "NET_RAW": 13,
    "SYS_CHROOT": 18, "SYS_PTRACE": 19, "MKNOD": 27, "AUDIT_WRITE": 29, "SETFCAP": 31,
}  # fmt: skip

STATUS = "grep -E '^(NoNewPrivs|CapBnd):' /proc/self/status"
PIDS_MAX = "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max"
MEMORY_MAX = (
    "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max"
)
SWAP_MAX = (  # v1: memory plus swap; v2: swap alone
    "cat /sys/fs/cgroup/memory/memory.memsw.limit_in_bytes 2>/dev/null "
    "|| cat /sys/fs/cgroup/memory.swap.max"
)


def host_config(docker_client: Any, rt: Any) -> dict[str, Any]:
    config: dict[str, Any] = docker_client.api.inspect_container(rt.sandbox_id)["HostConfig"]
    return config


def container_ids(docker_client: Any) -> set[str]:
    return {str(getattr(c, "id", "")) for c in session_containers(docker_client)}


def bounding_set(status: str) -> set[str]:
    """The named capabilities in ``CapBnd`` of ``/proc/self/status``."""
    line = next(x for x in status.splitlines() if x.startswith("CapBnd:"))
    mask = int(line.split()[1], 16)
    return {name for name, bit in CAP_BITS.items() if mask >> bit & 1}


async def shell(rt: Any, script: str, **kwargs: Any) -> Any:
    return await rt.exec(["sh", "-c", script], timeout=60, **kwargs)


async def limit_in_force(rt: Any, script: str) -> int:
    result = await shell(rt, script)
    assert result.exit_code == 0, result
    text = result.stdout.strip()
    return 1 << 62 if text == "max" else int(text)  # cgroup v2 spells "no limit" max


# ------------------------------------------------------------------ the defaults


async def test_defaults_reach_the_engine_and_hold_inside(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    async with docker_runtime_factory() as rt:
        host = host_config(docker_client, rt)
        assert host["Memory"] == 2 * GIB
        assert host["MemorySwap"] == 2 * GIB, "memory plus swap equal: no swap"
        assert host["PidsLimit"] == 1024
        assert host["SecurityOpt"] == ["no-new-privileges"]
        assert host["CapDrop"] == ["ALL"]
        assert sorted(host["CapAdd"]) == sorted(DEFAULT_CAPABILITIES)
        assert not host["ReadonlyRootfs"]

        assert await limit_in_force(rt, PIDS_MAX) == 1024
        assert await limit_in_force(rt, MEMORY_MAX) == 2 * GIB
        swap = await limit_in_force(rt, SWAP_MAX)
        assert swap in (2 * GIB, 0), "v1: memory+swap = memory; v2: no swap"
        for user in (None, rt.policy_user):
            status = (await shell(rt, STATUS, user=user)).stdout
            assert "NoNewPrivs:\t1" in status
            assert bounding_set(status) == set(DEFAULT_CAPABILITIES)


async def test_root_machinery_keeps_its_power_over_the_policys_files(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """DAC_OVERRIDE and FOWNER are kept for this: judges and harness steps run as root on
    what the policy left, private modes included."""
    async with docker_runtime_factory() as rt:
        policy = rt.policy_user
        made = await shell(
            rt, "mkdir -m 700 own && echo secret > own/f && chmod 600 own/f", user=policy
        )
        assert made.exit_code == 0, made
        assert await rt.read("own/f") == b"secret\n"
        await rt.write("own/judge-input", b"x")
        assert await rt.read("own/judge-input") == b"x"
        touched = await shell(rt, "chmod 644 own/f && touch -d @0 own/f && stat -c %a:%Y own/f")
        assert touched.stdout == "644:0\n", touched


async def test_a_non_root_sandbox_starts_with_the_defaults(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory(user="nobody") as rt:
        result = await shell(rt, "id -un; touch here && echo wrote")
        assert result.stdout == "nobody\nwrote\n", result


# ------------------------------------------------------------------ overrides


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        pytest.param(
            {"memory": None, "pids_limit": None},
            {"Memory": 0, "MemorySwap": 0, "PidsLimit": None},
            id="limits-off",
        ),
        pytest.param(
            {"memory": "256MiB", "memory_swap": "512MiB", "pids_limit": 200},
            {"Memory": 256 * MIB, "MemorySwap": 512 * MIB, "PidsLimit": 200},
            id="limits-changed",
        ),
        pytest.param({"security_opt": []}, {"SecurityOpt": None}, id="no-new-privileges-off"),
        pytest.param(
            {"capabilities": "engine"}, {"CapDrop": None, "CapAdd": None}, id="engine-caps"
        ),
        pytest.param(
            {"cap_add": ["net_raw", "CAP_SYS_PTRACE"]},
            {"CapDrop": ["ALL"], "CapAdd": [*DEFAULT_CAPABILITIES, "NET_RAW", "SYS_PTRACE"]},
            id="caps-added",
        ),
        pytest.param({"runtime": "runc"}, {"Runtime": "runc"}, id="runtime"),
    ],
)
async def test_each_default_can_be_changed(
    docker_runtime_factory: DockerRuntimeFactory,
    docker_client: Any,
    fields: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    async with docker_runtime_factory(**fields) as rt:
        host = host_config(docker_client, rt)
        assert {key: host[key] or None for key in expected} == {
            key: value or None for key, value in expected.items()
        }
        status = (await shell(rt, STATUS)).stdout
        no_new_privileges = "NoNewPrivs:\t1" in status
        assert no_new_privileges == (fields.get("security_opt") != [])
        caps = bounding_set(status)
        if fields.get("capabilities") == "engine":
            assert {"NET_RAW", "MKNOD", "SYS_CHROOT", "SETFCAP"} <= caps
        elif "cap_add" in fields:
            assert caps == {*DEFAULT_CAPABILITIES, "NET_RAW", "SYS_PTRACE"}
        else:
            assert caps == set(DEFAULT_CAPABILITIES)
        if fields.get("memory") is None and "memory" in fields:
            assert await limit_in_force(rt, MEMORY_MAX) > 16 * GIB, "no memory limit"


def test_an_attached_container_refuses_hardening_settings() -> None:
    attached = resolve_runtime_config({"type": "docker", "container": "web"})
    assert (attached.memory, attached.pids_limit) == (None, None)
    for fields in ({"read_only": True}, {"cap_add": ["NET_RAW"]}, {"runtime": "runsc"}):
        with pytest.raises(RuntimeConfigError, match="attached container"):
            resolve_runtime_config({"type": "docker", "container": "web", **fields})


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"cap_add": ["ALL"]}, "name the capabilities"),
        ({"cap_add": ["NET_RAWW"]}, "'NET_RAWW' is not a Linux capability"),
        ({"security_opt": ["seccomp-off"]}, "'seccomp-off' is not one the engine takes"),
        ({"capabilities": "none"}, "capabilities"),
        ({"runtime": "run sc"}, "runtime is the name of an OCI runtime"),
        ({"memory_swap": "1GiB"}, "below memory (2GiB)"),
        ({"memory": None, "memory_swap": "1GiB"}, "needs a memory limit"),
        ({"disk": "1GiB"}, "memory must be at least 2 x disk + 512MiB (2560MiB)"),
        ({"disk": "5m"}, "disk must be at least 6 MiB"),
        ({"read_only": True}, "policy account 'vf-policy' cannot be added to a read-only /etc"),
    ],
)
def test_bad_hardening_settings_are_config_errors(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(RuntimeConfigError) as info:
        resolve_runtime_config({"type": "docker", **fields})
    assert says in str(info.value)


# ------------------------------------------------------------------ OCI runtime


async def test_an_unknown_oci_runtime_is_refused_naming_the_offered_ones(
    docker_client: Any,
) -> None:
    offered = sorted(docker_client.info()["Runtimes"])
    missing = f"vf-no-such-runtime-{uuid.uuid4().hex[:6]}"
    before = container_ids(docker_client)
    with pytest.raises(ProvisioningError) as info:
        async with open_runtime({"type": "docker", "image": IMAGE, "runtime": missing}):
            pass
    message = str(info.value)
    assert missing in message
    assert all(repr(name) in message for name in offered), message
    await drain_removals()
    assert container_ids(docker_client) == before, "nothing created"


# ------------------------------------------------------------------ read-only root filesystem


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "plain"])
async def test_read_only_root_keeps_workdir_and_tmp_writable(
    docker_runtime_factory: DockerRuntimeFactory,
    docker_client: Any,
    tmp_path: Path,
    channel: bool,
) -> None:
    async with docker_runtime_factory(read_only=True, policy_user=None, channel=channel) as rt:
        assert host_config(docker_client, rt)["ReadonlyRootfs"] is True
        assert rt.channel_info.state == ("running" if channel else "disabled")
        etc = await shell(rt, "touch /etc/x /usr/x")
        assert etc.exit_code != 0 and "Read-only file system" in etc.stderr, etc
        ok = await shell(rt, "touch /work/a /tmp/b && echo ok")
        assert ok.stdout == "ok\n", ok

        await rt.write("f.txt", b"in workdir")
        await rt.write("/tmp/g.txt", b"in tmp")
        assert await rt.read("/work/f.txt") == b"in workdir"
        assert await rt.read("/tmp/g.txt") == b"in tmp"
        assert await rt.exists("/work/a")

        source = tmp_path / "up"
        (source / "sub").mkdir(parents=True)
        (source / "sub" / "x").write_bytes(b"uploaded")
        await rt.upload(source, "up")
        await rt.upload(source / "sub" / "x", "/tmp/x")
        assert await rt.read("up/sub/x") == await rt.read("/tmp/x") == b"uploaded"
        await rt.download("up", tmp_path / "down")
        assert (tmp_path / "down" / "sub" / "x").read_bytes() == b"uploaded"


async def test_read_only_with_a_policy_account_the_image_has(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory(read_only=True, policy_user="nobody") as rt:
        result = await shell(rt, "id -un; echo mine > p && cat p", user=rt.policy_user)
        assert result.stdout == "nobody\nmine\n", result
        result = await shell(rt, "touch /etc/x", user=rt.policy_user)
        assert result.exit_code != 0


@pytest.mark.parametrize("disk", [None, 32], ids=["engine-disk", "tmpfs"])
async def test_read_only_non_root_sandbox_owns_its_workdir_and_shares_tmp(
    docker_runtime_factory: DockerRuntimeFactory, disk: int | None
) -> None:
    async with docker_runtime_factory(read_only=True, user="nobody", disk=disk) as rt:
        result = await shell(rt, "stat -c %U /work; stat -c %a /tmp; echo x > f && cat f")
        assert result.stdout == "nobody\n1777\nx\n", result
        await rt.write("/tmp/mine", b"t")
        assert await rt.read("/tmp/mine") == b"t"


# ------------------------------------------------------------------ disk quota


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "plain"])
async def test_disk_quota_gives_enospc_and_the_sandbox_stays_usable(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any, channel: bool
) -> None:
    quota = 32  # MiB; each filler writes at most twice that
    async with docker_runtime_factory(disk=quota, channel=channel) as rt:
        sizes = await shell(rt, "df -k /work /tmp | tail -n 2")
        assert [line.split()[1] for line in sizes.stdout.splitlines()] == [str(quota * 1024)] * 2
        volumes = [
            m["Name"]
            for m in docker_client.api.inspect_container(rt.sandbox_id)["Mounts"]
            if m["Type"] == "volume"
        ]
        assert len(volumes) == 2

        for where in ("/work/big", "/tmp/big"):
            filled = await shell(rt, f"head -c {2 * quota}M /dev/zero > {where}; echo rc=$?")
            assert "No space left on device" in filled.stderr, filled
            assert filled.stdout.strip() != "rc=0", filled
        with pytest.raises(SandboxError, match=r"(?i)no space left on device"):
            await rt.write("/work/over", b"\0" * (quota * MIB))
        freed = await shell(rt, "rm -f /work/big /tmp/big /work/.vf-sandbox-write-*; echo ok")
        assert freed.stdout == "ok\n", freed
        await rt.write("after", b"fits")
        assert await rt.read("after") == b"fits"
    await drain_removals()
    assert not {v.name for v in docker_client.volumes.list()} & set(volumes), "volumes left"


# ------------------------------------------------------------------ pids limit


FORK_LOOP = r"""
import errno, os, sys
read_end, write_end = os.pipe()
children = 0
for _ in range(int(sys.argv[1])):
    try:
        pid = os.fork()
    except OSError as exc:
        print("EAGAIN" if exc.errno == errno.EAGAIN else f"errno {exc.errno}", children)
        break
    if pid == 0:
        os.close(write_end)
        os.read(read_end, 1)  # held until the parent exits
        os._exit(0)
    children += 1
else:
    print("no limit", children)
sys.stdout.flush()
os.close(write_end)
for _ in range(children):
    os.wait()
"""


async def test_pids_limit_stops_a_fork_loop_and_the_sandbox_answers_after(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    limit = 64
    async with docker_runtime_factory(pids_limit=limit) as rt:
        assert host_config(docker_client, rt)["PidsLimit"] == limit
        assert await limit_in_force(rt, PIDS_MAX) == limit
        result = await rt.exec(["python3", "-c", FORK_LOOP, str(4 * limit)], timeout=60)
        outcome, children = result.stdout.split()
        assert outcome == "EAGAIN", result
        assert int(children) < limit
        again = await rt.exec(["sh", "-c", "echo still here"], timeout=60)
        assert again.stdout == "still here\n"
