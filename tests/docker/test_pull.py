"""The ``pull`` policy against a real registry on loopback (Debian's ``docker-registry``,
started here and stopped after): ``never`` refuses a missing image, ``missing`` pulls it,
``always`` pulls a newer version of a tag, a failed or stalled pull is ProvisioningError.
The engine treats 127.0.0.0/8 registries as insecure (plain HTTP) by default."""

from __future__ import annotations

import contextlib
import io
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from runtimes import ProvisioningError, open_runtime
from runtimes.reaper import wait_for_removals_blocking
from tests.docker.conftest import IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

_REGISTRY_CONFIG = """\
version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: {storage}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{port}
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_registry(address: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"docker-registry exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"docker-registry did not answer on {address} within 30s")


@pytest.fixture(scope="module")
def registry(docker_client: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``127.0.0.1:<port>`` of a registry serving from a temporary directory; afterwards
    the registry is stopped and every local tag of it removed."""
    binary = shutil.which("docker-registry")
    assert binary, "docker-registry is missing: `make engine` installs Debian's docker-registry"
    root = tmp_path_factory.mktemp("registry")
    port = free_port()
    config = root / "config.yml"
    config.write_text(_REGISTRY_CONFIG.format(storage=root / "storage", port=port))
    process = subprocess.Popen(
        [binary, "serve", str(config)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=(root / "registry.log").open("wb"),
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_for_registry(address, process)
        yield address
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        for image in docker_client.images.list():
            for tag in image.tags:
                if tag.startswith(address + "/"):
                    docker_client.images.remove(tag, force=True)


def push(client: Any, reference: str) -> None:
    repository, tag = reference.rsplit(":", 1)
    for event in client.images.push(repository, tag=tag, stream=True, decode=True):
        assert "error" not in event, event


def untag(client: Any, reference: str) -> None:
    client.images.remove(reference)
    assert not client.images.list(name=reference)


def commit_with_marker(client: Any, reference: str, text: str) -> str:
    """Tag ``reference`` as the base image plus a file ``/marker`` holding ``text``; return
    the new image's id."""
    data = text.encode()
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        member = tarfile.TarInfo("marker")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    container = client.containers.create(IMAGE, command=["true"])
    try:
        container.put_archive("/", archive.getvalue())
        repository, tag = reference.rsplit(":", 1)
        image = container.commit(repository=repository, tag=tag)
    finally:
        container.remove(force=True)
    return str(image.id)


@pytest.fixture
def made_images(docker_client: Any) -> Iterator[list[str]]:
    """Ids of images a test makes, removed after it (untagged ones too)."""
    import docker.errors

    made: list[str] = []
    yield made
    wait_for_removals_blocking()  # the containers of closed sandboxes still hold them
    for image_id in made:
        with contextlib.suppress(docker.errors.NotFound):
            docker_client.images.remove(image_id, force=True)


def reference_in(registry: str) -> str:
    return f"{registry}/vf-test/img:{uuid.uuid4().hex[:8]}"


async def test_missing_pulls_an_image_the_engine_lacks(docker_client: Any, registry: str) -> None:
    reference = reference_in(registry)
    docker_client.images.get(IMAGE).tag(*reference.rsplit(":", 1))
    push(docker_client, reference)
    untag(docker_client, reference)

    with pytest.raises(ProvisioningError, match="pull='missing'") as refused:
        async with open_runtime({"type": "docker", "image": reference}):
            pass
    assert "build or load it" in str(refused.value)
    assert not docker_client.images.list(name=reference), "pull='never' must not pull"

    async with open_runtime({"type": "docker", "image": reference, "pull": "missing"}) as rt:
        assert (await rt.exec(["echo", "pulled"])).stdout == "pulled\n"
    assert docker_client.images.list(name=reference)


async def test_always_pulls_a_newer_version_missing_keeps_the_local_one(
    docker_client: Any, registry: str, made_images: list[str]
) -> None:
    reference = reference_in(registry)
    made_images.append(commit_with_marker(docker_client, reference, "v2"))
    push(docker_client, reference)
    made_images.append(commit_with_marker(docker_client, reference, "v1"))  # the engine's is older

    async with open_runtime({"type": "docker", "image": reference, "pull": "missing"}) as rt:
        assert await rt.read("/marker") == b"v1"
    async with open_runtime({"type": "docker", "image": reference, "pull": "always"}) as rt:
        assert await rt.read("/marker") == b"v2"


@pytest.mark.parametrize("policy", ["missing", "always"])
async def test_pulling_an_absent_image_is_provisioning_error(
    docker_client: Any, registry: str, policy: str
) -> None:
    reference = f"{registry}/vf-test/absent:nothing"
    with pytest.raises(ProvisioningError, match=r"pulling '.*absent:nothing' failed") as failed:
        async with open_runtime({"type": "docker", "image": reference, "pull": policy}):
            pass
    assert "not found" in str(failed.value) or "unknown" in str(failed.value)


@pytest.fixture
def silent_registry() -> Iterator[str]:
    """A registry address that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def hold() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


async def test_a_stalled_pull_is_bounded_by_pull_timeout(silent_registry: str) -> None:
    config = {
        "type": "docker",
        "image": f"{silent_registry}/vf-test/img:stalled",
        "pull": "missing",
        "pull_timeout": 1,
        "api_timeout": 20,
    }
    started = time.monotonic()
    with pytest.raises(ProvisioningError, match=r"stalled' .*did not finish within 1s"):
        with anyio.fail_after(30):
            async with open_runtime(config):
                pass
    assert time.monotonic() - started < 5


async def test_a_silent_engine_during_a_pull_is_provisioning_error(silent_registry: str) -> None:
    config = {
        "type": "docker",
        "image": f"{silent_registry}/vf-test/img:silent",
        "pull": "always",
        "api_timeout": 1,
    }
    with pytest.raises(ProvisioningError, match=r"no progress within 1s \(api_timeout"):
        with anyio.fail_after(30):
            async with open_runtime(config):
                pass
