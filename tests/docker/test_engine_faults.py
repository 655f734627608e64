"""An engine that stops answering is SandboxTransportError (after bounded retries on
idempotent calls); never a missing file, never a dead sandbox. The engine is reached
through a TCP proxy the test cuts; dockerd itself is never touched."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtimes import (
    ProvisioningError,
    SandboxFileNotFoundError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from runtimes.docker import DockerConfig, DockerRuntime
from runtimes.models import MiB
from runtimes.reaper import drain_removals
from tests.docker.proxy import EngineProxy

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


@pytest.fixture
def proxy() -> Iterator[EngineProxy]:
    with EngineProxy() as engine:
        yield engine


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_everything_works_through_a_tcp_engine(proxy: EngineProxy) -> None:
    async with DockerRuntime(DockerConfig(base_url=proxy.base_url)) as rt:
        data = b"\x00\xff" * MiB
        result = await rt.exec(["sha256sum"], stdin=data, timeout=60)
        assert result.exit_code == 0
        assert (await rt.exec(["cat"], stdin=b"eof reaches cat", timeout=20)).stdout == (
            "eof reaches cat"
        )
        await rt.write("/work/a/b.bin", data)
        assert await rt.read("/work/a/b.bin") == data
        with pytest.raises(SandboxFileNotFoundError):
            await rt.read("/work/missing")


async def test_cut_engine_is_transport_error_on_every_call(
    proxy: EngineProxy, docker_client: Any, tmp_path: Path
) -> None:
    config = DockerConfig(base_url=proxy.base_url, retries=2, api_timeout=5)
    rt = DockerRuntime(config)
    await rt.start()
    container_id = rt.sandbox_id
    try:
        proxy.cut()
        calls = {
            "exec": lambda: rt.exec(["true"]),
            "read": lambda: rt.read("/etc/hostname"),
            "write": lambda: rt.write("/tmp/x", b"x"),
            "exists": lambda: rt.exists("/etc/hostname"),
            "alive": lambda: rt.alive(),
            "download": lambda: rt.download("/etc/hostname", tmp_path / "h"),
        }
        for name, call in calls.items():
            started = time.monotonic()
            with pytest.raises(SandboxTransportError) as caught:
                await call()
            assert isinstance(caught.value, ConnectionError), name
            assert not isinstance(caught.value, SandboxUnavailableError | FileNotFoundError)
            assert time.monotonic() - started < 10, f"{name}: retries must be bounded"
        with pytest.raises(SandboxTransportError):
            await DockerRuntime.list_sandboxes(config)
        # The container itself is fine: seen through the real socket, it still runs.
        assert docker_client.containers.get(container_id).status == "running"
        proxy.restore()
        assert (await rt.exec(["echo", "back"])).stdout == "back\n"
    finally:
        proxy.restore()
        await rt.close()
    await drain_removals()
    assert not docker_client.containers.list(all=True, filters={"id": container_id})


async def test_idempotent_calls_ride_out_a_short_outage(proxy: EngineProxy) -> None:
    config = DockerConfig(base_url=proxy.base_url, retries=4)
    async with DockerRuntime(config) as rt:
        await rt.write("/work/f", b"data")
        proxy.cut()
        restore = threading.Timer(0.3, proxy.restore)
        restore.start()
        try:
            assert await rt.read("/work/f") == b"data", "a read is retried until the engine answers"
        finally:
            restore.cancel()
            proxy.restore()


async def test_engine_that_hangs_is_transport_error_within_the_api_timeout(
    proxy: EngineProxy,
) -> None:
    config = DockerConfig(base_url=proxy.base_url, retries=1, api_timeout=1)
    async with DockerRuntime(config) as rt:
        proxy.hang()
        started = time.monotonic()
        with pytest.raises(SandboxTransportError):
            await rt.exists("/etc/hostname")
        assert time.monotonic() - started < 8
        proxy.restore()


async def test_unreachable_engine_at_start_is_provisioning_error(proxy: EngineProxy) -> None:
    proxy.cut()
    config = DockerConfig(base_url=proxy.base_url, retries=1, api_timeout=2)
    with pytest.raises(ProvisioningError, match=r"did not answer|cannot reach"):
        await DockerRuntime(config).start()
