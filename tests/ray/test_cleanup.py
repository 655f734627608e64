"""Leak-proof across the cluster: a driver that dies (SIGKILL) leaves nothing running on any
node once ``vf-sandbox cleanup`` swept the cluster through Ray, and ``vf-sandbox ls`` shows
the node of each ray sandbox before that.

The driver is a subprocess (so it can be SIGKILLed): it opens a ray sandbox over
``subprocess`` on each of two nodes and one over Docker, starts background processes in each
(one of them ``setsid``), and waits. The CLI runs as a subprocess too, reaching the cluster
through ``RAY_ADDRESS``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from runtimes.errors import SandboxInvalidArgumentError
from runtimes.models import SandboxInfo
from runtimes.ray.cluster import (
    INNER_BACKEND,
    NODE_ADDRESS,
    NodeListing,
    inner_info,
    merged,
    ray_row,
)
from runtimes.sweep import MARK_VAR
from tests.ray.cluster import COMMON_ENV, LocalCluster, netns_pids

IMAGE = "vf-sandbox/base:bookworm"
DRIVER_LABEL = "vf-sandbox.ray-driver"

DRIVER = r"""
import asyncio, json, sys
import ray
from runtimes import open_runtime, ownership

head, driver_ip, nodes, docker_node, image, token, snap = sys.argv[1:8]
START = f"sleep {token} >/dev/null 2>&1 & setsid sleep {token} >/dev/null 2>&1 & echo started"


async def main() -> None:
    ray.init(address=head, _node_ip_address=driver_ip, logging_level="ERROR", log_to_driver=False)
    configs = [{"type": "ray", "runtime": {"type": "subprocess"}, "node": node}
               for node in nodes.split(",")]
    if docker_node:
        configs.append({"type": "ray", "runtime": {"type": "docker", "image": image},
                        "node": docker_node})
    opened, snapshots = [], []
    for config in configs:
        rt = open_runtime(config)
        await rt.start()
        result = await rt.exec(["sh", "-c", START])
        assert result.stdout.strip() == "started", result
        opened.append({"backend": config["runtime"]["type"], "id": rt.sandbox_id,
                       "node": rt.node_address, "workdir": rt.workdir})
        if snap:
            snapshots.append((await rt.snapshot()).model_dump(mode="json"))
    print(json.dumps({"driver": ownership.CREATOR_ID, "sandboxes": opened,
                      "snapshots": snapshots}), flush=True)
    print("ready", flush=True)
    await asyncio.sleep(3600)


asyncio.run(main())
"""


def _cli(cluster: LocalCluster, *args: str) -> dict[str, Any]:
    env = {**os.environ, **COMMON_ENV, "RAY_ADDRESS": cluster.head_address}
    done = subprocess.run(
        [sys.executable, "-m", "runtimes.cli", *args, "--runtime", "ray", "--json"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    # cleanup exits 1 when some removal failed: the sweep covers every ray sandbox these
    # nodes see, leftovers of other runs on this machine included; callers check their own.
    assert done.returncode in ((0, 1) if args[0] == "cleanup" else (0,)), done.stderr
    document: dict[str, Any] = json.loads(done.stdout)
    return document


def _start_driver(
    cluster: LocalCluster, token: str, nodes: list[str], docker_node: str = "", snap: bool = False
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    argv = [sys.executable, "-c", DRIVER, cluster.head_address, cluster.driver_address]
    argv += [",".join(nodes), docker_node, IMAGE, token, "1" if snap else ""]
    driver = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **COMMON_ENV},
    )  # fmt: skip
    assert driver.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in driver.stdout], daemon=True
    ).start()
    got: list[str] = []
    deadline = time.monotonic() + 60
    while "ready" not in got:
        try:
            got.append(lines.get(timeout=max(0.01, deadline - time.monotonic())).strip())
        except queue.Empty:
            driver.kill()
            pytest.fail(f"the driver did not get ready (exit {driver.poll()}): {got}")
    return driver, json.loads(got[-2])


def _with_token(token: str) -> list[int]:
    """Every process on this machine (every node, every container) running ``sleep TOKEN``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", token.encode()]:
                    found.append(int(entry.name))
    return found


def _settled(token: str, count: int) -> list[int]:
    """:func:`_with_token` once it finds ``count`` (a background ``sleep`` may still be
    starting when its command returned), or after 10 s."""
    deadline = time.monotonic() + 10
    while len(found := _with_token(token)) != count and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _with_mark(marks: set[str]) -> list[int]:
    found = []
    wanted = {f"{MARK_VAR}={mark}".encode() for mark in marks}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if wanted & set((entry / "environ").read_bytes().split(b"\0")):
                    found.append(int(entry.name))
    return found


