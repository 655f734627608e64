"""Every node of a Ray cluster at once: the ``ray`` backend's listing, its sweep and the
doctor's report of the cluster.

A ray sandbox's own sandbox (a process tree, a Docker container) lives on its node and was
created there by the sandbox's actor, so its creator labels name a process *of that node*.
What ``vf-sandbox ls`` and ``cleanup`` do for ``ray`` therefore runs on the nodes: one Ray
task pinned to each alive node (no CPU of its own) runs the node-local listing of every
other backend that lists sandboxes, and keeps what a ray actor made there (the sandboxes
carrying :data:`~runtimes.ray.placement.DRIVER`). Each comes back as a ``ray`` row whose id
is ``NODE_ID/BACKEND/ID`` and whose labels add the node (:data:`NODE`,
:data:`NODE_ADDRESS`) and the inner backend (:data:`INNER_BACKEND`). A backend whose SDK is
missing or whose service does not answer on a node is skipped there with a note.

The sweep's decision is made on the node too (:func:`sweep_cluster`): the creator's pid is
the node's, and a dead driver's actors are dead there. The driver keeps its own sandboxes
(those whose :data:`~runtimes.ray.placement.DRIVER` is this process) as any sweep keeps the
current session's.

Nodes that share a filesystem or a Docker engine (several nodes on one machine) see the same
sandbox: it is listed once, on the first node that saw it (the node it lives on when its
labels carry :data:`NODE`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from types import ModuleType
from typing import Any

import anyio

from ..cleanup import Sweep, SweepResult, lists_sandboxes
from ..config import RuntimeConfig
from ..errors import SandboxError, SandboxInvalidArgumentError, SandboxUnavailableError
from ..models import SandboxInfo
from ..ownership import CREATOR_ID, KEEP, LABEL_PREFIX, PID, creator_is_dead, is_kept
from ..registry import available_runtimes, load_runtime_class
from ..snapshot import SandboxSnapshot
from . import calls
from .config import SLOT_RESOURCE, RayConfig
from .placement import DRIVER, NODE, alive_nodes, on_node, ray_snapshot

__all__ = [
    "INNER_BACKEND",
    "NODE_ADDRESS",
    "RAY_KEEP",
    "SESSION",
    "ClusterNode",
    "NodeListing",
    "NodeSnapshots",
    "cluster_nodes",
    "describe_nodes",
    "destroy_cluster_sandbox",
    "inner_info",
    "list_cluster_sandboxes",
    "list_cluster_snapshots",
    "list_here",
    "list_snapshots_here",
    "merged",
    "ray_row",
    "sweep_cluster",
    "sweep_here",
    "where",
]

log = logging.getLogger("runtimes.ray")

NODE_ADDRESS = LABEL_PREFIX + "ray-node-address"
"""On a listed ray sandbox: the IP address of its node."""
INNER_BACKEND = LABEL_PREFIX + "ray-backend"
"""On a listed ray sandbox: the backend of its own sandbox on the node (``subprocess``, ...)."""
RAY_KEEP = LABEL_PREFIX + "ray-keep"
"""On a ray snapshot's own snapshot (which its node keeps, ``keep=True``): whether the ray
snapshot was taken with ``keep`` (``"true"``/``"false"``); a sweep judges the ray snapshot by
it."""
SESSION = LABEL_PREFIX + "ray-session"
"""On a listed ray sandbox: its creator as its node judged it (``alive``, ``dead`` or
``unknown``), what ``vf-sandbox ls`` shows as its session."""

BACKEND_TIMEOUT = 30.0
"""Seconds one backend's listing may take on a node before it is skipped there."""
NODE_TIMEOUT = 120.0
"""Seconds a node may take to list (or sweep) all its backends before it is reported as not
answering."""

_ADDED = (NODE, NODE_ADDRESS, INNER_BACKEND, SESSION)


@dataclass(frozen=True)
class NodeListing:
    """What one node found: the sandboxes a ray actor made there, and the backends it skipped."""

    node_id: str
    address: str
    found: list[SandboxInfo] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    claimed: set[tuple[str, str]] = field(default_factory=set)
    """The ``(backend, id)`` of the sandboxes whose creator is a live process of this node."""


@dataclass(frozen=True)
class ClusterNode:
    """One node as the doctor reports it: ``slots_free`` is ``None`` when Ray did not say."""

    node_id: str
    address: str
    alive: bool
    slots_total: float
    slots_free: float | None


