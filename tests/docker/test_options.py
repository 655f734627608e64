"""Docker options users of testcontainers / SWE-ReX / inspect_ai expect: published ports,
bind mounts and volumes, GPU requests (validated, and the request the engine is sent)."""

from __future__ import annotations

import socket
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import (
    ProvisioningError,
    RuntimeConfigError,
    SandboxInvalidArgumentError,
    SandboxPermissionError,
    SandboxUnavailableError,
    open_runtime,
)
from runtimes.docker import DockerRuntime
from runtimes.reaper import drain_removals
from tests.docker.conftest import IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


def docker_config(**fields: Any) -> dict[str, Any]:
    return {"type": "docker", "image": IMAGE, **fields}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def http_get(host: str, port: int, path: str) -> bytes:
    """GET through the published port, retried while the server in the sandbox starts."""

    def get() -> bytes:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=5) as response:
            body: bytes = response.read()
            return body

    with anyio.fail_after(20):
        while True:
            try:
                return await anyio.to_thread.run_sync(get)
            except OSError:
                await anyio.sleep(0.2)


# ------------------------------------------------------------------ config validation


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"ports": [8000]}, "ports", "network='bridge'"),
        ({"network": "host", "ports": [8000]}, "ports", "network='host'"),
        ({"network": "bridge", "ports": ["http"]}, "ports", "8000"),
        ({"network": "bridge", "ports": [8000, "8000/tcp"]}, "ports", "twice"),
        ({"container": "c1", "network": "bridge", "ports": [80]}, "ports", "attached"),
        ({"mounts": [{"source": "data", "target": "/data"}]}, "mounts.0", "absolute host path"),
        ({"mounts": [{"source": "/", "target": "data"}]}, "mounts.0.target", "absolute"),
        ({"mounts": [{"source": "/no/such/dir", "target": "/d"}]}, "mounts", "does not exist"),
        ({"mounts": [{"source": "/", "target": "/work"}]}, "mounts", "hide the workdir"),
        ({"workdir": "/srv/w", "mounts": [{"source": "/", "target": "/srv"}]}, "mounts", "workdir"),
        ({"mounts": [{"source": "/", "target": "/work/src"}]}, "mounts", "policy_user=None"),
        ({"mounts": [{"source": "/", "target": "/home"}]}, "mounts", "chown -R"),
        ({"mounts": [{"source": "/", "target": "/tmp"}]}, "mounts", "/tmp/.vf-sandbox"),
        ({"mounts": [{"source": "/", "target": "/tmp/.vf-sandbox/x"}]}, "mounts", "control"),
        ({"mounts": [{"source": "/", "target": "/usr/lib"}]}, "mounts", "read_only"),
        ({"mounts": [{"type": "volume", "source": "a b", "target": "/v"}]}, "mounts.0", "name"),
        ({"gpus": 0}, "gpus", "count"),
        ({"gpus": "some"}, "gpus", "'all'"),
        ({"gpus": []}, "gpus", "device ids"),
        ({"pull": "sometimes"}, "pull", "missing"),
    ],
)
def test_bad_options_are_config_errors_naming_the_field(
    fields: dict[str, Any], field: str, says: str
) -> None:
    with pytest.raises(RuntimeConfigError) as raised:
        open_runtime(docker_config(**fields))
    message = str(raised.value)
    assert f"  {field}: " in message, message
    assert says in message, message


def test_a_mount_inside_the_workdir_is_allowed_without_a_policy_user() -> None:
    config = docker_config(policy_user=None, mounts=[{"source": "/", "target": "/work/src"}])
    assert open_runtime(config).config.mounts[0].target == "/work/src"  # type: ignore[attr-defined]


# ------------------------------------------------------------------ ports


async def test_published_port_reaches_a_server_in_the_container(docker_client: Any) -> None:
    chosen = free_port()
    config = docker_config(
        network="bridge", ports=[8000, {"container_port": 8001, "host_port": chosen}]
    )
    async with open_runtime(config) as rt:
        assert isinstance(rt, DockerRuntime)
        await rt.write("hello.txt", b"served from the sandbox\n")
        server = "python3 -m http.server 8000 --bind 0.0.0.0 >/dev/null 2>&1 &"
        assert (await rt.exec(["sh", "-c", server])).exit_code == 0

        host, port = await rt.host_port(8000)
        assert host == "127.0.0.1", "the safe default publishes on loopback only"
        assert port > 0
        assert await http_get(host, port, "/hello.txt") == b"served from the sandbox\n"

        assert await rt.host_port(8001) == ("127.0.0.1", chosen)
        bindings = docker_client.containers.get(rt.sandbox_id).attrs["HostConfig"]["PortBindings"]
        assert {b["HostIp"] for v in bindings.values() for b in v} == {"127.0.0.1"}

        with pytest.raises(SandboxInvalidArgumentError, match="8002/tcp"):
            await rt.host_port(8002)
        with pytest.raises(SandboxInvalidArgumentError, match="8000/udp"):
            await rt.host_port(8000, "udp")
    with pytest.raises(SandboxUnavailableError):
        await rt.host_port(8000)


