"""The docker runtime on a remote engine reached over SSH (``DockerConfig.base_url="ssh://..."``).

The docker SDK's paramiko adapter logs in and runs ``docker system dial-stdio`` on the
remote host, which needs the docker CLI there and access to an engine. Here the "remote
host" is an sshd container given the host's ``/usr/bin/docker`` and
``/var/run/docker.sock``, so it drives this machine's engine. The SDK takes its identity
file and known hosts from ``~/.ssh`` (``IdentityFile`` in ``~/.ssh/config``; it rejects
unknown host keys), so the test points ``HOME`` at a private directory holding both.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimes import drain_removals, open_runtime
from tests.ssh.sshd import SSHServer

pytestmark = pytest.mark.anyio

DOCKER_CLI = "/usr/bin/docker"
DOCKER_SOCKET = "/var/run/docker.sock"


@pytest.fixture
def engine_host(tmp_path: Path, sshd_image: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """An ``ssh://`` base_url whose remote end can run the docker CLI against this engine."""
    cli = shutil.which("docker")
    if cli is None or not os.path.exists(DOCKER_SOCKET):
        pytest.fail(
            f"needs the docker CLI ({DOCKER_CLI}) and {DOCKER_SOCKET} on this host "
            "(`make test` installs and starts docker.io)"
        )
    volumes = [(os.path.realpath(cli), DOCKER_CLI, "ro"), (DOCKER_SOCKET, DOCKER_SOCKET, "rw")]
    with SSHServer(tmp_path / "sshd", volumes=volumes) as server:
        home = tmp_path / "home"
        (home / ".ssh").mkdir(parents=True)
        (home / ".ssh" / "config").write_text(
            f"Host {server.host}\n  IdentityFile {server.key.private_path}\n"
        )
        shutil.copy(server.known_hosts, home / ".ssh" / "known_hosts")
        monkeypatch.setenv("HOME", str(home))
        yield f"ssh://root@{server.host}:{server.port}"


async def test_docker_runtime_through_an_ssh_engine(engine_host: str) -> None:
    config = {"type": "docker", "base_url": engine_host, "image": "vf-sandbox/base:bookworm"}
    async with open_runtime(config) as rt:
        result = await rt.exec(["sh", "-c", "echo hi; echo err >&2; exit 3"], timeout=60)
        assert (result.exit_code, result.stdout, result.stderr) == (3, "hi\n", "err\n"), result
        payload = bytes(range(256)) * 64
        await rt.write("/tmp/over-ssh/data.bin", payload)
        assert await rt.read("/tmp/over-ssh/data.bin") == payload
        with pytest.raises(FileNotFoundError):
            await rt.read("/tmp/over-ssh/missing")
        container = rt.sandbox_id
    assert container is not None
    await drain_removals()  # removed in the background, over the same ssh:// engine
    import docker

    client = docker.from_env()
    try:
        with pytest.raises(docker.errors.NotFound):
            client.containers.get(container)  # closed over ssh: removed from the engine
    finally:
        client.close()