# ---------------------------------------------------------------------- on a node


async def _list_backends(snapshots: bool = False) -> tuple[list[Any], list[str]]:
    """What a ray actor made here (its sandboxes, or with ``snapshots`` its snapshots) as each
    other backend lists it, and a note for each backend that could not say."""
    found: list[Any] = []
    notes: list[str] = []
    for name in available_runtimes():
        if name == "ray":
            continue
        try:
            cls = load_runtime_class(name)
        except SandboxError as exc:
            notes.append(f"{name}: not loaded ({type(exc).__name__}: {exc})")
            continue
        if not snapshots and not lists_sandboxes(cls):
            continue
        try:
            with anyio.fail_after(BACKEND_TIMEOUT):
                listed: Sequence[Any] = await (
                    cls.list_snapshots(None) if snapshots else cls.list_sandboxes(None)
                )
        except (SandboxError, TimeoutError) as exc:
            notes.append(f"{name}: not listed ({type(exc).__name__}: {exc})")
            continue
        found += [info for info in listed if DRIVER in info.labels]
    return found, notes


def list_here() -> NodeListing:
    """The task each node runs: every sandbox a ray actor made on this node, as its own
    backend lists it (this node's default config of each backend)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    found, notes = anyio.run(_list_backends)
    mine = [_judged(info) for info in found if info.labels.get(NODE, node_id) == node_id]
    address = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    claimed = {(info.backend, info.id) for info in mine if _created_here(info.labels)}
    return NodeListing(node_id, address, mine, notes, claimed)


@dataclass(frozen=True)
class NodeSnapshots:
    """The snapshots a ray actor took on one node (its sandboxes' own snapshots)."""

    node_id: str
    address: str
    found: list[SandboxSnapshot] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def list_snapshots_here() -> NodeSnapshots:
    """The task each node runs for ``ls``/``cleanup``'s snapshots: every snapshot a ray
    actor took on this node, as its own backend lists it."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    found, notes = anyio.run(partial(_list_backends, snapshots=True))
    mine = [snap for snap in found if snap.labels.get(NODE, node_id) == node_id]
    address = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    return NodeSnapshots(node_id, address, mine, notes)


def _judged(info: SandboxInfo) -> SandboxInfo:
    """``info`` with :data:`SESSION`: its creator judged here, where its pid means something."""
    dead = creator_is_dead(info.labels)
    session = {True: "dead", False: "alive", None: "unknown"}[dead]
    return replace(info, labels={**info.labels, SESSION: session})


def _created_here(labels: Mapping[str, str]) -> bool:
    """Whether the sandbox's creator (its actor) is a live process of this node: its pid, with
    its start time, in this process's network namespace (nodes that share one machine, and so
    one filesystem or Docker engine, differ there)."""
    if creator_is_dead(labels) is not False:
        return False
    try:
        theirs = os.readlink(f"/proc/{int(labels.get(PID, ''))}/ns/net")
        return theirs == os.readlink("/proc/self/ns/net")
    except (OSError, ValueError):
        return False


async def _sweep_rows(rows: Sequence[SandboxInfo], sweep: Sweep) -> list[SweepResult]:
    results: list[SweepResult] = []
    for row in rows:
        inner = inner_info(row)
        try:
            cls = load_runtime_class(inner.backend)
        except SandboxError as exc:
            results.append(SweepResult(row, "failed", f"{inner.backend} not loaded here: {exc}"))
            continue
        remove = partial(cls.destroy_sandbox, inner, None)
        swept = await sweep.one(inner, remove)
        results += [replace(result, info=row) for result in swept]
    return results


def sweep_here(rows: list[SandboxInfo], sweep: Sweep) -> list[SweepResult]:
    """The task each node runs for a sweep: ``sweep``'s rules applied here to ``rows`` (ray
    rows this node listed), each removed here by its own backend."""
    return anyio.run(_sweep_rows, rows, sweep)


def _destroy_here(row: SandboxInfo) -> None:
    inner = inner_info(row)
    anyio.run(load_runtime_class(inner.backend).destroy_sandbox, inner, None)


# ---------------------------------------------------------------------- rows


def ray_row(inner: SandboxInfo, node_id: str, address: str) -> SandboxInfo:
    """The ray row standing for ``inner``, a sandbox listed on node ``node_id``."""
    return SandboxInfo(
        backend="ray",
        id=f"{node_id}/{inner.backend}/{inner.id}",
        labels={
            **inner.labels,
            NODE: node_id,
            NODE_ADDRESS: address,
            INNER_BACKEND: inner.backend,
        },
        state=inner.state,
        created=inner.created,
    )


def inner_info(row: SandboxInfo) -> SandboxInfo:
    """The node-side sandbox a ray row stands for.

    Raises:
        SandboxInvalidArgumentError: ``row`` is not a ray row (``NODE_ID/BACKEND/ID``).
    """
    node_id, _, rest = row.id.partition("/")
    backend, _, inner_id = rest.partition("/")
    if row.backend != "ray" or not (node_id and backend and inner_id):
        raise SandboxInvalidArgumentError(f"{row.id!r} is not a ray sandbox (NODE/BACKEND/ID)")
    labels = {k: v for k, v in row.labels.items() if k not in _ADDED}
    return SandboxInfo(backend, inner_id, labels, row.state, row.created)


def _node_of(row: SandboxInfo) -> str:
    return row.id.partition("/")[0]


# ---------------------------------------------------------------------- the driver's side


def where(config: RuntimeConfig | Mapping[str, Any] | None) -> tuple[str | None, str | None]:
    """The cluster address and namespace a config (or a config's fields) names."""
    if isinstance(config, RayConfig):
        return config.address, config.namespace
    if isinstance(config, Mapping):
        return config.get("address"), config.get("namespace")
    return None, None


async def _connect(config: RuntimeConfig | Mapping[str, Any] | None) -> ModuleType:
    """Ray, connected to the config's cluster (its ``address``, else ``"auto"``). Without a
    config (``ls``/``cleanup``/``doctor`` of the bare ``ray`` backend): the cluster this
    process joined, else ``RAY_ADDRESS``; never a guess at the clusters running here.

    Raises:
        SandboxTransportError: the cluster cannot be reached.
        SandboxUnavailableError: no config, no ``RAY_ADDRESS``, and Ray not initialised.
    """
    if config is None and not os.environ.get("RAY_ADDRESS"):
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            raise SandboxUnavailableError(
                "no Ray cluster named: set RAY_ADDRESS, or pass "
                """--runtime '{"type": "ray", "runtime": {...}, "address": "HOST:PORT"}'"""
            )
    address, namespace = where(config)
    return await anyio.to_thread.run_sync(calls.connect, address, namespace)


async def _on_each_node(
    ray: ModuleType, fn: Any, args_of: dict[str, tuple[Any, ...]], what: str
) -> dict[str, Any]:
    """``fn(*args)`` as a task pinned to each node of ``args_of`` (no CPU of its own), all at
    once; each node's value, or the typed error it ended with."""
    task = ray.remote(fn)
    refs = {
        node_id: task.options(
            num_cpus=0, max_retries=0, scheduling_strategy=on_node(ray, node_id)
        ).remote(*args)
        for node_id, args in args_of.items()
    }
    answers: dict[str, Any] = {}

    async def settle(node_id: str, ref: Any) -> None:
        try:
            with anyio.fail_after(NODE_TIMEOUT):
                answers[node_id] = await calls.settle(ref, f"{what} on node {node_id}")
        except TimeoutError:
            ray.cancel(ref, force=True)
            answers[node_id] = SandboxUnavailableError(
                f"{what}: node {node_id} did not answer within {NODE_TIMEOUT:g} s"
            )
        except SandboxError as exc:
            answers[node_id] = exc

    async with anyio.create_task_group() as tg:
        for node_id, ref in refs.items():
            tg.start_soon(settle, node_id, ref)
    return answers


async def _listings(ray: ModuleType) -> list[NodeListing]:
    nodes = alive_nodes(ray)
    answers = await _on_each_node(
        ray, list_here, {str(n["NodeID"]): () for n in nodes}, "listing sandboxes"
    )
    listings: list[NodeListing] = []
    for node in nodes:
        node_id = str(node["NodeID"])
        answer = answers[node_id]
        if isinstance(answer, NodeListing):
            listings.append(answer)
            continue
        note = f"not listed ({type(answer).__name__}: {answer})"
        listings.append(NodeListing(node_id, str(node.get("NodeManagerAddress", "")), [], [note]))
    return listings


def merged(listings: Sequence[NodeListing]) -> list[SandboxInfo]:
    """The ray rows of every node; a sandbox several nodes see (one filesystem or Docker
    engine for several nodes) once, on the node whose process created it if one says so,
    else on the first that saw it."""
    owner: dict[tuple[str, str], str] = {}
    for listing in listings:
        for key in listing.claimed:
            owner.setdefault(key, listing.node_id)
    rows: list[SandboxInfo] = []
    for listing in listings:
        for note in listing.notes:
            log.info("ray node %s (%s): %s", listing.address, listing.node_id, note)
        for inner in listing.found:
            key = (inner.backend, inner.id)
            if owner.setdefault(key, listing.node_id) != listing.node_id:
                continue
            owner[key] = ""  # listed: not again from another node
            rows.append(ray_row(inner, listing.node_id, listing.address))
    return rows


async def list_cluster_sandboxes(config: RuntimeConfig | None) -> list[SandboxInfo]:
    """Every sandbox a ray actor made on any alive node of the config's cluster, as ray rows
    (``NODE_ID/BACKEND/ID``, labelled with the node): ``RayRuntime.list_sandboxes``.

    ``config`` ``None`` (the bare ``ray`` backend) is the cluster this process joined, else
    ``RAY_ADDRESS``'s.

    Raises:
        SandboxTransportError: the cluster cannot be reached.
        SandboxUnavailableError: ``config`` is ``None``, ``RAY_ADDRESS`` is unset and this
            process has not joined a cluster.
    """
    ray = await _connect(config)
    return merged(await _listings(ray))


async def destroy_cluster_sandbox(info: SandboxInfo, config: RuntimeConfig | None) -> None:
    """Remove one ray row on its node, by its own backend: ``RayRuntime.destroy_sandbox``.

    Raises:
        SandboxInvalidArgumentError: ``info`` is not a ray row.
        SandboxUnavailableError: its node is not alive (or died while removing it), or no
            cluster is named (see :func:`list_cluster_sandboxes`).
        SandboxTransportError: the cluster cannot be reached.
        SandboxError: its backend could not remove it.
    """
    inner_info(info)
    ray = await _connect(config)
    node_id = _node_of(info)
    if not any(str(row.get("NodeID")) == node_id for row in alive_nodes(ray)):
        raise SandboxUnavailableError(f"ray sandbox {info.id}: its node is not alive")
    task = ray.remote(_destroy_here).options(
        num_cpus=0, max_retries=0, scheduling_strategy=on_node(ray, node_id)
    )
    await calls.settle(task.remote(info), f"removing ray sandbox {info.id}")


async def sweep_cluster(config: RuntimeConfig | None, sweep: Sweep) -> list[SweepResult]:
    """``sweep`` over every alive node of the config's cluster, each node judging and removing
    its own sandboxes (its rows' creators are its processes): ``RayRuntime.sweep_sandboxes``.

    This process's own ray sandboxes (its :data:`~runtimes.ray.placement.DRIVER`) are kept
    unless ``sweep.all_sessions`` or they are kept ones. A node that does not answer fails
    its rows.

    Raises:
        SandboxTransportError: the cluster cannot be reached.
        SandboxUnavailableError: no cluster named (see :func:`list_cluster_sandboxes`).
    """
    ray = await _connect(config)
    rows = merged(await _listings(ray))
    results: list[SweepResult] = []
    by_node: dict[str, list[SandboxInfo]] = {}
    for row in rows:
        if not sweep.matches(row.labels):
            continue
        own = row.labels.get(DRIVER) == CREATOR_ID
        if own and not sweep.all_sessions and not is_kept(row.labels):
            results.append(SweepResult(row, "kept", "session is alive (this driver's)"))
            continue
        by_node.setdefault(_node_of(row), []).append(row)
    answers = await _on_each_node(
        ray,
        sweep_here,
        {node_id: (node_rows, sweep) for node_id, node_rows in by_node.items()},
        "sweeping sandboxes",
    )
    for node_id, node_rows in by_node.items():
        answer = answers[node_id]
        if isinstance(answer, BaseException):
            results += [SweepResult(row, "failed", f"{answer}") for row in node_rows]
            continue
        results += [_on_node(result) for result in answer]
    return results


async def list_cluster_snapshots(config: RuntimeConfig | None) -> list[SandboxSnapshot]:
    """Every snapshot a ray actor took on any alive node, as the ray snapshots standing for
    them (labelled with the node): ``RayRuntime.list_snapshots``. Their creator is the driver
    that asked for them (its labels), so a sweep judges them where it runs, like any other
    snapshot; one several nodes see (a shared filesystem or Docker engine) is listed once.

    The node keeps its own snapshot (``keep=True``) for the ray snapshot's life: the ray
    snapshot's ``keep`` is its :data:`RAY_KEEP` label (kept, when that label is missing). One
    whose labels name its node (:data:`~runtimes.ray.placement.NODE`) is listed there only.

    Raises:
        SandboxTransportError: the cluster cannot be reached.
        SandboxUnavailableError: no cluster named (see :func:`list_cluster_sandboxes`).
    """
    ray = await _connect(config)
    nodes = alive_nodes(ray)
    answers = await _on_each_node(
        ray, list_snapshots_here, {str(n["NodeID"]): () for n in nodes}, "listing snapshots"
    )
    snapshots: list[SandboxSnapshot] = []
    seen: set[tuple[str, str]] = set()
    for node_id, answer in answers.items():
        if not isinstance(answer, NodeSnapshots):
            log.info("ray node %s: snapshots not listed (%s)", node_id, answer)
            continue
        for note in answer.notes:
            log.info("ray node %s (%s): %s", answer.address, node_id, note)
        for inner in answer.found:
            if (inner.backend, inner.id) in seen:
                continue
            seen.add((inner.backend, inner.id))
            labels = {NODE_ADDRESS: answer.address, KEEP: inner.labels.get(RAY_KEEP, "true")}
            snapshots.append(ray_snapshot(inner, node_id, labels))
    return snapshots


def _on_node(result: SweepResult) -> SweepResult:
    address = result.info.labels.get(NODE_ADDRESS) or _node_of(result.info)
    return replace(result, reason=f"{result.reason} (node {address})")


async def cluster_nodes(config: RuntimeConfig | Mapping[str, Any] | None) -> list[ClusterNode]:
    """The nodes of the config's cluster (a config, or its ``address``/``namespace`` fields),
    dead ones included, with their ``vf_sandbox`` slots: what ``vf-sandbox doctor`` reports.

    Raises:
        SandboxTransportError: the cluster cannot be reached.
        SandboxUnavailableError: no cluster named (see :func:`list_cluster_sandboxes`).
    """
    ray = await _connect(config)
    free = _free_slots(ray)
    nodes: list[ClusterNode] = []
    for row in ray.nodes():
        node_id = str(row.get("NodeID", ""))
        alive = bool(row.get("Alive"))
        total = float((row.get("Resources") or {}).get(SLOT_RESOURCE, 0.0))
        nodes.append(
            ClusterNode(
                node_id=node_id,
                address=str(row.get("NodeManagerAddress", "")),
                alive=alive,
                slots_total=total,
                slots_free=free.get(node_id, 0.0 if total == 0 else None) if alive else None,
            )
        )
    return nodes


def _free_slots(ray: ModuleType) -> dict[str, float]:
    """Each alive node's free ``vf_sandbox`` slots, from Ray's per-node view (an API Ray
    keeps internal: empty when this Ray lacks it)."""
    try:
        from ray._private import state

        per_node = state.available_resources_per_node()  # type: ignore[no-untyped-call]
    except (ImportError, AttributeError, RuntimeError) as exc:
        log.info("free slots per node unknown: %s", exc)
        return {}
    return {str(node): float(res.get(SLOT_RESOURCE, 0.0)) for node, res in per_node.items()}


def describe_nodes(nodes: Sequence[ClusterNode]) -> str:
    """One line for the doctor: how many nodes are alive and dead, then each node's address
    and its free/total ``vf_sandbox`` slots."""
    alive = sum(node.alive for node in nodes)
    each = []
    for node in nodes:
        if not node.alive:
            each.append(f"{node.address} dead")
            continue
        free = "?" if node.slots_free is None else f"{node.slots_free:g}"
        each.append(f"{node.address} {free}/{node.slots_total:g} slots free")
    return f"{alive} nodes alive, {len(nodes) - alive} dead: " + ", ".join(each)