# ------------------------------------------------------------------ mounts


@pytest.mark.parametrize("channel", [True, False])
async def test_bind_mounts_share_host_files_and_read_only_is_enforced(
    tmp_path: Path, channel: bool
) -> None:
    shared, readonly = tmp_path / "shared", tmp_path / "readonly"
    shared.mkdir()
    readonly.mkdir()
    (readonly / "input.txt").write_text("from the host\n")
    config = docker_config(
        channel=channel,
        mounts=[
            {"source": str(shared), "target": "/shared"},
            {"source": str(readonly), "target": "/data", "read_only": True},
        ],
    )
    async with open_runtime(config) as rt:
        assert await rt.read("/data/input.txt") == b"from the host\n"
        await rt.write("/shared/out.txt", b"from the sandbox\n")
        assert (shared / "out.txt").read_bytes() == b"from the sandbox\n"

        attempt = await rt.exec(["sh", "-c", "echo changed > /data/input.txt"])
        assert attempt.exit_code != 0
        assert "Read-only file system" in attempt.stderr
        with pytest.raises(SandboxPermissionError):
            await rt.write("/data/input.txt", b"changed")
        with pytest.raises(SandboxPermissionError):
            await rt.write("/data/new.txt", b"new")
    assert (readonly / "input.txt").read_text() == "from the host\n"
    assert sorted(p.name for p in readonly.iterdir()) == ["input.txt"]


async def test_named_volume_is_created_labelled_and_outlives_the_sandbox(
    docker_client: Any,
) -> None:
    name = f"vf-test-vol-{uuid.uuid4().hex[:8]}"
    config = docker_config(mounts=[{"type": "volume", "source": name, "target": "/cache"}])
    try:
        async with open_runtime(config) as rt:
            await rt.write("/cache/state", b"kept")
            container_name = docker_client.containers.get(rt.sandbox_id).name
        await drain_removals()
        volume = docker_client.volumes.get(name)
        assert volume.attrs["Labels"]["vf-sandbox.volume"] == container_name
        assert volume.attrs["Labels"]["vf-sandbox.session"]
        async with open_runtime(config) as rt:
            assert await rt.read("/cache/state") == b"kept"
        await drain_removals()
    finally:
        volume = docker_client.volumes.get(name)
        volume.remove(force=True)


async def test_anonymous_volume_is_removed_with_the_sandbox(docker_client: Any) -> None:
    config = docker_config(mounts=[{"type": "volume", "target": "/scratch"}])
    async with open_runtime(config) as rt:
        await rt.write("/scratch/f", b"x")
        mounts = docker_client.containers.get(rt.sandbox_id).attrs["Mounts"]
        (volume_name,) = [m["Name"] for m in mounts if m["Destination"] == "/scratch"]
        assert docker_client.volumes.get(volume_name)
    await drain_removals()
    assert volume_name not in {v.name for v in docker_client.volumes.list()}


# ------------------------------------------------------------------ GPUs


@pytest.mark.parametrize(
    ("gpus", "count", "device_ids"),
    [("all", -1, []), (2, 2, []), (["0", "GPU-3a1b"], 0, ["0", "GPU-3a1b"])],
)
async def test_gpus_are_requested_from_the_engine_and_its_refusal_is_clear(
    monkeypatch: pytest.MonkeyPatch, gpus: Any, count: int, device_ids: list[str]
) -> None:
    from docker.models.containers import ContainerCollection

    sent: list[dict[str, Any]] = []
    create = ContainerCollection.create

    def recording_create(self: Any, image: str, **kwargs: Any) -> Any:
        sent.append(kwargs)
        return create(self, image, **kwargs)

    monkeypatch.setattr(ContainerCollection, "create", recording_create)
    # This machine has no GPU: the engine refuses the request it is sent.
    with pytest.raises(ProvisioningError, match=r"gpus=.*NVIDIA Container Toolkit") as refused:
        async with open_runtime(docker_config(gpus=gpus)):
            pass
    assert "device driver" in str(refused.value), "the engine's own reason is kept"
    (kwargs,) = sent
    (request,) = kwargs["device_requests"]
    assert request["Capabilities"] == [["gpu"]]
    assert request["Count"] == count
    assert request["DeviceIDs"] == device_ids


async def test_host_port_reports_what_an_attached_container_publishes(docker_client: Any) -> None:
    container = docker_client.containers.run(
        IMAGE, ["sleep", "300"], detach=True, ports={"9000/tcp": ("127.0.0.1", None)}
    )
    try:
        container.reload()
        expected = int(container.attrs["NetworkSettings"]["Ports"]["9000/tcp"][0]["HostPort"])
        async with open_runtime({"type": "docker", "container": container.id}) as rt:
            assert isinstance(rt, DockerRuntime)
            assert await rt.host_port(9000) == ("127.0.0.1", expected)
            with pytest.raises(SandboxInvalidArgumentError, match="9001/tcp"):
                await rt.host_port(9001)
    finally:
        container.remove(force=True)
