"""Fixtures of the docker runtime's own tests: a real engine, the offline base image.

Every test in this directory is marked ``docker``. Containers are found through their
``vf-sandbox.session`` label, so a test can prove that nothing it created is left.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimes import ownership
from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, require_docker_image
from runtimes.reaper import drain_removals_blocking

IMAGE = DOCKER_TEST_IMAGE


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.docker)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def docker_client() -> Iterator[object]:
    """A plain docker SDK client, for looking at containers from the outside."""
    import docker

    require_docker_image(IMAGE)
    client = docker.from_env()
    try:
        yield client
    finally:
        client.close()


def session_containers(client: object, session_id: str = ownership.CREATOR_ID) -> list[object]:
    """Containers (any state) labelled with ``session_id``."""
    found: list[object] = client.containers.list(  # type: ignore[attr-defined]
        all=True, filters={"label": f"{ownership.CREATOR}={session_id}"}
    )
    return found


@pytest.fixture
def no_leaks(docker_client: object) -> Iterator[None]:
    """Fail the test if it leaves a container of this session behind (and remove those)."""
    before = {c.id for c in session_containers(docker_client)}  # type: ignore[attr-defined]
    yield
    drain_removals_blocking()  # close() returns before the background removal ends
    left = [c for c in session_containers(docker_client) if c.id not in before]  # type: ignore[attr-defined]
    for container in left:
        container.remove(force=True)  # type: ignore[attr-defined]
    assert not left, f"containers left behind: {[c.name for c in left]}"  # type: ignore[attr-defined]
