"""Docker-specific exec behaviour: process trees, exit codes the prelude must not
misread, users, argv limits, and an event loop that never blocks."""

from __future__ import annotations

import random
import time

import anyio
import pytest

from runtimes import (
    ExecTimeoutError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxPermissionError,
)
from runtimes.base import Runtime
from runtimes.pytest_plugin import DockerRuntimeFactory

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


async def _processes(rt: Runtime, token: str) -> list[str]:
    listing = await rt.exec(["ps", "-eo", "pid,pgid,args"])
    return [line for line in listing.stdout.splitlines() if token in line and "ps -eo" not in line]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_timeout_kills_the_whole_tree_inside_the_container(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    token = f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"
    script = f"sleep {token} & (sleep {token} & sleep {token}; wait) & sleep {token}; wait"
    async with docker_runtime_factory() as rt:
        started = time.monotonic()
        with pytest.raises(ExecTimeoutError):
            await rt.exec(["sh", "-c", script], timeout=1.0)
        assert time.monotonic() - started < 10
        assert await _processes(rt, token) == [], "no process of the command may survive"


async def test_programs_own_exit_codes_126_and_127_are_results(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory() as rt:
        assert (await rt.exec(["sh", "-c", "exit 127"])).exit_code == 127
        assert (await rt.exec(["sh", "-c", "exit 126"])).exit_code == 126
        # A shell reporting a missing command is the shell's result, not ours to reinterpret.
        result = await rt.exec(["sh", "-c", "vf-not-a-command"])
        assert result.exit_code == 127 and "not found" in result.stderr


async def test_missing_and_non_executable_programs_are_typed(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory() as rt:
        with pytest.raises(SandboxFileNotFoundError, match="/usr/bin/vf-missing"):
            await rt.exec(["/usr/bin/vf-missing"])
        with pytest.raises(SandboxPermissionError, match="/etc/hostname"):
            await rt.exec(["/etc/hostname"])
        with pytest.raises(SandboxPermissionError, match="/etc"):
            await rt.exec(["/etc"])
        await rt.exec(["sh", "-c", "mkdir -p /opt/bin && printf '#!/bin/sh\\n' > /opt/bin/tool"])
        with pytest.raises(SandboxPermissionError, match="tool"):
            await rt.exec(["tool"], env={"PATH": "/opt/bin:/usr/bin:/bin"})
        with pytest.raises(SandboxFileNotFoundError, match="missing-cwd"):
            await rt.exec(["true"], cwd="/work/missing-cwd")


async def test_caller_env_cannot_break_the_prelude(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    env = {"IFS": "x", "p": "kept", "__vf_p": "kept too", "CDPATH": "/tmp"}
    async with docker_runtime_factory() as rt:
        result = await rt.exec(["sh", "-c", 'printf "%s|%s" "$p" "$__vf_p"'], env=env)
        assert result.stdout == "kept|kept too", result


async def test_user_is_honoured_and_unknown_users_are_rejected(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory() as rt:
        assert (await rt.exec(["id", "-u"], user="nobody")).stdout == "65534\n"
        assert (await rt.exec(["id", "-u"], user="1234:1234")).stdout == "1234\n"
        with pytest.raises(SandboxInvalidArgumentError, match="user"):
            await rt.exec(["id"], user="vf-no-such-user")


async def test_argv_over_the_kernel_limit_is_invalid_argument(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    big = ["x" * (100 * 1024)] * 30  # 3 MiB: over ARG_MAX (2 MiB here)
    async with docker_runtime_factory() as rt:
        with pytest.raises(SandboxInvalidArgumentError, match="argument list too long"):
            await rt.exec(["true", *big])
        assert (await rt.exec(["echo", "still fine"])).stdout == "still fine\n"


async def test_stop_processes_kills_detached_daemons_without_the_mark(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    token = f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"
    daemon = f"(env -i setsid sleep {token} >/dev/null 2>&1 </dev/null &)"
    async with docker_runtime_factory() as rt:
        await rt.exec(["sh", "-c", daemon])
        assert len(await _processes(rt, token)) == 1
        assert await rt.stop_processes() >= 1
        assert await _processes(rt, token) == []
        assert (await rt.exec(["echo", "ok"])).stdout == "ok\n", "the container must survive"


async def test_the_event_loop_keeps_running_during_big_transfers(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    data = random.randbytes(50 * 1024 * 1024)
    gaps: list[float] = []
    done = anyio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await anyio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    async with docker_runtime_factory() as rt, anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await rt.write("/work/big.bin", data)
        assert await rt.read("/work/big.bin") == data
        result = await rt.exec(["sha256sum"], stdin=data, timeout=120)
        assert result.exit_code == 0
        done.set()
    # Generous: two cores shared with other work. A blocked loop would stall for seconds.
    assert max(gaps) < 0.5, f"the event loop stalled for {max(gaps):.2f}s"


async def test_a_non_root_sandbox_does_not_become_root(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory(user="nobody") as rt:
        assert (await rt.exec(["id", "-un"])).stdout == "nobody\n"
        for root in ("root", "0", "0:0"):
            with pytest.raises(SandboxPermissionError, match="cannot run as"):
                await rt.exec(["id", "-un"], user=root)
        assert (await rt.exec(["id", "-u"], user="1234")).stdout == "1234\n"
