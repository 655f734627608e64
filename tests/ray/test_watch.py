"""The driver's watch on the cluster's nodes (runtimes/ray/watch.py), on a stand-in for
``ray.nodes()``: it learns of deaths while held, keeps them when the cluster cannot be
reached, and its thread ends when nothing holds it. No cluster needed (the real one:
tests/ray/test_placement.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from runtimes.ray import calls
from runtimes.ray.watch import NodeWatch


class Nodes:
    """What ``ray.nodes()`` answers, as the test sets it; ``None`` raises (no cluster)."""

    def __init__(self) -> None:
        self.table: list[dict[str, Any]] | None = []
        self.asked = 0

    def nodes(self) -> list[dict[str, Any]]:
        self.asked += 1
        if self.table is None:
            raise ConnectionError("the GCS cannot be reached")
        return self.table


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Nodes:
    nodes = Nodes()
    monkeypatch.setattr(calls, "ray_module", lambda: nodes)
    return nodes


def watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "vf-sandbox-ray-nodes"]


def wait_for(condition: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.01)


def test_a_node_the_cluster_lists_dead_is_known_dead_while_held(cluster: Nodes) -> None:
    watch = NodeWatch(interval=0.02)
    cluster.table = [{"NodeID": "a", "Alive": True}, {"NodeID": "b", "Alive": True}]
    before = len(watchers())
    watch.hold()
    watch.hold()
    try:
        assert len(watchers()) == before + 1, "one thread however many sandboxes hold it"
        wait_for(lambda: cluster.asked > 0)
        assert not watch.dead("a") and not watch.dead("b")
        cluster.table = [{"NodeID": "a", "Alive": True}, {"NodeID": "b", "Alive": False}]
        wait_for(lambda: watch.dead("b"))
        assert not watch.dead("a")
        cluster.table = None  # the cluster cannot be reached: what was known stays
        asked = cluster.asked
        wait_for(lambda: cluster.asked > asked + 2)
        assert watch.dead("b") and not watch.dead("a")
    finally:
        watch.release()
        watch.release()
    wait_for(lambda: len(watchers()) == before)


def test_released_it_stops_asking_and_held_again_it_starts_anew(cluster: Nodes) -> None:
    watch = NodeWatch(interval=0.02)
    before = len(watchers())
    watch.hold()
    watch.release()
    watch.hold()  # at once: the first thread must stop, one thread asks
    try:
        wait_for(lambda: len(watchers()) == before + 1)
        cluster.table = [{"NodeID": "c", "Alive": False}]
        wait_for(lambda: watch.dead("c"))
    finally:
        watch.release()
    wait_for(lambda: len(watchers()) == before)
    asked = cluster.asked
    time.sleep(0.1)
    assert cluster.asked == asked, "nothing holds it, nothing asks the cluster"
