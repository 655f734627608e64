"""Snapshots and forks of a ray sandbox live on its node: a fork starts there, from the files
the snapshot holds, and removing the snapshot removes it on that node."""

from __future__ import annotations

import pytest

from runtimes import SandboxError, open_runtime
from runtimes.cleanup import remove_snapshot
from runtimes.ray import RayRuntime
from runtimes.ray.placement import NODE, inner_snapshot
from tests.ray.cluster import LocalCluster

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_fork_starts_on_the_snapshots_node_with_its_files(
    ray_cluster: LocalCluster,
) -> None:
    node = ray_cluster.nodes[1]
    config = {"type": "ray", "runtime": {"type": "subprocess"}, "node": node.address}
    async with open_runtime(config) as rt:
        await rt.write("state/kept.txt", b"before the snapshot")
        snap = await rt.snapshot()
        await rt.write("state/kept.txt", b"after the snapshot")
    assert snap.backend == "ray" and snap.labels[NODE] == node.node_id
    assert snap.holds == "workdir"
    unpinned = {"type": "ray", "runtime": {"type": "subprocess"}, "strategy": "spread"}
    forks = [open_runtime(unpinned, snapshot=snap) for _ in range(3)]
    try:
        for fork in forks:
            await fork.start()
            assert isinstance(fork, RayRuntime) and fork.node_id == node.node_id
            assert await fork.read("state/kept.txt") == b"before the snapshot"
    finally:
        for fork in forks:
            await fork.close()
    await remove_snapshot(snap)
    with pytest.raises(SandboxError):  # gone on the node: a fork of it cannot start
        async with open_runtime(unpinned, snapshot=snap):
            pass
    assert inner_snapshot(snap).backend == "subprocess"
