"""Ray sandboxes on a remote node beside the same runtime used locally (section ``ray``).

A real cluster of this machine (``tests.ray.cluster.LocalCluster``: the head in the root
network namespace, each worker node a namespace of its own on a bridge the cluster makes;
needs root and iproute2), this process its driver. Every row is measured beside its baseline
in the same run:

* ``exec(["true"])``, ``write`` then ``read`` of 1 KiB, and create-to-ready (``start()``
  returning; ``close()`` not timed) through a ray sandbox pinned to worker node ``n1``
  (``{"type": "ray", "runtime": inner, "node": <its address>}``), vs the same inner runtime
  opened locally: ``subprocess``, then ``docker`` (``vf-sandbox/base:bookworm``) where the
  engine has the image. Interleaved call by call, in a new (seeded) order every round;
* rollouts/s of ``harnesses.trainer.run_rollouts`` (the bash harness, the scripted policy and
  the check of ``benchmarks.trainers``: 4 tool calls, then ``CommandCheck``) over ray sandboxes
  (``strategy="spread"``) on 1, 2, then 3 worker nodes (each added with ``add_node()`` after the
  previous count was measured), ``SLOTS`` rollouts at a time per node, vs the same rollouts on
  local subprocess sandboxes at the same concurrency, run before and after the ray run.

Where ray is not installed or the machine cannot build the cluster (not root, no ``ip``), the
section says why and measures nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from runtimes import drain_removals, open_runtime
from runtimes.base import Runtime
from runtimes.ray.config import SLOT_RESOURCE

from .stats import Measure, Series, interleaved_measures, ms, ratio, table, timed
from .suite import Environment, KiB, Row, rows_table

SLOTS = 4
"""``vf_sandbox`` slots per worker node: the rollouts' concurrency is ``SLOTS`` x nodes."""
NODES = 3
CREATES = 12
"""Create-to-ready samples per variant (fewer with ``--quick``)."""
ADDED_TARGET_MS = 2.0
IDLE_SECONDS = 3.0
"""How long the cluster's idle CPU is sampled before each node count's runs."""
SUBPROCESS: dict[str, Any] = {"type": "subprocess"}


def unavailable() -> str | None:
    """Why the section cannot run here (no ray, not root, no iproute2), or None."""
    if importlib.util.find_spec("ray") is None:
        return "ray is not installed (`pip install 'vf-sandbox[ray]'`)"
    from tests.ray.cluster import missing_requirement

    return missing_requirement()


def ray_config(inner: dict[str, Any], **where: Any) -> dict[str, Any]:
    """A ray sandbox of ``inner``, placed by ``where`` (``node=...`` or ``strategy=...``)."""
    return {"type": "ray", "runtime": inner, **where}


# ---------------------------------------------------------------------- per call


async def _exec(rt: Runtime) -> None:
    result = await rt.exec(["true"])
    assert result.exit_code == 0, result


async def _write_read(rt: Runtime, data: bytes) -> None:
    await rt.write("small.bin", data)
    assert await rt.read("small.bin") == data


async def _create_to_ready(config: dict[str, Any]) -> float:
    rt = open_runtime(config)
    started = time.perf_counter()
    await rt.start()
    elapsed = time.perf_counter() - started
    await rt.close()
    await drain_removals()  # a Docker sandbox's removal must not fall on the next sample
    return elapsed


def _timing(call: Any) -> Measure:
    return lambda: timed(call)


class Echo:
    """The floor of a call through Ray: an actor method doing nothing, on the sandbox's node,
    with the options a sandbox's actor has (no CPU, a slot, threaded)."""

    def ping(self) -> int:
        return os.getpid()


@contextlib.asynccontextmanager
async def echo_actor(node_id: str) -> AsyncIterator[Any]:
    """An :class:`Echo` actor on node ``node_id``, killed on exit."""
    import ray

    from runtimes.ray.placement import on_node

    actor: Any = (
        ray.remote(Echo)
        .options(
            num_cpus=0,
            resources={SLOT_RESOURCE: 1},
            max_concurrency=128,
            scheduling_strategy=on_node(ray, node_id),
        )
        .remote()
    )
    try:
        await actor.ping.remote()
        yield actor
    finally:
        ray.kill(actor)


