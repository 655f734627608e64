"""Nothing leaks: a SIGKILLed session's containers are swept by ``cleanup``; a process
that exits without closing is cleaned up by the atexit backstop."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import ownership
from runtimes.cleanup import cleanup_sandboxes
from runtimes.docker import DockerRuntime
from tests.docker.conftest import session_containers

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

REPO = Path(__file__).resolve().parents[2]

_CHILD = textwrap.dedent(
    """
    import sys, anyio
    from runtimes import open_runtime, ownership

    async def main(count, close):
        runtimes = [open_runtime({"type": "docker"}) for _ in range(count)]
        async with anyio.create_task_group() as tg:
            for rt in runtimes:
                tg.start_soon(rt.start)
        print("READY", ownership.CREATOR_ID, flush=True)
        if close == "wait":
            await anyio.sleep(600)

    anyio.run(main, int(sys.argv[1]), sys.argv[2])
    """
)


class Child:
    """A python process holding ``count`` docker sandboxes."""

    def __init__(self, count: int, mode: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(count), mode],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().split()
        if not line or line[0] != "READY":
            self.process.kill()
            _, err = self.process.communicate(timeout=30)
            raise AssertionError(f"child failed to start its sandboxes: {err}")
        self.session_id = line[1]

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def wait(self) -> int:
        return self.process.wait(timeout=60)


@pytest.fixture
def children(docker_client: Any) -> Iterator[list[Child]]:
    """Children started by a test; their containers are removed whatever happens."""
    started: list[Child] = []
    yield started
    for child in started:
        if child.process.poll() is None:
            child.kill()
        for container in session_containers(docker_client, child.session_id):
            container.remove(force=True)


async def test_sigkilled_session_leaves_labelled_containers_that_cleanup_removes(
    children: list[Child], docker_client: Any
) -> None:
    child = Child(5, "wait")
    children.append(child)
    child.kill()
    left = session_containers(docker_client, child.session_id)
    assert len(left) == 5, "SIGKILL skips every backstop: the labels are what is left"
    for container in left:
        assert container.labels[ownership.PID] == str(child.process.pid)
        assert ownership.creator_is_dead(container.labels) is True

    listed = {info.id for info in await DockerRuntime.list_sandboxes()}
    assert {c.id for c in left} <= listed

    results = await cleanup_sandboxes(["docker"])
    removed = {r.info.id for r in results if r.action == "removed"}
    assert {c.id for c in left} <= removed
    assert session_containers(docker_client, child.session_id) == []
    kept = {
        r.info.id for r in results if r.info.labels.get(ownership.CREATOR) == ownership.CREATOR_ID
    }
    assert all(r.action == "kept" for r in results if r.info.id in kept), "live sessions stay"


def _cli() -> list[str]:
    script = shutil.which("vf-sandbox", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "placement.cli"]


async def test_cli_cleanup_removes_a_dead_sessions_containers(
    children: list[Child], docker_client: Any
) -> None:
    child = Child(2, "wait")
    children.append(child)
    child.kill()
    assert len(session_containers(docker_client, child.session_id)) == 2
    with anyio.fail_after(120):
        dry = await anyio.run_process(
            [*_cli(), "cleanup", "--runtime", "docker", "--dry-run"], cwd=REPO, check=False
        )
    assert dry.returncode == 0, dry.stderr
    assert len(session_containers(docker_client, child.session_id)) == 2, "dry run removes nothing"
    with anyio.fail_after(120):
        real = await anyio.run_process(
            [*_cli(), "cleanup", "--runtime", "docker"], cwd=REPO, check=False
        )
    assert real.returncode == 0, real.stderr
    assert session_containers(docker_client, child.session_id) == []


async def test_atexit_backstop_removes_what_a_process_left_open(
    children: list[Child], docker_client: Any
) -> None:
    child = Child(3, "exit")  # returns from main without closing: atexit must clean up
    children.append(child)
    assert child.wait() == 0
    assert session_containers(docker_client, child.session_id) == []
