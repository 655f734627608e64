"""Many requests at once over one channel: each gets its own bytes, caps stay per request."""

from __future__ import annotations

import hashlib
import random

import anyio
import pytest

from runtimes import OutputLimitExceededError
from runtimes.docker import DockerRuntime
from runtimes.pytest_plugin import DockerRuntimeFactory

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


async def _processes_with(rt: DockerRuntime, token: str) -> list[str]:
    listing = (await rt.exec(["ps", "-eo", "pid,args"])).stdout.splitlines()
    return [line for line in listing if token in line and "ps -eo" not in line]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_concurrent_requests_of_every_kind_are_multiplexed(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    rng = random.Random(8)
    payloads = {i: rng.randbytes(rng.randint(0, 600_000)) for i in range(48)}
    async with docker_runtime_factory() as rt:
        served_before = rt.channel_info.served

        async def exec_with_stdin(i: int) -> None:
            result = await rt.exec(["sha256sum"], stdin=payloads[i], timeout=60)
            assert result.stdout.split()[0] == hashlib.sha256(payloads[i]).hexdigest(), i

        async def streaming_exec(i: int) -> None:
            script = f'for n in $(seq 200); do echo "{i}:$n"; echo "e{i}:$n" >&2; done'
            result = await rt.exec(["sh", "-c", script], timeout=60)
            assert result.stdout == "".join(f"{i}:{n}\n" for n in range(1, 201)), i
            assert result.stderr == "".join(f"e{i}:{n}\n" for n in range(1, 201)), i

        async def file_round_trip(i: int) -> None:
            path = f"multi/{i}/data.bin"
            await rt.write(path, payloads[i])
            assert await rt.exists(path)
            assert await rt.read(path) == payloads[i], i
            await rt.remove(f"multi/{i}")
            assert not await rt.exists(path)

        async with anyio.create_task_group() as tg:
            for i in payloads:
                tg.start_soon((exec_with_stdin, streaming_exec, file_round_trip)[i % 3], i)
        info = rt.channel_info
        assert info.state == "running" and info.fallbacks == 0 and info.restarts == 0, info
        assert info.served - served_before >= 16 * 1 + 16 * 1 + 16 * 6, info


async def test_an_output_cap_stops_only_its_own_request(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    token = f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"
    async with docker_runtime_factory() as rt:
        outcomes: dict[str, object] = {}

        async def capped() -> None:
            try:
                await rt.exec(["sh", "-c", f"sleep {token} & yes"], output_limit=100_000)
            except OutputLimitExceededError as exc:
                outcomes["capped"] = exc

        async def neighbour() -> None:
            result = await rt.exec(["head", "-c", "3000000", "/dev/zero"], timeout=60)
            outcomes["neighbour"] = len(result.stdout_bytes)

        async with anyio.create_task_group() as tg:
            tg.start_soon(capped)
            tg.start_soon(neighbour)
        exc = outcomes["capped"]
        assert isinstance(exc, OutputLimitExceededError)
        assert len(exc.stdout_bytes) + len(exc.stderr_bytes) == 100_000
        assert exc.stdout_bytes.startswith(b"y\ny\n")
        assert outcomes["neighbour"] == 3_000_000
        for _ in range(40):
            if not await _processes_with(rt, token):
                break
            await anyio.sleep(0.05)
        assert not await _processes_with(rt, token), "the capped command's tree is still running"
        assert rt.channel_info.fallbacks == 0


async def test_read_caps_are_enforced_inside_the_sandbox(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """A file over max_bytes is refused from its size; a file whose size is unknown
    (/proc) is cut at the cap while streaming."""
    async with docker_runtime_factory() as rt:
        await rt.exec(["sh", "-c", "head -c 10000000 /dev/zero > ten-mb"])
        with pytest.raises(OutputLimitExceededError) as caught:
            await rt.read("ten-mb", max_bytes=1000)
        assert caught.value.limit == 1000 and caught.value.path == f"{rt.workdir}/ten-mb"
        maps = await rt.read("/proc/self/maps")
        assert len(maps) > 100
        with pytest.raises(OutputLimitExceededError):
            await rt.read("/proc/self/maps", max_bytes=10)
        assert rt.channel_info.fallbacks == 0


async def test_cancelling_one_request_leaves_the_others_running(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    token = f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"
    async with docker_runtime_factory() as rt:
        results: list[str] = []

        async def survivor(i: int) -> None:
            results.append((await rt.exec(["sh", "-c", f"sleep 1; echo {i}"])).stdout)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(survivor, i)
            with anyio.move_on_after(0.3):
                await rt.exec(["sh", "-c", f"sleep {token}"])
        assert sorted(results) == [f"{i}\n" for i in range(5)]
        assert not await _processes_with(rt, token)
        assert rt.channel_info.fallbacks == 0