async def call_rows(
    label: str, inner: dict[str, Any], node: Any, n: int, creates: int
) -> tuple[list[Row], Series]:
    """exec, 1 KiB write+read and create-to-ready through a ray sandbox on ``node`` (a
    ``LocalCluster`` node) vs ``inner`` opened locally, interleaved; and a no-op Ray actor
    call on the same node (the floor), interleaved with them."""
    remote_config = ray_config(inner, node=node.address)
    small = os.urandom(KiB)
    async with (
        open_runtime(remote_config) as remote,
        open_runtime(inner) as local,
        echo_actor(node.node_id) as echo,
    ):
        series = await interleaved_measures(
            {
                "ray no-op": _timing(lambda: echo.ping.remote()),
                "ray exec": _timing(lambda: _exec(remote)),
                "local exec": _timing(lambda: _exec(local)),
                "ray files": _timing(lambda: _write_read(remote, small)),
                "local files": _timing(lambda: _write_read(local, small)),
            },
            n,
            shuffle=True,
        )
    created = await interleaved_measures(
        {
            "ray": lambda: _create_to_ready(remote_config),
            "local": lambda: _create_to_ready(inner),
        },
        creates,
        warmup=1,
        shuffle=True,
    )
    pairs = [  # (measure, calls in it, ray, local)
        ("exec(['true'])", 1, series["ray exec"], series["local exec"]),
        ("write+read 1 KiB", 2, series["ray files"], series["local files"]),
        ("create-to-ready (start())", 1, created["ray"], created["local"]),
    ]
    rows = []
    for measure, calls, ours, base in pairs:
        added = (ours.median_ms - base.median_ms) / calls
        per = " per call" if calls > 1 else ""
        rows.append(
            Row(
                f"ray on n1, {label}: {measure}",
                ours,
                f"local {label}",
                base,
                f"<= +{ADDED_TARGET_MS:g} ms{per} (+{ms(added)}{per})",
                added <= ADDED_TARGET_MS,
            )
        )
    return rows, series["ray no-op"]


# ---------------------------------------------------------------------- rollouts


async def rollouts_per_second(
    config: dict[str, Any], count: int, concurrency: int
) -> tuple[float, int]:
    """Rollouts/s of ``run_rollouts`` of ``count`` scripted bash rollouts on sandboxes of
    ``config`` (the factory's entry and exit not timed), and how many failed."""
    from harnesses.base import Budget
    from harnesses.session import AgentSessionFactory
    from harnesses.trainer import run_rollouts

    from .trainers import CALLS, CHECK, TASK, ScriptedGenerate

    budget = Budget(max_turns=CALLS + 2)
    async with AgentSessionFactory(config, {"id": "bash"}, verify=CHECK, budget=budget) as factory:
        started = time.perf_counter()
        results = await run_rollouts(
            factory,
            [(f"bench-ray-{i}", TASK) for i in range(count)],
            ScriptedGenerate(),
            concurrency=concurrency,
        )
        elapsed = time.perf_counter() - started
    failed = sum(1 for r in results if not (r.ok and r.verification and r.verification.reward))
    await drain_removals()
    return count / elapsed, failed


def _cpu_ticks(pids: list[int]) -> dict[int, int]:
    ticks = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


async def idle_cpu(cluster: Any, seconds: float = IDLE_SECONDS) -> float:
    """The share of one core the cluster's processes use while no sandbox runs (the
    processes alive at both ends of the window)."""
    before = await anyio.to_thread.run_sync(lambda: _cpu_ticks(cluster.all_pids()))
    await anyio.sleep(seconds)
    after = await anyio.to_thread.run_sync(lambda: _cpu_ticks(list(before)))
    used = sum(after[pid] - before[pid] for pid in after)
    return used / os.sysconf("SC_CLK_TCK") / seconds


async def scaling_table(cluster: Any, count: int) -> str:
    """Rollouts/s on 1 .. ``NODES`` nodes (a node added per step) vs local, same concurrency."""
    rows: list[list[str]] = []
    first = 0.0
    for nodes in range(1, NODES + 1):
        if nodes > len(cluster.nodes):
            await anyio.to_thread.run_sync(cluster.add_node)
        cpu = await idle_cpu(cluster)
        rss = await anyio.to_thread.run_sync(cluster.rss_bytes)
        concurrency = SLOTS * nodes
        remote_config = ray_config(SUBPROCESS, strategy="spread")
        await rollouts_per_second(remote_config, concurrency, concurrency)  # warms the new node
        local_a, failed_a = await rollouts_per_second(SUBPROCESS, count, concurrency)
        remote, failed = await rollouts_per_second(remote_config, count, concurrency)
        local_b, failed_b = await rollouts_per_second(SUBPROCESS, count, concurrency)
        local = (local_a + local_b) / 2
        first = first or remote
        rows.append(
            [
                str(nodes),
                str(concurrency),
                str(count),
                f"{remote:.2f}",
                ratio(remote, first),
                f"{local:.2f}",
                ratio(remote, local),
                f"{1000 / remote - 1000 / local:.0f}",
                f"{cpu * 100:.1f}",
                f"{rss / 1024 / 1024:.0f}",
                f"{failed} / {failed_a + failed_b}",
            ]
        )
    headers = [
        "worker nodes",
        "concurrency",
        "rollouts",
        "ray rollouts/s",
        "speed-up vs 1 node",
        "local rollouts/s (same concurrency)",
        "ratio (ray / local)",
        "added ms per rollout (wall)",
        "cluster idle CPU (% of a core)",
        "cluster RSS (MiB)",
        "failed (ray / local)",
    ]
    return table(headers, rows)


