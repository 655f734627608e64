"""Owned and attached containers: creation, labels, settings, close, limits."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest

from runtimes import ProvisioningError, SandboxUnavailableError, open_runtime, ownership
from runtimes.docker import DockerConfig, DockerRuntime
from runtimes.limits import live_cap
from runtimes.pytest_plugin import DockerRuntimeFactory
from runtimes.reaper import drain_removals
from tests.docker.conftest import IMAGE, session_containers

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


async def test_owned_container_carries_labels_and_settings(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    rt = docker_runtime_factory(
        labels={"team": "rl"}, cpus=0.5, memory="256MiB", pids_limit=128, hostname="box"
    )
    async with rt:
        assert rt.sandbox_id is not None
        container = docker_client.containers.get(rt.sandbox_id)
        labels = container.labels
        assert labels[ownership.CREATOR] == ownership.CREATOR_ID
        assert labels[ownership.BACKEND] == "docker"
        assert labels[ownership.OWNER] and labels[ownership.CREATED]
        assert labels["team"] == "rl"
        host = container.attrs["HostConfig"]
        assert host["NanoCpus"] == 500_000_000
        assert host["Memory"] == 256 * 1024 * 1024
        assert host["PidsLimit"] == 128
        assert host["NetworkMode"] == "none"
        assert host["Init"] is True
        assert rt.workdir == "/work"
        assert (await rt.exec(["hostname"])).stdout == "box\n"
        interfaces = (await rt.exec(["cat", "/proc/net/dev"])).stdout
        assert "eth0" not in interfaces, "network 'none' must have no interface but lo"
    await drain_removals()
    with pytest.raises(Exception) as gone:
        docker_client.containers.get(rt.sandbox_id)
    assert type(gone.value).__name__ == "NotFound"


async def test_missing_image_is_provisioning_error_naming_it(docker_client: Any) -> None:
    image = "vf-sandbox/does-not-exist:never"
    before = len(session_containers(docker_client))
    with pytest.raises(ProvisioningError, match="vf-sandbox/does-not-exist:never"):
        async with open_runtime({"type": "docker", "image": image}):
            pass
    assert len(session_containers(docker_client)) == before
    assert not any(image in str(i.tags) for i in docker_client.images.list()), "never pulled"


async def test_bad_network_is_provisioning_error_and_removes_the_container(
    docker_client: Any,
) -> None:
    rt = DockerRuntime(DockerConfig(network="vf-no-such-network"))
    with pytest.raises(ProvisioningError, match="vf-no-such-network"):
        await rt.start()
    assert rt.closed
    # The container was created before start failed: close() must have removed it.
    assert rt.sandbox_id is not None
    await drain_removals()
    assert not docker_client.containers.list(all=True, filters={"id": rt.sandbox_id})


async def test_cancelled_start_leaves_nothing(docker_client: Any) -> None:
    before = {c.id for c in session_containers(docker_client)}
    rt = DockerRuntime(DockerConfig())
    with anyio.move_on_after(0.05):
        await rt.start()
    # Either the start finished before the cancellation was seen and was undone, or it
    # is still shielded: in both cases close() leaves no container.
    await rt.close()
    await drain_removals()
    assert {c.id for c in session_containers(docker_client)} == before


async def test_close_is_idempotent_and_later_calls_are_unavailable(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    rt = docker_runtime_factory()
    await rt.start()
    await rt.close()
    await rt.close()
    with pytest.raises(SandboxUnavailableError):
        await rt.exec(["true"])
    assert not await rt.alive()


async def test_relative_workdir_is_rejected() -> None:
    with pytest.raises(ValueError, match="absolute"):
        DockerConfig(workdir="work")


async def test_only_host_network_is_local() -> None:
    assert DockerConfig(network="host").is_local()
    assert not DockerConfig().is_local()
    assert not DockerConfig(network="bridge").is_local()


async def test_custom_workdir_is_created_and_owned_by_the_user(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory(workdir="/home/agent/project", user="nobody") as rt:
        assert rt.workdir == "/home/agent/project"
        owner = await rt.exec(["stat", "-c", "%U", "/home/agent/project"])
        assert owner.stdout == "nobody\n"
        assert (await rt.exec(["id", "-un"])).stdout == "nobody\n"
        await rt.write("made-by-nobody.txt", b"x")
        listing = await rt.exec(["stat", "-c", "%U", "made-by-nobody.txt"])
        assert listing.stdout == "nobody\n"


# ---------------------------------------------------------------------- attach mode


async def test_attach_mode_uses_the_container_and_leaves_it_running(
    attached_container: Any, attached_container_runtime: DockerRuntime
) -> None:
    wrapped = attached_container.get_wrapped_container()
    async with attached_container_runtime as rt:
        assert rt.attached
        assert rt.sandbox_id == wrapped.id
        assert rt.workdir == "/srv", "attach mode defaults to the container's WorkingDir"
        assert (await rt.exec(["pwd"])).stdout == "/srv\n"
        await rt.write("/tmp/attached.txt", b"kept")
    wrapped.reload()
    assert wrapped.status == "running", "close() must leave an attached container running"
    assert wrapped.exec_run(["cat", "/tmp/attached.txt"]).output == b"kept"


async def test_attach_mode_with_a_workdir_creates_it(
    attached_container_config: DockerConfig,
) -> None:
    config = attached_container_config.model_copy(update={"workdir": "/data/run-1"})
    async with DockerRuntime(config) as rt:
        assert rt.workdir == "/data/run-1"
        assert (await rt.exec(["pwd"])).stdout == "/data/run-1\n"


async def test_attach_to_missing_or_stopped_container_is_provisioning_error(
    docker_client: Any,
) -> None:
    with pytest.raises(ProvisioningError, match="vf-no-such-container"):
        await DockerRuntime(DockerConfig(container="vf-no-such-container")).start()
    stopped = docker_client.containers.create(IMAGE, ["true"], network_mode="none")
    try:
        with pytest.raises(ProvisioningError, match="not running"):
            await DockerRuntime(DockerConfig(container=stopped.id)).start()
    finally:
        stopped.remove(force=True)


# ---------------------------------------------------------------------- limits


async def test_max_live_caps_live_sandboxes(docker_client: Any) -> None:
    cap = live_cap("docker")
    already = cap.live
    limit = already + 2
    config = DockerConfig(max_live=limit, creations_per_second=None)
    first, second, third = (DockerRuntime(config) for _ in range(3))
    async with first, second:
        assert cap.live == limit
        before = len(session_containers(docker_client))
        with anyio.move_on_after(1.0) as waited:
            await third.start()
        assert waited.cancelled_caught, "a third sandbox must wait while two are live"
        assert len(session_containers(docker_client)) == before, "nothing created while waiting"
        async with anyio.create_task_group() as tg:
            tg.start_soon(third.start)
            await anyio.sleep(0.3)
            assert cap.waiting == 1
            await first.close()
        assert await third.alive()
        await third.close()
    assert cap.live == already


async def test_creations_per_second_paces_creation() -> None:
    config = DockerConfig(creations_per_second=2.0, max_live=64)
    runtimes = [DockerRuntime(config) for _ in range(4)]
    started: list[float] = []

    async def start(rt: DockerRuntime) -> None:
        await rt.start()
        started.append(time.monotonic())

    await anyio.sleep(1.0)  # let earlier tests' bookings age out of the bucket
    begin = time.monotonic()
    try:
        async with anyio.create_task_group() as tg:
            for rt in runtimes:
                tg.start_soon(start, rt)
    finally:
        for rt in runtimes:
            await rt.close()
    # A burst of 2, then one every 0.5 s: the 4th creation cannot start before 1.0 s.
    assert max(started) - begin >= 0.95, [round(t - begin, 2) for t in sorted(started)]
