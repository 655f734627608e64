"""An out-of-memory kill is a typed error; any other SIGKILL stays a result.

Each sandbox has a 64 MiB memory limit, so the balloon (512 MiB) is bounded by the limit and
never reaches the host. What tells the two apart is the engine's ``oom`` event for the
container (``runtimes/docker/oom.py``), read through a local socket and through TCP.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

from runtimes import SandboxResourceError
from runtimes.docker import DockerConfig, DockerRuntime, oom
from runtimes.docker.client import ContainerRef
from runtimes.pytest_plugin import DockerRuntimeFactory
from tests.docker.proxy import EngineProxy

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

BALLOON = ["python3", "-c", "print('allocating', flush=True); b = bytearray(512 << 20)"]
SELF_KILL = ["sh", "-c", "echo dying; kill -9 $$"]


@pytest.fixture
def proxy() -> Iterator[EngineProxy]:
    with EngineProxy() as engine:
        yield engine


async def _limit_is_in_force(rt: DockerRuntime, docker_client: Any) -> None:
    """The balloon may only run where the limit holds it (never against the host)."""
    assert rt.sandbox_id is not None
    host = docker_client.containers.get(rt.sandbox_id).attrs["HostConfig"]
    assert host["Memory"] == 64 << 20


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("channel", [True, False], ids=["channel", "plain"])
async def test_a_command_the_memory_limit_kills_raises_and_the_sandbox_lives_on(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any, channel: bool
) -> None:
    async with docker_runtime_factory(memory="64MiB", channel=channel) as rt:
        await _limit_is_in_force(rt, docker_client)
        with pytest.raises(SandboxResourceError) as info:
            await rt.exec(BALLOON)
        err = info.value
        assert (err.limit, err.setting, err.exit_code) == ("memory", "64MiB", 137)
        assert err.stdout == "allocating\n", "the output written before the kill is attached"
        assert "memory limit" in str(err)

        after = await rt.exec(["sh", "-c", "echo still here"])
        assert (after.exit_code, after.stdout) == (0, "still here\n")
        assert rt.channel_info.state == ("running" if channel else "disabled")

        killed = await rt.exec(SELF_KILL)
        assert (killed.exit_code, killed.stdout) == (137, "dying\n"), (
            "a kill -9 right after an OOM kill is a result"
        )


async def test_a_plain_sigkill_is_a_result(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    async with docker_runtime_factory(memory=64) as rt:
        await _limit_is_in_force(rt, docker_client)
        result = await rt.exec(SELF_KILL)
        assert (result.exit_code, result.stdout) == (137, "dying\n")


async def test_a_timeout_falling_due_during_the_check_keeps_the_result(
    docker_runtime_factory: DockerRuntimeFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command finished; the look at the engine's events that follows a 137 (made to last
    3 s here) is not the command's time: a 2 s timeout passing meanwhile changes nothing."""
    monkeypatch.setattr(oom, "_LATE_EVENT", 3.0)
    async with docker_runtime_factory(memory=64) as rt:
        started = time.monotonic()
        result = await rt.exec(SELF_KILL, timeout=2)
        assert result.exit_code == 137
        assert time.monotonic() - started >= 3.0, "the check did wait for late events"


async def test_a_full_page_cache_is_no_oom(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    """Reading a file larger than the limit fills the cgroup to its limit (the counter a
    ``failcnt`` reading would take for an OOM) without killing anything: a kill -9 after it
    is still a result."""
    script = "head -c 128M /dev/zero > big && cat big > /dev/null && rm big && kill -9 $$"
    async with docker_runtime_factory(memory=64) as rt:
        await _limit_is_in_force(rt, docker_client)
        result = await rt.exec(["sh", "-c", script], timeout=120)
        assert result.exit_code == 137


async def test_a_child_the_limit_kills_is_the_commands_own_business(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    """Only the command's own death by the limit raises: a shell that sees its child
    OOM-killed and goes on returns what it returns."""
    script = "python3 -c 'b = bytearray(512 << 20)'; echo child=$?"
    async with docker_runtime_factory(memory=64) as rt:
        await _limit_is_in_force(rt, docker_client)
        result = await rt.exec(["sh", "-c", script])
        assert (result.exit_code, result.stdout) == (0, "child=137\n")


async def test_the_oom_is_seen_through_a_tcp_engine(proxy: EngineProxy, docker_client: Any) -> None:
    """The engine's event log answers over TCP as over the socket (a remote engine)."""
    async with DockerRuntime(DockerConfig(base_url=proxy.base_url, memory="64m")) as rt:
        await _limit_is_in_force(rt, docker_client)
        with pytest.raises(SandboxResourceError):
            await rt.exec(BALLOON)
        assert (await rt.exec(SELF_KILL)).exit_code == 137


class _FakeEngine:
    """Just the two Engine API calls of the check: ``/info`` and ``/events``."""

    def __init__(self, now: float, oom_at: float) -> None:
        self.now, self.oom_at = now, oom_at
        self.windows: list[tuple[float, float]] = []

    def info(self) -> dict[str, str]:
        stamp = datetime.fromtimestamp(self.now, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")
        return {"SystemTime": f"{stamp}123Z"}  # nanoseconds, as the engine writes it

    def events(self, *, since: str, until: str, **_: Any) -> Any:
        self.windows.append((float(since), float(until)))
        found = [{"timeNano": int(self.oom_at * 1e9)}] if float(since) <= self.oom_at else []
        return _Closing(found)


class _Closing(list):  # type: ignore[type-arg]
    def close(self) -> None:
        pass


async def test_one_oom_event_counts_for_one_check_only() -> None:
    """Two checks whose windows both hold the same event (a slow engine answer widens the
    window back past the command's start): the first takes it, the second does not."""
    engine = _FakeEngine(now=1_800_000_000.0, oom_at=1_799_999_999.5)
    ref = ContainerRef(engine, f"fake-{uuid.uuid4().hex}", DockerConfig(), "fake")
    assert await oom.oom_killed_since(ref, time.monotonic() - 2.0)
    engine.now += 0.2
    assert not await oom.oom_killed_since(ref, time.monotonic() - 2.0)
    assert engine.windows[0][0] <= 1_799_999_998.1, "the window reaches back to the start"
    assert engine.windows[1][0] >= 1_800_000_000.0, "the second starts where the first ended"
