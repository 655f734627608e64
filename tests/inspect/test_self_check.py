"""inspect_ai's own sandbox self-check (``inspect_ai.util._sandbox.self_check``) against the
``vf`` provider on every backend: subprocess, Docker as root and as ``nobody``, SSH (a root
login on a ``vf-sandbox/sshd`` container this run starts) and Modal (the fake SDK of
``tests/modal``; live Modal cannot be reached from here).

One sandbox per backend serves all checks (as inspect's own runner does); the checks clean up
after themselves. A check a backend cannot pass is a strict xfail with its reason, so it fails
the run the day it starts passing. The reasons are the ones in ``docs/inspect.md``: a root
sandbox with no policy account (SSH without ``policy_user``, subprocess as root) overrides file
permission bits, a Docker sandbox configured as a non-root user never runs anything as root, and
a host process that is not root cannot switch users. Docker and Modal as root keep a policy
account (``vf-policy``) that the provider acts as, so the permission checks pass there.
Everything else passes on every backend.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from inspect_ai.util._sandbox.self_check import *  # noqa: F403 - the checks, collected here

from runtimes.inspect_sandbox import VfSandboxEnvironment
from tests.modal.fake_modal import FakeModalService, install
from tests.modal.support import docker_unavailable_reason, fake_config
from tests.ssh.sshd import IMAGE as SSHD_IMAGE
from tests.ssh.sshd import SSHServer, image_present

pytestmark = pytest.mark.anyio

IMAGE = "vf-sandbox/base:bookworm"

ROOT_OVERRIDES_PERMISSIONS = "a root sandbox reads and writes files whatever their mode bits"
ROOT_XFAILS = {
    "test_read_file_not_allowed": ROOT_OVERRIDES_PERMISSIONS,
    "test_write_text_file_without_permissions": ROOT_OVERRIDES_PERMISSIONS,
    "test_write_binary_file_without_permissions": ROOT_OVERRIDES_PERMISSIONS,
}
USER_IS_THE_CEILING = {
    "test_exec_as_user": "a Docker sandbox configured with a non-root user refuses "
    "user='root' by design (the configured user is the ceiling: docs/docker.md); the provider "
    "raises SandboxUserUnsupportedError, which inspect's contract names for exactly this",
}
HOST_NOT_ROOT_XFAILS = {
    "test_exec_as_user": "a subprocess sandbox of a host process that is not root cannot "
    "switch users (SandboxUserUnsupportedError, as inspect's contract asks)",
}


@dataclass
class Backend:
    id: str
    marks: list[pytest.MarkDecorator]
    xfails: dict[str, str] = field(default_factory=dict)


def _subprocess_xfails() -> dict[str, str]:
    return dict(ROOT_XFAILS) if os.geteuid() == 0 else dict(HOST_NOT_ROOT_XFAILS)


BACKENDS = [
    Backend("subprocess", [], _subprocess_xfails()),
    # the provider acts as the policy account (vf-policy): file modes apply
    Backend("docker-root", [pytest.mark.docker], {}),
    Backend("docker-nonroot", [pytest.mark.docker], dict(USER_IS_THE_CEILING)),
    Backend("ssh-root", [pytest.mark.ssh, pytest.mark.docker], dict(ROOT_XFAILS)),
    Backend("modal-fake", [pytest.mark.docker], {}),
]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def backend_config(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    """The vf runtime config of the backend under test (with its server or fake running)."""
    backend: Backend = request.param
    if backend.id == "subprocess":
        yield {"type": "subprocess"}
    elif backend.id == "docker-root":
        yield {"type": "docker", "image": IMAGE}
    elif backend.id == "docker-nonroot":
        yield {"type": "docker", "image": IMAGE, "user": "nobody"}
    elif backend.id == "ssh-root":
        if not image_present():
            pytest.fail(f"{SSHD_IMAGE} is missing: build it with `make images`")
        with SSHServer(Path(tmp_path_factory.mktemp("sshd"))) as server:
            yield server.config()
    else:
        reason = docker_unavailable_reason()
        if reason:
            pytest.fail(reason)
        service = FakeModalService(tmp_path_factory.mktemp("fake-modal"))
        with pytest.MonkeyPatch.context() as patch:
            install(service, patch)
            try:
                yield fake_config()
            finally:
                service.close()


@pytest.fixture(scope="module")
async def _shared_env(backend_config: Any) -> AsyncIterator[VfSandboxEnvironment]:
    config = VfSandboxEnvironment.config_deserialize(backend_config)
    task = "vf_self_check"
    await VfSandboxEnvironment.task_init(task, config)
    envs = await VfSandboxEnvironment.sample_init(task, config, {})
    env = envs["default"].as_type(VfSandboxEnvironment)
    try:
        yield env
    finally:
        await VfSandboxEnvironment.sample_cleanup(task, config, envs, False)
        await VfSandboxEnvironment.task_cleanup(task, config, True)
    assert env.runtime.closed


@pytest.fixture
def sandbox_env(
    request: pytest.FixtureRequest, _shared_env: VfSandboxEnvironment, backend_config: Any
) -> VfSandboxEnvironment:
    backend = request.node.callspec.params["backend_config"]
    reason = backend.xfails.get(request.node.originalname)
    if reason is not None:
        request.node.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    return _shared_env


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "backend_config" in metafunc.fixturenames:
        metafunc.parametrize(
            "backend_config",
            [pytest.param(b, id=b.id, marks=b.marks) for b in BACKENDS],
            indirect=True,
            scope="module",
        )
