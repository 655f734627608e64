"""Teardown off the caller's path: ``close()`` returns once nothing of the sandbox runs — the
root agent killed every process, the removal then runs in the background, finishes at exit,
and what a killed process left is swept; without a trusted root agent the container is
removed on the caller's path as before."""

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
from runtimes.ownership import CREATOR
from runtimes.reaper import pending_removals
from tests.docker.conftest import session_containers
from tests.processes import running_anywhere, sleep_token

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


@pytest.fixture
def halted(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sandboxes whose removal went to the background: the agent confirmed its HALT."""
    from runtimes.docker import runtime as docker_runtime

    queued: list[str] = []
    real = docker_runtime.remove_in_background

    def record(describe: str, remove: Any) -> None:
        queued.append(describe)
        real(describe, remove)

    monkeypatch.setattr(docker_runtime, "remove_in_background", record)
    return queued


def leftovers(token: str) -> str:
    """What a policy leaves: a respawning loop, a setsid'd daemon, a fork loop."""
    return (
        f"nohup sh -c 'while :; do sleep {token}; done' >/dev/null 2>&1 & "
        f"setsid sleep {token} >/dev/null 2>&1 < /dev/null & "
        f"nohup sh -c 'while :; do sleep {token} & sleep 0.01; done' >/dev/null 2>&1 &"
    )


@pytest.mark.parametrize(
    ("config", "user"),
    [(CONFIG, None), (CONFIG, "vf-policy")],
    ids=["root-leftovers", "policy-account-leftovers"],
)
async def test_close_returns_with_every_process_killed_and_the_removal_follows(
    docker_client: Any, config: dict[str, Any], user: str | None, halted: list[str]
) -> None:
    token = sleep_token()
    rt = open_runtime(config)
    await rt.start()
    await rt.exec(["sh", "-c", leftovers(token)], user=user or rt.policy_user)
    await anyio.sleep(0.1)
    assert len(running_anywhere(token)) >= 3
    container_id = rt.sandbox_id
    assert container_id is not None
    await rt.close()
    assert running_anywhere(token) == [], "close() returned while the policy's processes ran"
    assert len(halted) == 1, "the agent confirmed: the removal went to the background"
    await drain_removals()
    assert state_of(docker_client, container_id) is None
    assert pending_removals() == 0


@pytest.mark.parametrize(
    "config",
    [{**CONFIG, "channel": False}, {**CONFIG, "user": "nobody"}, {**CONFIG, "init": False}],
    ids=["no-channel", "non-root-agent", "no-docker-init"],
)
async def test_without_a_root_agent_close_removes_the_container_itself(
    docker_client: Any, config: dict[str, Any]
) -> None:
    token = sleep_token()
    rt = open_runtime(config)
    await rt.start()
    await rt.exec(["sh", "-c", leftovers(token)])
    container_id = rt.sandbox_id
    assert container_id is not None
    await rt.close()
    assert pending_removals() == 0, "nothing was left to the background"
    assert state_of(docker_client, container_id) is None
    assert running_anywhere(token) == []


async def test_close_on_a_loaded_host_returns_only_once_every_process_died(
    docker_client: Any, halted: list[str]
) -> None:
    """``kill`` returns once the signal is queued: a process dies when it next runs, still
    listed with its command line until then. Busy loops in several sandboxes closing at once
    keep both cores taken and widen that window; close() must wait it out."""
    tokens = [sleep_token() for _ in range(3)]
    runtimes = [open_runtime(CONFIG) for _ in tokens]
    survivors: list[str] = []

    async def close(rt: Any, token: str) -> None:
        await rt.close()
        survivors.extend(running_anywhere(token))

    try:
        async with anyio.create_task_group() as group:
            for rt in runtimes:
                group.start_soon(rt.start)
        for rt, token in zip(runtimes, tokens, strict=True):
            busy = f"sh -c 'while :; do :; done' {token}"
            spawn = f"for i in {' '.join(map(str, range(40)))}; do {busy} & sleep {token} & done"
            await rt.exec(["sh", "-c", f'nohup sh -c "{spawn}" >/dev/null 2>&1 &'])
        for _ in range(150):  # 30 s at most: the busy loops slow their own start
            if all(len(running_anywhere(token)) >= 80 for token in tokens):
                break
            await anyio.sleep(0.2)
        else:
            raise AssertionError("the sandboxes' processes never all started")
    finally:
        async with anyio.create_task_group() as group:
            for rt, token in zip(runtimes, tokens, strict=True):
                group.start_soon(close, rt, token)
    assert survivors == [], "close() returned while processes of the sandbox still ran"
    assert len(halted) == len(runtimes), "every agent confirmed its HALT"
    await drain_removals()


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
        for rt in runtimes:
            await rt.exec(["sh", "-c", f"nohup sleep {sys.argv[3]} >/dev/null 2>&1 &"])
        print(ownership.CREATOR_ID, flush=True)
        for rt in runtimes:
            await rt.close()
        if end == "killed":
            os.kill(os.getpid(), signal.SIGKILL)  # removals may still be pending

    anyio.run(main, int(sys.argv[1]), sys.argv[2])
    """
)


def run_child(count: int, end: str, token: str) -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(count), end, token],
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
    token = sleep_token()
    code, session = await anyio.to_thread.run_sync(run_child, 4, "exits", token)
    assert code == 0, session
    assert session_containers(docker_client, session) == []
    assert running_anywhere(token) == []


async def test_a_process_killed_after_close_left_no_process_and_labels_for_the_sweep(
    docker_client: Any,
) -> None:
    token = sleep_token()
    code, session = await anyio.to_thread.run_sync(run_child, 4, "killed", token)
    assert code == -signal.SIGKILL, session
    assert running_anywhere(token) == [], "every close() had killed its sandbox's processes"
    left = docker_client.api.containers(all=True, filters={"label": f"{CREATOR}={session}"})
    assert len(left) <= 4
    await cleanup_sandboxes(["docker"])
    assert session_containers(docker_client, session) == []


class _RemovalElsewhere:
    """An engine on which someone else's removal of the container is under way: asking
    again answers 409 "already in progress" and the container shows for ``lingers`` more
    inspections."""

    def __init__(self, lingers: int) -> None:
        self.lingers = lingers
        self.inspected = 0

    def remove_container(self, container_id: str, **_: object) -> None:
        import docker.errors

        raise docker.errors.APIError(
            "409 Client Error",
            explanation=f"removal of container {container_id} is already in progress",
        )

    def inspect_container(self, container_id: str) -> dict[str, object]:
        import docker.errors

        self.inspected += 1
        if self.inspected > self.lingers:
            raise docker.errors.NotFound(f"No such container: {container_id}")
        return {"Id": container_id, "State": {"Status": "removing"}}


def test_a_removal_already_in_progress_is_waited_for_until_the_container_is_gone() -> None:
    """A process killed after asking for its removals leaves them running in the engine;
    the sweep that meets one returns only once the container is gone, so a listing right
    after the sweep no longer shows it (seen in CI: listed, then 404 on inspection)."""
    from runtimes.docker.client import remove_container_blocking

    engine = _RemovalElsewhere(lingers=3)
    remove_container_blocking(engine, "c0ffee", "docker container c0ffee")
    assert engine.inspected == 4, "returned while the container still showed"


def test_a_removal_in_progress_that_never_ends_is_a_typed_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from runtimes.docker import client

    monkeypatch.setattr(client, "REMOVAL_WAIT", 0.2)
    with pytest.raises(SandboxError, match="did not end within"):
        client.remove_container_blocking(
            _RemovalElsewhere(lingers=10**9), "c0ffee", "docker container c0ffee"
        )
