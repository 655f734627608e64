"""Where ray sandboxes go, and what happens when a node goes: on the node asked for, spread
over the cluster by its slots, typed errors within seconds when a node dies mid-command, and a
pool that refills on the nodes left."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import anyio
import pytest

from runtimes import (
    ProvisioningError,
    RuntimePool,
    SandboxError,
    SandboxUnavailableError,
    open_runtime,
)
from runtimes.ray import RayRuntime
from tests.ray.cluster import LocalCluster, Node

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SUBPROCESS = {"type": "subprocess"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def ray_config(**fields: Any) -> dict[str, Any]:
    return {"type": "ray", "runtime": SUBPROCESS, **fields}


async def netns_inode(rt: RayRuntime) -> str:
    """The inode of the network namespace a command in the sandbox runs in."""
    result = await rt.exec(["stat", "-L", "-c", "%i", "/proc/self/ns/net"], check=True)
    return result.stdout.strip()


def node_netns_inode(node: Node) -> str:
    import os

    return str(os.stat(f"/run/netns/{node.netns}").st_ino)


async def test_a_sandbox_runs_on_the_node_asked_for(ray_cluster: LocalCluster) -> None:
    for node, pin in ((ray_cluster.nodes[0], "address"), (ray_cluster.nodes[2], "node_id")):
        config = ray_config(node=node.address if pin == "address" else node.node_id)
        async with open_runtime(config) as rt:
            assert isinstance(rt, RayRuntime)
            assert (rt.node_id, rt.node_address) == (node.node_id, node.address)
            assert await netns_inode(rt) == node_netns_inode(node)  # really in that namespace
            assert node.address in rt.describe()


async def test_a_node_that_does_not_exist_is_a_provisioning_error(
    ray_cluster: LocalCluster,
) -> None:
    with pytest.raises(ProvisioningError, match="no alive Ray node"):
        async with open_runtime(ray_config(node="10.254.254.254")):
            pass


async def test_a_pool_of_12_fills_the_3_nodes_and_a_13th_waits_for_a_slot(
    ray_cluster: LocalCluster,
) -> None:
    """12 slots (4 per node): the pool's 12 sandboxes take them all, 4 on each node, as Ray's
    scheduler placed them; a 13th sandbox finds no slot and fails typed after its timeout."""
    config = ray_config(strategy="spread")
    async with RuntimePool(config, size=12, max_create_concurrency=4) as pool:
        await pool.wait_ready(12)
        taken = [await pool.take() for _ in range(12)]
        try:
            per_node = Counter(rt.node_address for rt in taken if isinstance(rt, RayRuntime))
            assert per_node == {node.address: 4 for node in ray_cluster.nodes}, per_node
            started = time.monotonic()
            with pytest.raises(ProvisioningError, match="no Ray node took the sandbox"):
                async with open_runtime(ray_config(start_timeout=3)):
                    pass
            assert time.monotonic() - started < 20
        finally:
            async with anyio.create_task_group() as tg:
                for rt in taken:
                    tg.start_soon(rt.close)


async def test_spread_puts_six_sandboxes_on_every_node(ray_cluster: LocalCluster) -> None:
    runtimes = [open_runtime(ray_config(strategy="spread")) for _ in range(6)]
    try:
        async with anyio.create_task_group() as tg:
            for rt in runtimes:
                tg.start_soon(rt.start)
        per_node = Counter(rt.node_address for rt in runtimes if isinstance(rt, RayRuntime))
        assert set(per_node) == {node.address for node in ray_cluster.nodes}, per_node
    finally:
        for rt in runtimes:
            await rt.close()


async def test_a_node_killed_mid_exec_fails_typed_and_the_pool_refills_elsewhere(
    ray_cluster: LocalCluster,
) -> None:
    """A node of its own is added, then killed while a command runs on it: the command fails
    with SandboxUnavailableError within seconds (never a hang, never another error); the
    sandbox then says it is lost (the driver's node watch), so every later call fails at once;
    closing does not hang; the pool's next sandboxes start on the nodes left."""
    doomed = ray_cluster.add_node(slots=2)
    try:
        pool_config = ray_config(strategy="spread", dead_after=3)
        async with RuntimePool(pool_config, size=0) as pool:
            async with open_runtime(ray_config(node=doomed.address, dead_after=3)) as victim:
                assert isinstance(victim, RayRuntime) and victim.node_id == doomed.node_id
                await victim.exec(["true"], check=True)
                failure: list[BaseException] = []
                took: list[float] = []

                killed_at: list[float] = []

                async def run_long() -> None:
                    try:
                        await victim.exec(["sleep", "60"], timeout=90)
                    except SandboxError as exc:
                        failure.append(exc)
                        took.append(time.monotonic() - killed_at[0])

                async with anyio.create_task_group() as tg:
                    tg.start_soon(run_long)
                    await anyio.sleep(1.0)
                    killed_at.append(time.monotonic())
                    ray_cluster.kill_node(doomed)
                assert failure and isinstance(failure[0], SandboxUnavailableError), failure
                print(f"node killed: the running exec failed {took[0]:.1f} s later")
                assert took[0] < 20
                for _ in range(300):  # the driver's node watch lists it lost
                    if victim.lost() is not None:
                        break
                    await anyio.sleep(0.1)
                assert doomed.address in str(victim.lost())
                # then every call fails at once, without asking the node
                with pytest.raises(SandboxUnavailableError, match="left the cluster"):
                    await victim.read("anything")
                assert not await victim.alive()
            ray_cluster.wait_node_dead(doomed)
            async with pool.acquire(timeout=60) as fresh:
                assert isinstance(fresh, RayRuntime)
                assert fresh.node_address in {node.address for node in ray_cluster.nodes}
                await fresh.exec(["true"], check=True)
    finally:
        if doomed in ray_cluster.nodes:
            ray_cluster.kill_node(doomed)
