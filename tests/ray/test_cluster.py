"""The local Ray cluster the ray tests run on is what it claims: real nodes, each in its own
network namespace at the address the cluster gave it, a killed node noticed within seconds,
and nothing left behind once it stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.ray.cluster import (
    LocalCluster,
    Node,
    cleanup_stale,
    marked_pids,
    netns_pids,
    require_root_and_ip,
)

DEATH_BOUND_S = 8.0
"""A SIGKILLed node is marked dead well within this (measured: ~3 s; see HEALTH_ENV)."""


def _where_am_i() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class WhereAmI:
        def where(self) -> tuple[str, str, int]:
            import ray as inner

            address = inner.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            return address, os.readlink("/proc/self/ns/net"), os.getpid()

        def make(self, size: int) -> bytes:
            return b"x" * size  # large: it stays in this node's object store

        def fetch(self, refs: list[Any]) -> int:
            import ray as inner

            return len(inner.get(refs[0], timeout=30))  # pulled from the other node

    return WhereAmI


def _pinned(node: Node) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    strategy = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
    return _where_am_i().options(scheduling_strategy=strategy).remote()


def _probe(node: Node) -> tuple[str, str, bool]:
    """Run an actor pinned to ``node`` (hard affinity) and ask it where it runs: its address,
    its network namespace, and whether its pid is one of the node namespace's processes."""
    import ray

    actor = _pinned(node)
    try:
        address, netns, pid = ray.get(actor.where.remote(), timeout=60)
        return address, netns, pid in netns_pids(node.netns)
    finally:
        ray.kill(actor)


def _alive(node_id: str) -> bool:
    import ray

    return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())  # type: ignore[no-untyped-call]


def test_nodes_are_alive_at_their_addresses_each_in_its_own_netns(
    ray_cluster: LocalCluster,
) -> None:
    import ray

    assert len(ray_cluster.nodes) == 3
    alive = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}  # type: ignore[no-untyped-call]
    root_netns = os.readlink("/proc/self/ns/net")
    seen = set()
    for node in ray_cluster.nodes:
        assert node.node_id in alive
        assert alive[node.node_id]["NodeManagerAddress"] == node.address
        assert alive[node.node_id]["Resources"].get("vf_sandbox") == node.slots == 4
        address, netns, inside = _probe(node)
        assert address == node.address
        assert netns != root_netns
        assert inside  # the actor's process is one of that namespace's
        seen.add(netns)
    assert len(seen) == 3  # a namespace each
    maker, taker = _pinned(ray_cluster.nodes[0]), _pinned(ray_cluster.nodes[1])
    try:  # node to node through the bridge (an object pulled between object stores)
        assert ray.get(taker.fetch.remote([maker.make.remote(2_000_000)]), timeout=60) == 2_000_000
    finally:
        ray.kill(maker)
        ray.kill(taker)
    head = [n for n in alive.values() if n["NodeManagerAddress"] == ray_cluster.driver_address]
    assert len(head) == 1, "the driver's node is the head, on the bridge's address"


def test_an_added_node_joins_and_a_killed_one_is_marked_dead_within_seconds(
    ray_cluster: LocalCluster,
) -> None:
    node = ray_cluster.add_node(slots=2)
    assert _alive(node.node_id)
    assert node in ray_cluster.nodes
    assert _probe(node)[0] == node.address
    assert ray_cluster.processes(node)
    began = time.monotonic()
    ray_cluster.kill_node(node)
    killed = time.monotonic() - began
    assert netns_pids(node.netns) == []
    assert node not in ray_cluster.nodes
    ray_cluster.wait_node_dead(node, timeout=30)
    took = time.monotonic() - began
    print(f"\nkilled node {node.name} in {killed:.2f}s, marked dead after {took:.2f}s")
    assert killed < 2.0  # kill_node returns at once
    assert not _alive(node.node_id)
    assert took < DEATH_BOUND_S
    assert len(ray_cluster.nodes) == 3  # the session's own nodes are untouched
    assert all(_alive(n.node_id) for n in ray_cluster.nodes)


def test_stop_leaves_nothing() -> None:
    require_root_and_ip()
    began = time.monotonic()
    cluster = LocalCluster(workers=1, slots=1).start()
    print(f"\n1-worker cluster up in {time.monotonic() - began:.1f}s")
    try:
        (node,) = cluster.nodes
        pids = cluster.all_pids()
        assert set(cluster.processes(node)) <= set(pids)
        assert len(pids) > len(cluster.processes(node))  # the head's processes are found too
    finally:
        cluster.stop()
    cluster.stop()  # idempotent
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    assert cluster.tag not in netns.stdout
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True)
    assert cluster.tag not in links.stdout  # no bridge, no veth
    rules = subprocess.run(["iptables", "-S"], capture_output=True, text=True, check=False)
    assert cluster.bridge not in rules.stdout
    assert not Path(cluster.temp_dir).exists()
    survivors = [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _zombie(pid)]
    assert survivors == []
    assert cluster.all_pids() == []
    assert cluster.nodes == []


CRASHING_OWNER = """
import os, signal, sys
from tests.ray.cluster import LocalCluster
cluster = LocalCluster(workers=1, slots=1).start()
print(cluster.tag, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no stop(), no atexit: everything is left behind
"""


def test_what_a_crashed_run_left_is_removed_by_the_next() -> None:
    require_root_and_ip()
    crashed = subprocess.run(
        [sys.executable, "-c", CRASHING_OWNER],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr[-2000:]
    tag = crashed.stdout.split()[0]
    assert marked_pids(tag), "the dead owner's cluster runs on"
    cleanup_stale()  # (another run's start() may have swept it first: both are fine)
    assert marked_pids(tag) == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    links = subprocess.run(["ip", "-br", "link"], capture_output=True, text=True, check=True)
    assert tag not in netns.stdout + links.stdout
    assert not Path(f"/tmp/{tag}").exists()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


@pytest.fixture(autouse=True)
def _report_rss(request: pytest.FixtureRequest) -> None:
    """Print the cluster's memory once (the first test using it)."""
    if "ray_cluster" in request.fixturenames and not getattr(_report_rss, "done", False):
        cluster: LocalCluster = request.getfixturevalue("ray_cluster")
        count, rss = len(cluster.all_pids()), cluster.rss_bytes() >> 20
        print(f"\ncluster {cluster.tag}: {count} processes, RSS {rss} MiB")
        _report_rss.done = True  # type: ignore[attr-defined]
