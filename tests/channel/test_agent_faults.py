"""The channel agent dies: typed errors for what was in flight, a restart for what comes next.

The agent is killed from OUTSIDE the runtime (``docker exec kill -9``), the way an OOM killer
or a policy's ``pkill python3`` would. A request in flight then fails with
``SandboxTransportError`` unless it is idempotent (reads and stats are retried through the
plain path); the command it was running is killed; the next call restarts the agent, at most
``MAX_RESTARTS`` times per ``RESTART_WINDOW``, after which calls take the plain path.
"""

from __future__ import annotations

import random
import types
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread
import pytest

from runtimes import (
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
    open_runtime,
)
from runtimes.base import Runtime
from runtimes.channel import MAX_RESTARTS
from runtimes.docker import DockerRuntime
from runtimes.pytest_plugin import DockerRuntimeFactory
from tests.modal.fake_modal import FakeModalService
from tests.modal.support import fake_config
from tests.ssh.sshd import SSHServer

pytestmark = pytest.mark.anyio


def _token() -> str:
    return f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"


async def _processes_with(rt: Runtime, token: str) -> list[str]:
    listing = (await rt.exec(["ps", "-eo", "pid,args"])).stdout.splitlines()
    return [line for line in listing if token in line and "ps -eo" not in line]


async def _assert_gone(rt: Runtime, token: str) -> None:
    for _ in range(40):
        if not await _processes_with(rt, token):
            return
        await anyio.sleep(0.05)
    raise AssertionError(f"left running: {await _processes_with(rt, token)}")


def _docker_killer(
    docker_client: Any, rt: DockerRuntime, signal: str = "KILL"
) -> Callable[[], Awaitable[None]]:
    container = docker_client.containers.get(rt.sandbox_id)

    async def kill() -> None:
        pid = rt.channel_info.agent_pid
        assert pid is not None
        code, out = await anyio.to_thread.run_sync(
            lambda: container.exec_run(["kill", f"-{signal}", str(pid)])
        )
        assert code == 0, out

    return kill


async def _wait_down(rt: Any) -> None:
    """Until the runtime noticed its agent died (the stream's EOF)."""
    with anyio.fail_after(10):
        while rt.channel_info.state == "running":  # noqa: ASYNC110 - polls another thread's view
            await anyio.sleep(0.01)


async def _during(
    call: Awaitable[object], delay: float, action: Callable[[], Awaitable[None]]
) -> Any:
    """Run ``call``; ``delay`` seconds in, run ``action``. Return its result or its error."""
    outcome: list[Any] = []

    async def run() -> None:
        try:
            outcome.append(await call)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    async def act() -> None:
        await anyio.sleep(delay)
        await action()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        tg.start_soon(act)
    return outcome[0]


