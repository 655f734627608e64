"""`vf-sandbox exec --runtime docker`: streaming and Ctrl-C on a real engine."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, require_docker_image

from .cli import finish, read_until, start

pytestmark = pytest.mark.docker

DOCKER = json.dumps({"type": "docker", "image": DOCKER_TEST_IMAGE})


@pytest.fixture(scope="module")
def docker_client() -> Iterator[Any]:
    import docker

    require_docker_image(DOCKER_TEST_IMAGE)
    client = docker.from_env()
    try:
        yield client
    finally:
        client.close()


def _containers_of(client: Any, pid: int) -> list[Any]:
    """Containers (any state) created by the CLI process ``pid`` (its ownership label)."""
    found: list[Any] = client.containers.list(all=True, filters={"label": f"vf-sandbox.pid={pid}"})
    return found


def test_output_is_streamed_from_a_container() -> None:
    proc = start(
        "exec", "--runtime", DOCKER, "--", "sh", "-c", "echo first; sleep 6; echo second >&2"
    )
    try:
        early = read_until(proc, b"first\n", deadline=30)
        assert early["stdout"] == b"first\n", early
        assert early["stderr"] == b""
        assert proc.poll() is None, "the first line only showed after the command ended"
    finally:
        code, out, err = finish(proc)
    assert (code, out, err) == (0, b"", b"second\n")


def test_ctrl_c_exits_130_and_removes_the_container(docker_client: Any) -> None:
    proc = start("exec", "--runtime", DOCKER, "--", "sh", "-c", "echo ready; sleep 300")
    left: list[Any] = []
    try:
        ready = read_until(proc, b"ready\n", deadline=60)
        assert ready["stdout"] == b"ready\n", ready
        assert len(_containers_of(docker_client, proc.pid)) == 1
        proc.send_signal(signal.SIGINT)
        code, _, err = finish(proc)
        left = _containers_of(docker_client, proc.pid)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for leaked in _containers_of(docker_client, proc.pid):
            leaked.remove(force=True)
    assert code == 130, err
    assert b"Traceback" not in err and err.strip() == b"vf-sandbox: interrupted"
    assert left == [], "the interrupted run left its container"
