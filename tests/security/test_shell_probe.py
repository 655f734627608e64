"""Attack class 13: ``vf-sandbox shell`` probes a Docker sandbox for bash before opening it.

The probe runs as root in a container the policy used. A ``test`` the policy planted in a
directory it can write that is first on the container's own ``PATH`` (images that put
``/work/bin`` or ``~/.local/bin`` there exist) must not be run by the probe, nor talk it into
naming a shell that is not there: the probe runs ``test`` with the machinery's fixed ``PATH``,
in ``/``. (A root policy could replace ``/usr/bin/test`` itself; that runs as the root it
already was, and only picks the shell.)
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import anyio
import pytest

from runtimes.docker import DockerRuntime
from runtimes.models import SandboxInfo

pytestmark = [pytest.mark.attack(13), pytest.mark.docker]

PLANTED_TEST = "#!/bin/sh\ntouch /tmp/probe-ran-policy-code\nexit 0\n"


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def container() -> Iterator[str]:
    """A running container whose own PATH starts with a directory the policy writes."""
    from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, require_docker_image

    require_docker_image(DOCKER_TEST_IMAGE)
    started = docker(
        "run", "-d", "-e", "PATH=/work/bin:/usr/bin:/bin", "-w", "/work",
        DOCKER_TEST_IMAGE, "sleep", "600",
    )  # fmt: skip
    container_id = started.stdout.strip()
    try:
        yield container_id
    finally:
        docker("rm", "-f", "-v", container_id, check=False)


def test_shell_is_bash_when_present_and_a_planted_test_is_never_run(container: str) -> None:
    info = SandboxInfo(backend="docker", id=container, labels={})
    with_bash = anyio.run(lambda: DockerRuntime.shell_argv(info, tty=False))
    assert with_bash[-1] == "/bin/bash"

    # The policy plants `test` first on the container's PATH and takes bash away.
    planted = "mkdir -p /work/bin && cat > /work/bin/test && chmod +x /work/bin/test"
    subprocess.run(
        ["docker", "exec", "-i", container, "sh", "-c", planted],
        input=PLANTED_TEST, text=True, check=True, capture_output=True,
    )  # fmt: skip
    docker("exec", container, "chmod", "a-x", "/usr/bin/bash")
    assert docker("exec", container, "test", "-x", "/bin/bash", check=False).returncode == 0, (
        "the planted test is not first on the container's PATH: the attack is not set up"
    )
    docker("exec", container, "rm", "-f", "/tmp/probe-ran-policy-code")

    without = anyio.run(lambda: DockerRuntime.shell_argv(info, tty=False))
    assert without[-1] == "/bin/sh"
    ran = docker("exec", container, "ls", "/tmp/probe-ran-policy-code", check=False)
    assert ran.returncode != 0, "the probe ran the policy's `test`"
