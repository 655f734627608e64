"""Fixtures of the snapshot tests: each backend as a :class:`~tests.snapshots.support.Backend`
(subprocess under a private root; Docker as root and with the default policy account; SSH
against a throwaway sshd, root login with a policy account; the fake Modal service)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from runtimes.docker import DockerConfig
from runtimes.modal import ModalConfig
from runtimes.subprocess import SubprocessConfig
from tests.channel.conftest import sshd  # noqa: F401 - fixture (one server per module)
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures
from tests.ssh.sshd import SSHServer

from .support import Backend

BACKENDS = [
    pytest.param("subprocess", id="subprocess"),
    pytest.param("docker-root", id="docker-root", marks=pytest.mark.docker),
    pytest.param("docker-policy", id="docker-policy", marks=pytest.mark.docker),
    pytest.param("ssh", id="ssh", marks=[pytest.mark.ssh, pytest.mark.docker]),
    pytest.param("modal-fake", id="modal-fake", marks=pytest.mark.docker),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_backend(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if name == "subprocess":
        return Backend(name, SubprocessConfig(root=str(tmp_path / "root")))
    if name == "docker-root":
        return Backend(name, DockerConfig(policy_user=None))
    if name == "docker-policy":
        return Backend(name, DockerConfig())
    if name == "ssh":
        server: SSHServer = request.getfixturevalue("sshd")
        return Backend(name, server.config(policy_user="sandbox"))
    request.getfixturevalue("fake_modal")
    service = request.getfixturevalue("fake_service")
    return Backend(name, ModalConfig(**fake_config()), modal_state=service.state_dir)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    return make_backend(request.param, request, tmp_path)


@pytest.fixture
def modal_fake(fake_modal: types.ModuleType) -> types.ModuleType:  # noqa: F811
    return fake_modal
