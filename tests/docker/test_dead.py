"""A dead container is SandboxUnavailableError on every call; a missing file is not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import SandboxFileNotFoundError, SandboxUnavailableError
from runtimes.base import Runtime
from runtimes.pytest_plugin import DockerRuntimeFactory

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


async def _every_call_is_unavailable(rt: Runtime, tmp_path: Path) -> None:
    calls = {
        "exec": lambda: rt.exec(["echo", "hi"]),
        "exec with stdin": lambda: rt.exec(["cat"], stdin=b"data"),
        "read": lambda: rt.read("/etc/hostname"),
        "read missing": lambda: rt.read("/no/such/file"),
        "write": lambda: rt.write("/tmp/x", b"x"),
        "exists": lambda: rt.exists("/etc/hostname"),
        "exists missing": lambda: rt.exists("/no/such/file"),
        "remove": lambda: rt.remove("/tmp/x"),
        "upload": lambda: rt.upload(tmp_path, "/tmp/up"),
        "download": lambda: rt.download("/etc", tmp_path / "down"),
    }
    for name, call in calls.items():
        with pytest.raises(SandboxUnavailableError) as caught:
            await call()
        assert not isinstance(caught.value, FileNotFoundError), name
    assert not await rt.alive()


def _stop(container: Any) -> None:
    container.stop(timeout=1)


def _kill(container: Any) -> None:
    container.kill()


def _remove(container: Any) -> None:
    container.remove(force=True)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("end", [_kill, _stop, _remove], ids=["killed", "stopped", "removed"])
async def test_dead_container_is_unavailable_everywhere(
    end: Any,
    docker_runtime_factory: DockerRuntimeFactory,
    docker_client: Any,
    tmp_path: Path,
) -> None:
    (tmp_path / "f.txt").write_text("x")
    async with docker_runtime_factory() as rt:
        assert rt.sandbox_id is not None
        container = docker_client.containers.get(rt.sandbox_id)
        await anyio.to_thread.run_sync(end, container)
        await _every_call_is_unavailable(rt, tmp_path)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("end", [_kill, _remove], ids=["killed", "removed"])
async def test_container_dying_mid_exec_is_unavailable_not_an_exit_code(
    end: Any, docker_runtime_factory: DockerRuntimeFactory, docker_client: Any, tmp_path: Path
) -> None:
    async with docker_runtime_factory() as rt:
        assert rt.sandbox_id is not None
        container = docker_client.containers.get(rt.sandbox_id)

        async def end_soon() -> None:
            await anyio.sleep(0.5)
            await anyio.to_thread.run_sync(end, container)

        async with anyio.create_task_group() as tg:
            tg.start_soon(end_soon)
            with pytest.raises(SandboxUnavailableError):
                await rt.exec(["sh", "-c", "echo started; sleep 30"], timeout=20)
        await _every_call_is_unavailable(rt, tmp_path)


async def test_missing_file_in_a_live_container_is_file_not_found(
    docker_runtime_factory: DockerRuntimeFactory, tmp_path: Path
) -> None:
    async with docker_runtime_factory() as rt:
        with pytest.raises(SandboxFileNotFoundError) as caught:
            await rt.read("/work/missing.txt")
        assert not isinstance(caught.value, SandboxUnavailableError)
        assert caught.value.filename == "/work/missing.txt"
        with pytest.raises(SandboxFileNotFoundError):
            await rt.download("/work/missing-dir", tmp_path / "x")
        with pytest.raises(SandboxFileNotFoundError):
            await rt.remove("/work/missing.txt")
        assert not await rt.exists("/work/missing.txt")
        assert await rt.alive()


async def test_paused_container_is_unavailable(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any, tmp_path: Path
) -> None:
    async with docker_runtime_factory() as rt:
        container = docker_client.containers.get(rt.sandbox_id)
        container.pause()
        try:
            with pytest.raises(SandboxUnavailableError):
                await rt.exec(["true"])
            with pytest.raises(SandboxUnavailableError):
                await rt.read("/etc/hostname")
            assert not await rt.alive()
        finally:
            container.unpause()
        assert (await rt.exec(["echo", "back"])).stdout == "back\n"


async def test_close_after_external_removal_is_quiet(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    rt = docker_runtime_factory()
    await rt.start()
    docker_client.containers.get(rt.sandbox_id).remove(force=True)
    await rt.close()
    assert rt.closed
