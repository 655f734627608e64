"""RuntimePool on Docker: containers handed out once and removed after their block, a missing
image retried then reported, nothing left by a closed pool, and a SIGKILLed holder's pool
swept by ``cleanup_sandboxes``. Creations are counted by wrapping ``DockerRuntime._start``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import anyio
import docker.errors
import pytest

from runtimes import ProvisioningError, ownership
from runtimes.cleanup import cleanup_sandboxes
from runtimes.docker import DockerRuntime
from runtimes.lifecycle import State
from runtimes.pool import POOL, RuntimePool
from runtimes.pytest_plugin import DOCKER_TEST_IMAGE
from runtimes.reaper import drain_removals
from tests.processes import running_anywhere, sleep_token

from .conftest import Starts, pool_containers

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"type": "docker", "image": DOCKER_TEST_IMAGE, "creations_per_second": None}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Starts:
    return Starts(monkeypatch, DockerRuntime)


async def test_acquire_hands_out_distinct_started_containers_removed_after_their_block(
    starts: Starts, docker_client: Any
) -> None:
    ids: list[str] = []
    async with RuntimePool(CONFIG, size=2, max_create_concurrency=2) as pool:
        await pool.wait_ready()
        labelled = pool_containers(docker_client, pool.id)
        assert len(labelled) == 2
        assert all(c.labels[ownership.CREATOR] == ownership.CREATOR_ID for c in labelled)

        async def use() -> None:
            async with pool.acquire() as rt:
                assert rt.state is State.OPEN
                result = await rt.exec(["sh", "-c", "test ! -e /work/mine && touch /work/mine"])
                assert result.exit_code == 0, "another acquirer used this container"
                assert rt.sandbox_id is not None
                ids.append(rt.sandbox_id)
                token = sleep_token()  # this acquirer's own: the others run concurrently
                await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 &"])
            assert not running_anywhere(token), "nothing of it runs at the block's end"

        async with anyio.create_task_group() as group:
            for _ in range(6):
                group.start_soon(use)
        assert len(set(ids)) == 6
        await pool.wait_ready()
        assert starts.calls == 8, "size 2 plus one replacement per acquirer"
        assert starts.max_in_flight <= 2
    await drain_removals()
    assert pool_containers(docker_client, pool.id) == []


async def test_a_missing_image_is_retried_then_reported_and_the_pool_recovers(
    starts: Starts, docker_client: Any
) -> None:
    image = f"vf-sandbox/pool-test-{uuid.uuid4().hex[:8]}:missing"
    config = {**CONFIG, "image": image}
    pool = RuntimePool(
        config, size=1, max_create_concurrency=1, create_attempts=2, retry_backoff=(0.0, 0.0)
    )
    try:
        async with pool:
            with pytest.raises(ProvisioningError) as info:
                async with pool.acquire():
                    raise AssertionError("no container should have been handed out")
            assert starts.calls == 2, "exactly create_attempts tries"
            assert isinstance(info.value.__cause__, ProvisioningError)
            assert image in str(info.value)

            docker_client.images.get(DOCKER_TEST_IMAGE).tag(image)  # the image appears
            async with pool.acquire() as rt:
                assert (await rt.exec(["true"])).exit_code == 0
            assert starts.calls >= 3
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(image, noprune=True)
    await drain_removals()
    assert pool_containers(docker_client, pool.id) == []


async def test_closing_the_pool_leaves_no_container_even_with_creations_in_flight(
    starts: Starts, docker_client: Any
) -> None:
    async with RuntimePool(CONFIG, size=4, max_create_concurrency=2) as pool:
        await pool.wait_ready(1)  # leaves the pool with creations in flight
        assert pool.creating > 0
    await drain_removals()
    assert pool_containers(docker_client, pool.id) == []
    assert all(rt.closed for rt in starts.started)


_CHILD = textwrap.dedent(
    """
    import sys, anyio
    from runtimes import ownership
    from runtimes.pool import RuntimePool

    async def main():
        config = {"type": "docker", "image": sys.argv[1], "creations_per_second": None}
        async with RuntimePool(config, size=3) as pool:
            held = await pool.take()  # an acquired sandbox, and a replacement
            await pool.wait_ready()
            print("READY", ownership.CREATOR_ID, pool.id, held.sandbox_id, flush=True)
            await anyio.sleep(600)

    anyio.run(main)
    """
)


async def test_a_sigkilled_holder_leaves_only_labelled_containers_that_cleanup_removes(
    docker_client: Any,
) -> None:
    child = subprocess.Popen(  # noqa: ASYNC220 - a child left running, killed by the test
        [sys.executable, "-c", _CHILD, DOCKER_TEST_IMAGE],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    session = pool_id = ""
    try:
        assert child.stdout is not None
        line = (await anyio.to_thread.run_sync(child.stdout.readline)).split()
        if not line or line[0] != "READY":
            child.kill()
            raise AssertionError(f"the child failed: {child.communicate(timeout=30)[1]}")
        session, pool_id, held = line[1], line[2], line[3]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)

        by_session = docker_client.containers.list(
            all=True, filters={"label": f"{ownership.CREATOR}={session}"}
        )
        assert len(by_session) == 4, "3 ready and the acquired one: SIGKILL skips every backstop"
        assert {c.labels.get(POOL) for c in by_session} == {pool_id}
        assert held in {c.id for c in by_session}
        assert all(ownership.creator_is_dead(c.labels) is True for c in by_session)

        results = await cleanup_sandboxes(["docker"])
        removed = {r.info.id for r in results if r.action == "removed"}
        assert {c.id for c in by_session} <= removed
        assert pool_containers(docker_client, pool_id) == []
    finally:
        if child.poll() is None:
            child.kill()
        if session:
            for container in docker_client.containers.list(
                all=True, filters={"label": f"{ownership.CREATOR}={session}"}
            ):
                container.remove(force=True)