# ---------------------------------------------------------------------- the section


async def _docker_image_present(env: Environment) -> str | None:
    """Why the Docker rows cannot run (no image), or None."""
    import docker.errors

    try:
        await anyio.to_thread.run_sync(env.client.images.get, env.options.image)
    except docker.errors.ImageNotFound:
        return f"no image {env.options.image} (`make images`): no Docker rows"
    return None


async def ray_section(env: Environment) -> tuple[str, list[Row]]:
    """The tables of the section (markdown) and its per-call rows.

    Raises:
        ClusterError: the cluster could not be built or a node did not join (all of it is
            removed).
    """
    why = unavailable()
    if why:
        return table(["section", "not measured"], [["Ray (`benchmarks.ray`)", why]]), []
    from tests.ray.cluster import LocalCluster

    options = env.options
    creates = min(CREATES, options.n_create)
    rollouts = options.n_ray_rollouts
    cluster = LocalCluster(workers=1, slots=SLOTS)
    notes: list[str] = []
    started = time.perf_counter()
    try:
        await anyio.to_thread.run_sync(cluster.start)
        cluster.connect()
        built = time.perf_counter() - started
        node = cluster.nodes[0]
        rows, floor = await call_rows("subprocess", SUBPROCESS, node, options.n_exec, creates)
        floors = [floor]
        if (missing := await _docker_image_present(env)) is None:
            docker = {"type": "docker", "image": options.image, "creations_per_second": None}
            more, floor = await call_rows("docker", docker, node, options.n_exec, creates)
            rows += more
            floors.append(floor)
        else:
            notes.append(missing)
        scaling = await scaling_table(cluster, rollouts)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(cluster.stop)
    cores = os.cpu_count()
    text = (
        f"A local Ray cluster ({built:.0f} s to build: head in the root namespace with 0 CPUs, "
        f"each worker node a network namespace of its own with {SLOTS} `vf_sandbox` slots; "
        "`tests.ray.cluster.LocalCluster`), this process the driver (`benchmarks.ray`). "
        f"Per call (n={options.n_exec} for exec and files, {creates} creations; interleaved, a "
        "new order every round): a ray sandbox pinned to worker node n1 "
        "(`{'type': 'ray', 'runtime': inner, 'node': <n1's address>}`) vs the same inner "
        "runtime opened locally; the target is the issue's: at most 2 ms added per call at the "
        "median (write+read is two calls). Create-to-ready times `start()` returning (the ray "
        "sandbox's actor placed and its worker process started, the inner sandbox started on "
        "the node); `close()` is not timed. The floor: a no-op method of an actor on n1 with "
        "a sandbox actor's options (no CPU, one slot, threaded), `await actor.ping.remote()`, "
        "interleaved with the rows above: median "
        + " and ".join(f"{ms(f.median_ms)} ms (p90 {ms(f.percentile_ms(0.9))})" for f in floors)
        + " in the subprocess and docker rounds, what any call through Ray costs here.\n\n"
        + rows_table(rows, tail=0.9)
    )
    text += (
        f"\n\nRollouts: `run_rollouts` of {rollouts} rollouts (the bash harness, the scripted "
        "policy and check of `benchmarks.trainers`: 4 `bash` tool calls, then a "
        f"`CommandCheck`), {SLOTS} at a time per worker node, on ray sandboxes "
        "(`strategy='spread'`, no pinning) on 1, 2, then 3 nodes (one added with `add_node()` "
        "after each count was measured; one untimed wave first, to warm the new node), vs the "
        "same rollouts on local subprocess sandboxes at the same concurrency, run just before "
        "and just after (their mean). `added ms per "
        "rollout` is 1/rate(ray) - 1/rate(local). Idle CPU: the cluster's processes over "
        f"{IDLE_SECONDS:g} s with no sandbox, before the runs; RSS: theirs, summed. Every node "
        f"shares this machine's {cores} cores with the driver, so the rate is bounded by the "
        "CPU, not by the node count: read the speed-up and the per-node idle cost together. "
        "A ray sandbox's start is an actor's, in a worker process of its own that the node's "
        "raylet starts; a raylet starts at most `num_cpus` (here 1) worker processes at once "
        "(Ray's `maximum_startup_concurrency`), so one node serialises its sandboxes' starts "
        "and each added node adds one more start in parallel.\n\n" + scaling
    )
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text, rows


__all__ = [
    "Echo",
    "call_rows",
    "echo_actor",
    "idle_cpu",
    "ray_config",
    "ray_section",
    "rollouts_per_second",
    "scaling_table",
    "unavailable",
]