def _containers(driver_id: str) -> list[str]:
    done = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={DRIVER_LABEL}={driver_id}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.split()


def _of(results: list[dict[str, Any]], sandboxes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cleanup results of ``sandboxes`` (a ray id ends with its own sandbox's id)."""
    ids = {s["id"] for s in sandboxes}
    return [r for r in results if r["id"].rsplit("/", 1)[1] in ids]


def test_a_killed_driver_leaves_nothing_on_any_node_after_cleanup(
    ray_cluster: LocalCluster,
) -> None:
    began = time.monotonic()
    token = str(100_000 + uuid.uuid4().int % 800_000)  # this test's `sleep TOKEN` processes
    first, second = ray_cluster.nodes[0].address, ray_cluster.nodes[1].address
    driver, opened = _start_driver(ray_cluster, token, [first, second], docker_node=first)
    driver_id = opened["driver"]
    try:
        sandboxes = opened["sandboxes"]
        node_of = {n.address: n for n in ray_cluster.nodes}
        dirs = [Path(s["workdir"]).parent for s in sandboxes if s["backend"] == "subprocess"]
        marks = {json.loads((d / "meta.json").read_text())["mark"] for d in dirs}
        assert len(_settled(token, 2 * len(sandboxes))) == 2 * len(sandboxes)
        for s in sandboxes:
            if s["backend"] == "subprocess":  # its processes run in its node's namespace
                here = set(netns_pids(node_of[s["node"]].netns)) & set(_with_token(token))
                assert len(here) == 2, s

        # ls: each of the driver's sandboxes, on its node, its session alive
        listed = {
            (r["labels"]["vf-sandbox.ray-backend"], r["id"].rsplit("/", 1)[1]): r
            for r in _cli(ray_cluster, "ls")["sandboxes"]
            if r["labels"].get(DRIVER_LABEL) == driver_id
        }
        assert set(listed) == {(s["backend"], s["id"]) for s in sandboxes}
        for s in sandboxes:
            row = listed[(s["backend"], s["id"])]
            assert row["backend"] == "ray"
            assert row["node"] == s["node"]
            assert row["id"] == f"{node_of[s['node']].node_id}/{s['backend']}/{s['id']}"
            assert row["session"] == "alive"

        # a live driver's sandboxes survive a sweep
        swept = _cli(ray_cluster, "cleanup")["results"]
        mine = _of(swept, sandboxes)
        assert [r["action"] for r in mine] == ["kept"] * len(sandboxes)

        # The driver dies hard, and so do its actors: Ray ends a dead driver's actors itself,
        # and one that exits gracefully may close its sandbox on the way out, which would
        # leave the sweep nothing to prove. Here none gets the chance: every sandbox leaks.
        actors = {int(row["labels"]["vf-sandbox.pid"]) for row in listed.values()}
        for pid in actors:
            os.kill(pid, signal.SIGKILL)
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)

        # ls then says their session is dead (judged on their nodes)
        deadline = time.monotonic() + 30
        while True:
            sessions = [
                r["session"] for r in _cli(ray_cluster, "ls")["sandboxes"]
                if r["labels"].get(DRIVER_LABEL) == driver_id
            ]  # fmt: skip
            if sessions == ["dead"] * len(sandboxes) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sessions == ["dead"] * len(sandboxes)
        assert len(_with_token(token)) == 2 * len(sandboxes)  # still running: leaked

        dry = _cli(ray_cluster, "cleanup", "--dry-run")
        mine = _of(dry["results"], sandboxes)
        assert sorted(r["action"] for r in mine) == ["would remove"] * len(sandboxes)
        assert all(d.exists() for d in dirs) and _containers(driver_id)

        swept = _cli(ray_cluster, "cleanup")["results"]
        mine = _of(swept, sandboxes)
        assert sorted(r["action"] for r in mine) == ["removed"] * len(sandboxes)
        for r in mine:  # the reason names the node it was judged and removed on
            assert "session is dead (node " in r["reason"]

        assert _containers(driver_id) == []
        assert _with_token(token) == []
        for node in ray_cluster.nodes:
            assert set(netns_pids(node.netns)).isdisjoint(_with_mark(marks))
        assert _with_mark(marks) == []
        assert [d for d in dirs if d.exists()] == []
        assert not [
            r for r in _cli(ray_cluster, "ls")["sandboxes"]
            if r["labels"].get(DRIVER_LABEL) == driver_id
        ]  # fmt: skip
        print(f"\nkilled driver swept from every node in {time.monotonic() - began:.1f}s")
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for container in _containers(driver_id):
            subprocess.run(["docker", "rm", "-f", container], capture_output=True, check=False)
        for pid in _with_token(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_killed_drivers_snapshot_is_swept_from_its_node(ray_cluster: LocalCluster) -> None:
    """A ray snapshot's own snapshot stays on its node (kept there for the ray snapshot's
    life): once its driver is gone, ``ls`` shows it (with its node) and ``cleanup`` removes it
    there, unless it was taken with ``keep=True``."""
    node = ray_cluster.nodes[2]
    token = str(100_000 + uuid.uuid4().int % 800_000)
    driver, opened = _start_driver(ray_cluster, token, [node.address], snap=True)
    try:
        (taken,) = opened["snapshots"]
        inner = json.loads(taken["labels"]["vf-sandbox.ray-snapshot"])
        assert Path(inner["id"]).is_dir()  # the subprocess snapshot's directory, on the node
        listed = [
            s for s in _cli(ray_cluster, "ls")["snapshots"] if s["id"] == taken["id"]
        ]  # fmt: skip
        assert [(s["node"], s["session"], s["kept"]) for s in listed] == [
            (node.address, "alive", False)
        ]
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        swept = _cli(ray_cluster, "cleanup")["snapshots"]
        assert [(r["action"], r["reason"]) for r in swept if r["id"] == taken["id"]] == [
            ("removed", "session is dead")
        ]
        assert not Path(inner["id"]).exists()
        assert taken["id"] not in [s["id"] for s in _cli(ray_cluster, "ls")["snapshots"]]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in _with_token(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if opened["snapshots"]:  # what a failed run left of the snapshot on its node
            leftover = json.loads(opened["snapshots"][0]["labels"]["vf-sandbox.ray-snapshot"])
            shutil.rmtree(leftover["id"], ignore_errors=True)


def test_doctor_reports_each_node_alive_or_dead_with_its_slots(ray_cluster: LocalCluster) -> None:
    gone = ray_cluster.add_node(slots=2)
    ray_cluster.kill_node(gone)
    ray_cluster.wait_node_dead(gone)
    (row,) = _cli(ray_cluster, "doctor")["backends"]
    assert (row["name"], row["status"]) == ("ray", "ok"), row
    assert row["cluster"]["address"] == ray_cluster.head_address
    nodes = {n["node_id"]: n for n in row["cluster"]["nodes"]}
    for node in ray_cluster.nodes:
        seen = nodes[node.node_id]
        assert (seen["address"], seen["alive"], seen["slots_total"]) == (node.address, True, 4)
        assert 0 <= seen["slots_free"] <= 4
    assert (nodes[gone.node_id]["alive"], nodes[gone.node_id]["slots_free"]) == (False, None)
    head = [n for n in nodes.values() if n["address"] == ray_cluster.driver_address]
    assert [(n["alive"], n["slots_total"]) for n in head] == [(True, 0)]
    assert f"{gone.address} dead" in row["detail"]
    assert f"{ray_cluster.nodes[0].address} " in row["detail"]


def _inner(backend: str, sandbox_id: str) -> SandboxInfo:
    labels = {DRIVER_LABEL: "d", "vf-sandbox.session": "s"}
    return SandboxInfo(backend, sandbox_id, labels, "running", "2026-11-28T00:00:00+00:00")


def test_a_sandbox_several_nodes_see_is_listed_once_on_the_node_that_created_it() -> None:
    """Nodes on one machine share its Docker engine and filesystem: each sees every sandbox
    there. The one whose process created it (a live creator in its network namespace) claims
    it; one nobody claims (its creator is dead) goes to the first node that saw it."""
    shared, claimed = _inner("docker", "c1"), _inner("subprocess", "sbx-1")
    first = NodeListing("n1", "10.0.0.1", [shared, claimed], [])
    second = NodeListing("n2", "10.0.0.2", [shared, claimed], [], {("subprocess", "sbx-1")})
    rows = {row.id: row for row in merged([first, second])}
    assert set(rows) == {"n1/docker/c1", "n2/subprocess/sbx-1"}
    assert rows["n2/subprocess/sbx-1"].labels[NODE_ADDRESS] == "10.0.0.2"
    assert rows["n1/docker/c1"].labels[INNER_BACKEND] == "docker"


def test_a_ray_row_stands_for_its_own_sandbox() -> None:
    inner = _inner("subprocess", "sbx-1")
    row = ray_row(inner, "n1", "10.0.0.1")
    assert (row.backend, row.id, row.state, row.created) == (
        "ray", "n1/subprocess/sbx-1", inner.state, inner.created
    )  # fmt: skip
    assert inner_info(row) == inner
    with pytest.raises(SandboxInvalidArgumentError):
        inner_info(SandboxInfo("ray", "n1/subprocess", {}))
