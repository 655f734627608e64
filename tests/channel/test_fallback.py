"""Where the channel cannot serve, the plain path does, with the same semantics."""

from __future__ import annotations

import anyio
import pytest

from runtimes.pytest_plugin import DockerRuntimeFactory
from runtimes.testing import CHECKS, run_check

pytestmark = pytest.mark.usefixtures("no_leaks")

FALLBACK_CHECKS = [
    "stdout_exact",
    "stdin_binary",
    "exit_codes",
    "timeout_kills_tree",
    "missing_program",
    "cwd_missing",
    "file_round_trip",
    "read_missing",
    "write_creates_parents",
    "exists",
    "remove",
    "concurrent_execs",
]


@pytest.mark.anyio
async def test_an_image_without_python3_uses_the_plain_path(
    no_python_image: str, docker_runtime_factory: DockerRuntimeFactory
) -> None:
    async with docker_runtime_factory(image=no_python_image) as rt:
        assert (await rt.exec(["sh", "-c", "command -v python3 || echo none"])).stdout == "none\n"
        await rt.write("f.txt", b"plain")
        assert await rt.read("f.txt") == b"plain"
        assert await rt.exists("f.txt")
        info = rt.channel_info
        assert info.state == "unsupported" and "python3" in (info.reason or ""), info
        assert info.served == 0 and info.fallbacks == 4 and info.restarts == 0, info


@pytest.mark.parametrize("name", FALLBACK_CHECKS)
def test_conformance_checks_pass_without_python3(no_python_image: str, name: str) -> None:
    check = next(c for c in CHECKS if c.name == name)
    anyio.run(run_check, check, {"type": "docker", "image": no_python_image})


@pytest.mark.anyio
async def test_a_user_the_agent_cannot_become_goes_through_the_plain_path(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """The agent runs as the sandbox user (nobody): it cannot switch to another user, docker
    exec can; the call takes the plain path and nothing was started twice."""
    async with docker_runtime_factory(user="nobody") as rt:
        result = await rt.exec(["sh", "-c", "id -un; echo once >> /tmp/ran"], user="daemon")
        assert result.stdout == "daemon\n", result
        assert (await rt.exec(["cat", "/tmp/ran"])).stdout == "once\n"
        assert (await rt.exec(["id", "-un"])).stdout == "nobody\n"
        info = rt.channel_info
        assert info.state == "running" and info.fallbacks == 1, info


@pytest.mark.anyio
async def test_channel_false_is_the_plain_path(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory(channel=False) as rt:
        assert (await rt.exec(["echo", "plain"])).stdout == "plain\n"
        info = rt.channel_info
        assert info.state == "disabled" and info.served == 0 and info.fallbacks == 0, info
        listing = (await rt.exec(["ps", "-eo", "args"])).stdout
        assert "python3" not in listing, listing
