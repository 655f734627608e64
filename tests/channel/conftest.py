"""Fixtures of the channel tests: real Docker sandboxes (and an sshd container, and the fake
Modal service) on the local engine. Every test here is marked ``docker``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtimes import ownership
from tests.docker.conftest import docker_client, no_leaks  # noqa: F401 - fixtures
from tests.modal.support import fake_modal, fake_service  # noqa: F401 - fixtures
from tests.ssh.sshd import IMAGE as SSHD_IMAGE
from tests.ssh.sshd import SSHServer, image_present

IMAGE = "vf-sandbox/base:bookworm"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.docker)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def no_python_image(docker_client: Any) -> Iterator[str]:  # noqa: F811
    """The base image without python3 (committed from a container that removed it, never
    pulled); removed after the session."""
    container = docker_client.containers.run(
        IMAGE,
        ["sh", "-c", "rm -f /usr/bin/python3* /usr/local/bin/python3*"],
        detach=True,
        network_mode="none",
        labels=ownership.ownership_labels("docker", {"vf-sandbox.role": "channel-test-image"}),
    )
    try:
        assert container.wait(timeout=60)["StatusCode"] == 0
        image = container.commit(repository="vf-sandbox-test/no-python", tag=uuid.uuid4().hex[:12])
    finally:
        container.remove(force=True)
    tag = image.tags[0]
    try:
        yield tag
    finally:
        docker_client.images.remove(image.id, force=True)


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHServer]:
    if not image_present():
        pytest.fail(f"{SSHD_IMAGE} is missing: build it with `make images`")
    with SSHServer(Path(tmp_path_factory.mktemp("sshd"))) as server:
        yield server
