"""Fixtures for the SSH backend's own tests: real sshd containers (``vf-sandbox/sshd``).

``sshd`` is one server per test module (tests that only read it, or clean up after
themselves); ``own_sshd`` is a server per test, for tests that kill or restart it.
Every test in this directory is marked ``ssh``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ssh.sshd import IMAGE, SSHServer, image_present


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.ssh)


@pytest.fixture(scope="session")
def sshd_image() -> str:
    if not image_present():
        pytest.fail(f"{IMAGE} is missing: build it with `make images`")
    return IMAGE


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory, sshd_image: str) -> Iterator[SSHServer]:
    with SSHServer(Path(tmp_path_factory.mktemp("sshd"))) as server:
        yield server


@pytest.fixture
def own_sshd(tmp_path: Path, sshd_image: str) -> Iterator[SSHServer]:
    with SSHServer(tmp_path / "sshd") as server:
        yield server