async def _killed_mid_exec_then_restarted(rt: Any, kill: Callable[[], Awaitable[None]]) -> None:
    token = _token()
    first_agent = rt.channel_info.agent_pid
    exc = await _during(
        rt.exec(["sh", "-c", f"echo started; sleep {token}"], timeout=30), 0.5, kill
    )
    assert isinstance(exc, SandboxTransportError), repr(exc)
    assert not isinstance(exc, SandboxUnavailableError | FileNotFoundError)
    result = await rt.exec(["echo", "next"])
    assert result.stdout == "next\n", result
    info = rt.channel_info
    assert info.state == "running" and info.restarts == 1, info
    assert info.agent_pid != first_agent
    await _assert_gone(rt, token)


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_docker_agent_killed_mid_exec(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    async with docker_runtime_factory() as rt:
        await _killed_mid_exec_then_restarted(rt, _docker_killer(docker_client, rt))


async def test_ssh_agent_killed_mid_exec(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config()) as rt:

        async def kill() -> None:
            pid = rt.channel_info.agent_pid
            await anyio.to_thread.run_sync(sshd.docker_exec, f"kill -9 {pid}")

        await _killed_mid_exec_then_restarted(rt, kill)


async def test_modal_agent_killed_mid_exec(
    fake_service: FakeModalService, fake_modal: types.ModuleType, docker_client: Any
) -> None:
    async with open_runtime(fake_config()) as rt:
        assert rt.sandbox_id is not None
        container = docker_client.containers.get(fake_service.load(rt.sandbox_id).container)

        async def kill() -> None:
            pid = rt.channel_info.agent_pid
            code, out = await anyio.to_thread.run_sync(
                lambda: container.exec_run(["kill", "-9", str(pid)])
            )
            assert code == 0, out

        await _killed_mid_exec_then_restarted(rt, kill)


@pytest.mark.usefixtures("no_leaks")
@pytest.mark.parametrize("user", ["root", "nobody"])
async def test_a_read_in_flight_is_retried_through_the_plain_path(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any, user: str
) -> None:
    """A read is idempotent: the agent (stopped, so the read is surely in flight) dies, the
    plain path (archive API as root, exec as nobody) reads the file."""
    async with docker_runtime_factory(user=user) as rt:
        await rt.write("/tmp/data.txt", b"data\n")
        await _docker_killer(docker_client, rt, "STOP")()
        data = await _during(rt.read("/tmp/data.txt"), 0.3, _docker_killer(docker_client, rt))
        assert data == b"data\n", data
        assert rt.channel_info.fallbacks == 1, rt.channel_info


@pytest.mark.usefixtures("no_leaks")
async def test_a_write_in_flight_is_a_transport_error(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    """A write is not retried: the agent (stopped: the write is surely in flight) dies."""
    async with docker_runtime_factory() as rt:
        await _docker_killer(docker_client, rt, "STOP")()
        exc = await _during(rt.write("w.txt", b"x"), 0.3, _docker_killer(docker_client, rt))
        assert isinstance(exc, SandboxTransportError), repr(exc)
        assert not isinstance(exc, SandboxUnavailableError | FileNotFoundError)
        await rt.write("plain.txt", b"after")
        assert await rt.read("plain.txt") == b"after"


@pytest.mark.usefixtures("no_leaks")
async def test_fifos_and_sockets_are_refused_not_waited_on(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """A FIFO has no end: the agent refuses it at once, as the plain paths do."""
    async with docker_runtime_factory() as rt:
        await rt.exec(["mkfifo", "pipe"])
        with anyio.fail_after(5):
            with pytest.raises(SandboxInvalidArgumentError, match="FIFO"):
                await rt.read("pipe")
            with pytest.raises(SandboxInvalidArgumentError, match="FIFO"):
                await rt.write("pipe", b"x")
        assert rt.channel_info.fallbacks == 0 and rt.channel_info.restarts == 0


@pytest.mark.usefixtures("no_leaks")
async def test_a_command_that_kills_its_parent_kills_the_channel_only(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """Through the channel a command's parent is the agent: killing it is a transport error
    for that call (the plain path would report 137); the next call restarts the agent."""
    async with docker_runtime_factory() as rt:
        with pytest.raises(SandboxTransportError):
            await rt.exec(["sh", "-c", "kill -KILL $PPID; sleep 5"], timeout=30)
        assert (await rt.exec(["echo", "ok"])).stdout == "ok\n"
        assert rt.channel_info.restarts == 1


@pytest.mark.usefixtures("no_leaks")
async def test_an_agent_killed_while_idle_is_restarted_transparently(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    async with docker_runtime_factory() as rt:
        await _docker_killer(docker_client, rt)()
        await _wait_down(rt)
        assert (await rt.exec(["echo", "back"])).stdout == "back\n"
        assert await rt.read("/etc/hostname")
        info = rt.channel_info
        assert info.state == "running" and info.restarts == 1 and info.fallbacks == 0, info


@pytest.mark.usefixtures("no_leaks")
async def test_restarts_are_bounded_then_the_plain_path_serves(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    async with docker_runtime_factory() as rt:
        kill = _docker_killer(docker_client, rt)
        for restart in range(1, MAX_RESTARTS + 1):
            await kill()
            await _wait_down(rt)
            assert (await rt.exec(["echo", str(restart)])).stdout == f"{restart}\n"
            assert rt.channel_info.restarts == restart
        await kill()
        await _wait_down(rt)
        assert (await rt.exec(["echo", "plain"])).stdout == "plain\n"
        assert await rt.read("/etc/hostname")
        info = rt.channel_info
        assert info.state == "down" and info.restarts == MAX_RESTARTS, info
        assert info.fallbacks == 2, info


@pytest.mark.usefixtures("no_leaks")
async def test_stop_processes_spares_the_agent(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    token = _token()
    async with docker_runtime_factory() as rt:
        agent = rt.channel_info.agent_pid
        await rt.exec(["sh", "-c", f"(setsid sleep {token} >/dev/null 2>&1 </dev/null &)"])
        assert await rt.stop_processes() >= 1
        await _assert_gone(rt, token)
        info = rt.channel_info
        assert info.agent_pid == agent and info.state == "running" and info.restarts == 0, info
