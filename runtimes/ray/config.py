"""The ``ray`` runtime's config: which runtime the sandbox is, and where on the cluster it lives."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from ..config import RuntimeConfig

SLOT_RESOURCE = "vf_sandbox"
"""The Ray custom resource one sandbox takes by default: a node offers as many as it has room
for (``ray start --resources='{"vf_sandbox": 8}'``), so Ray's scheduler decides where each
sandbox goes."""


class RayConfig(RuntimeConfig):
    """Config of the ``ray`` runtime (``docs/ray.md``).

    ``runtime`` is the config of the sandbox itself (any other runtime type: ``subprocess``,
    ``docker``, ...), opened by a Ray actor on the node chosen for it. The actor owns that
    runtime and its whole host side (channel, sweeps), so each call crosses the network once.

    Where: ``node`` pins the sandbox to one node (its node id, or its IP address); otherwise
    Ray's scheduler places it on a node with ``resources`` free (one ``vf_sandbox`` slot by
    default): ``strategy="spread"`` is Ray's SPREAD (round robin over the nodes with a free
    slot); ``"pack"`` and ``"default"`` are Ray's default policy, which keeps to the nodes in
    use until about half their slots are taken, then spreads.

    ``address`` is the cluster (``ray.init(address=...)``); ``None`` uses the Ray the process
    already initialised, else ``"auto"``. ``start_timeout``: seconds for a node to take the
    sandbox and start it (no free slot: :class:`~runtimes.errors.ProvisioningError`).
    ``dead_after``: seconds a node may leave a liveness probe unanswered while a call waits
    before the sandbox counts as gone (:class:`~runtimes.errors.SandboxUnavailableError`).
    ``retries``: how many times an idempotent call is retried after the cluster connection
    failed.

    The output and read caps are the driver's (this config's ``output_limit`` and
    ``read_limit``); ``env`` goes with each command, ``labels`` are added to the inner
    config's. Resource limits and ``workdir`` belong in ``runtime``.
    """

    type: Literal["ray"] = "ray"
    runtime: dict[str, Any]
    address: str | None = None
    node: str | None = None
    resources: dict[str, float] = Field(default_factory=lambda: {SLOT_RESOURCE: 1.0})
    strategy: Literal["default", "spread", "pack"] = "default"
    namespace: str | None = None
    start_timeout: float = Field(default=300.0, gt=0)
    dead_after: float = Field(default=10.0, gt=0)
    retries: int = Field(default=3, ge=0, le=10)
    cluster_reachable: bool = False
    """Allow a sandbox whose own network reaches the node's (a Docker ``network`` other than
    ``"none"``): its code could then reach the cluster's unauthenticated Ray ports. Only for
    trusted code (``docs/ray.md``, "Security")."""

    @field_validator("runtime")
    @classmethod
    def _inner_is_a_config(cls, value: dict[str, Any]) -> dict[str, Any]:
        kind = value.get("type")
        if not isinstance(kind, str) or not kind:
            raise ValueError("runtime needs a 'type' (the sandbox's own runtime, e.g. 'docker')")
        if kind == "ray":
            raise ValueError("a ray sandbox's runtime cannot itself be 'ray'")
        return value

    @model_validator(mode="after")
    def _sandbox_network_stays_off_the_cluster(self) -> RayConfig:
        network = self.runtime.get("network", "none") if self.runtime["type"] == "docker" else None
        if network not in (None, "none") and not self.cluster_reachable:
            raise ValueError(
                f"a docker sandbox with network={network!r} on a Ray node can reach the "
                "cluster's Ray ports, which have no authentication: use network='none' (the "
                "default; model access goes through the channel relay) or set "
                "cluster_reachable=true for trusted code (docs/ray.md)"
            )
        return self

    @model_validator(mode="after")
    def _belongs_to_the_inner(self) -> RayConfig:
        for field in ("workdir", "cpus", "memory", "pids_limit"):
            if getattr(self, field, None) is not None:
                raise ValueError(f"{field} belongs in the sandbox's own config ('runtime')")
        if self.keep:
            raise ValueError("keep is not supported on a ray sandbox (its actor ends with it)")
        return self

    def inner(self) -> dict[str, Any]:
        """The sandbox's own config, with this config's ``labels`` added (its ``env`` goes
        with each command)."""
        inner = dict(self.runtime)
        inner["labels"] = {**inner.get("labels", {}), **self.labels}
        return inner

    def is_local(self) -> bool:
        return False
