"""Where a ray sandbox goes: the actor's options (its slot resources, the node it is pinned
to, spread or pack), the nodes of the cluster, and the snapshots that live on one node."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import anyio

from ..config import RuntimeConfig
from ..errors import ProvisioningError, SandboxUnavailableError
from ..ownership import LABEL_PREFIX
from ..registry import load_runtime_class
from ..snapshot import SandboxSnapshot
from . import calls
from .config import RayConfig

__all__ = [
    "CALLS_AT_ONCE",
    "DRIVER",
    "INNER_SNAPSHOT",
    "JOB",
    "NODE",
    "actor_options",
    "alive_nodes",
    "destroy_snapshot_on_node",
    "inner_snapshot",
    "node_id_of",
    "on_node",
    "ray_snapshot",
]

CALLS_AT_ONCE = 128
"""Calls a sandbox's actor serves at once (its thread pool): each command waiting for output,
each incremental stdin and each file call holds one while it runs."""

DRIVER = LABEL_PREFIX + "ray-driver"
"""On a ray sandbox's own sandbox: the session id (:data:`runtimes.ownership.CREATOR_ID`) of the
driver that asked for it."""
JOB = LABEL_PREFIX + "ray-job"
"""On a ray sandbox's own sandbox: the Ray job id of that driver."""
NODE = LABEL_PREFIX + "ray-node"
"""The id of the Ray node a snapshot lives on."""
INNER_SNAPSHOT = LABEL_PREFIX + "ray-snapshot"
"""The node-side snapshot (its JSON) a ray snapshot stands for."""


def alive_nodes(ray: ModuleType) -> list[dict[str, Any]]:
    """The cluster's nodes that are alive (``ray.nodes()`` rows)."""
    return [node for node in ray.nodes() if node.get("Alive")]


def node_id_of(ray: ModuleType, node: str) -> str:
    """The id of the alive node named by its id or its IP address.

    Raises:
        ProvisioningError: no alive node is called that.
    """
    for row in alive_nodes(ray):
        if node in (row.get("NodeID"), row.get("NodeManagerAddress")):
            return str(row["NodeID"])
    raise ProvisioningError(f"no alive Ray node has the id or address {node!r}")


def on_node(ray: ModuleType, node_id: str) -> Any:
    """The scheduling strategy that runs on that node and nowhere else."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)


def actor_options(
    ray: ModuleType, config: RayConfig, source: SandboxSnapshot | None
) -> dict[str, Any]:
    """The sandbox actor's options: no CPU of its own, the config's slot resources, never
    restarted (a sandbox that died is gone), on the snapshot's node for a fork, else on the
    config's ``node``, else where Ray's scheduler puts it (``spread``: Ray's SPREAD)."""
    options: dict[str, Any] = {
        "num_cpus": 0,
        "resources": dict(config.resources),
        "max_restarts": 0,
        "max_task_retries": 0,
        "max_concurrency": CALLS_AT_ONCE,
        "namespace": config.namespace,
    }
    node = source.labels.get(NODE) if source is not None else config.node
    if node:
        options["scheduling_strategy"] = on_node(ray, node_id_of(ray, node))
    elif config.strategy == "spread":
        options["scheduling_strategy"] = "SPREAD"
    return {k: v for k, v in options.items() if v is not None}


def ray_snapshot(inner: SandboxSnapshot, node_id: str, labels: dict[str, str]) -> SandboxSnapshot:
    """The ray snapshot standing for ``inner``, a snapshot on node ``node_id``."""
    return SandboxSnapshot(
        backend="ray",
        id=f"{node_id}/{inner.backend}/{inner.id}",
        created=inner.created,
        labels={
            **inner.labels,
            **labels,
            NODE: node_id,
            INNER_SNAPSHOT: inner.model_dump_json(),
        },
        source=inner.source,
        holds=inner.holds,
        workdir=inner.workdir,
        policy_user=inner.policy_user,
        untrusted=inner.untrusted,
        python=inner.python,
    )


def inner_snapshot(snapshot: SandboxSnapshot) -> SandboxSnapshot:
    """The node-side snapshot a ray snapshot stands for."""
    return SandboxSnapshot.model_validate_json(snapshot.labels[INNER_SNAPSHOT])


def _destroy_inner(inner_json: str) -> None:
    inner = SandboxSnapshot.model_validate_json(inner_json)
    anyio.run(load_runtime_class(inner.backend).destroy_snapshot, inner, None)


async def destroy_snapshot_on_node(snapshot: SandboxSnapshot, config: RuntimeConfig | None) -> None:
    """Remove a ray snapshot on its node (a node that is gone took it along).

    Raises:
        SandboxTransportError: the cluster could not be reached.
    """
    address = config.address if isinstance(config, RayConfig) else None
    namespace = config.namespace if isinstance(config, RayConfig) else None
    ray = await anyio.to_thread.run_sync(calls.connect, address, namespace)
    node_id = snapshot.labels.get(NODE, "")
    if not any(row.get("NodeID") == node_id for row in alive_nodes(ray)):
        return
    task = ray.remote(_destroy_inner).options(num_cpus=0, scheduling_strategy=on_node(ray, node_id))
    try:
        await calls.settle(task.remote(snapshot.labels[INNER_SNAPSHOT]), "destroy snapshot")
    except SandboxUnavailableError:
        return
