"""Teardown off the caller's path: ``close()`` returns once the container is frozen, the
removal runs in the background, finishes at exit, and what a killed process left is swept."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import SandboxError, drain_removals, open_runtime
from runtimes.cleanup import cleanup_sandboxes
from runtimes.ownership import SESSION
from runtimes.reaper import pending_removals
from tests.docker.conftest import session_containers

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.usefixtures("no_leaks")]

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"type": "docker"}


def state_of(client: Any, container_id: str) -> dict[str, Any] | None:
    import docker.errors

    try:
        state: dict[str, Any] = client.containers.get(container_id).attrs["State"]
    except docker.errors.NotFound:
        return None
    return state


async def test_close_returns_with_nothing_left_running_and_the_removal_follows(
    docker_client: Any,
) -> None:
    rt = open_runtime(CONFIG)
    await rt.start()
    # A leftover writer that would go on forever: the freeze must stop it at close().
    loop = "while :; do echo x >> /work/busy; done"
    await rt.exec(["sh", "-c", f"nohup sh -c '{loop}' >/dev/null 2>&1 &"])
    container_id = rt.sandbox_id
    assert container_id is not None
    await rt.close()
    state = state_of(docker_client, container_id)
    assert state is None or state["Paused"] or not state["Running"], state
    await drain_removals()
    assert state_of(docker_client, container_id) is None
    assert pending_removals() == 0


async def test_many_closes_in_a_row_are_all_removed(docker_client: Any) -> None:
    runtimes = [open_runtime(CONFIG) for _ in range(6)]
    async with anyio.create_task_group() as group:
        for rt in runtimes:
            group.start_soon(rt.start)
    ids = [rt.sandbox_id for rt in runtimes]
    for rt in runtimes:
        await rt.close()
    await drain_removals()
    assert [i for i in ids if i is not None and state_of(docker_client, i) is not None] == []


async def test_a_container_gone_before_close_is_fine(docker_client: Any) -> None:
    rt = open_runtime(CONFIG)
    await rt.start()
    assert rt.sandbox_id is not None
    docker_client.containers.get(rt.sandbox_id).remove(force=True)
    await rt.close()
    await drain_removals()  # nothing was queued for it, nothing failed


async def test_a_removal_the_engine_refuses_is_raised_by_drain(
    docker_client: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from runtimes.docker import runtime as docker_runtime

    def refuse(api: Any, container_id: str, describe: str) -> None:
        raise SandboxError(f"could not remove {describe}: refused for the test")

    rt = open_runtime(CONFIG)
    await rt.start()
    container_id = rt.sandbox_id
    assert container_id is not None
    monkeypatch.setattr(docker_runtime, "remove_container_blocking", refuse)
    try:
        await rt.close()
        with pytest.raises(SandboxError, match="refused for the test"):
            await drain_removals()
        assert "removing" in caplog.text and "vf-sandbox cleanup" in caplog.text
        await drain_removals()  # reported once, not again
    finally:
        docker_client.containers.get(container_id).remove(force=True)


_CHILD = textwrap.dedent(
    """
    import os, signal, sys, anyio
    from runtimes import open_runtime, ownership

    async def main(count, end):
        runtimes = [open_runtime({"type": "docker"}) for _ in range(count)]
        async with anyio.create_task_group() as tg:
            for rt in runtimes:
                tg.start_soon(rt.start)
        print(ownership.SESSION_ID, flush=True)
        for rt in runtimes:
            await rt.close()
        if end == "killed":
            os.kill(os.getpid(), signal.SIGKILL)  # removals may still be pending

    anyio.run(main, int(sys.argv[1]), sys.argv[2])
    """
)


def run_child(count: int, end: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(count), end],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return done.returncode, done.stdout.strip()


async def test_a_process_exiting_right_after_close_finishes_its_removals(
    docker_client: Any,
) -> None:
    code, session = await anyio.to_thread.run_sync(run_child, 4, "exits")
    assert code == 0, session
    assert session_containers(docker_client, session) == []


async def test_a_process_killed_after_close_leaves_frozen_labelled_containers_for_the_sweep(
    docker_client: Any,
) -> None:
    code, session = await anyio.to_thread.run_sync(run_child, 4, "killed")
    assert code == -signal.SIGKILL, session
    # One listing call: a container whose removal was under way is in it as "removing".
    left = docker_client.api.containers(all=True, filters={"label": f"{SESSION}={session}"})
    assert len(left) <= 4
    states = [entry["State"] for entry in left]
    assert set(states) <= {"paused", "removing", "exited", "dead"}, states  # frozen at close
    await cleanup_sandboxes(["docker"])
    assert session_containers(docker_client, session) == []
