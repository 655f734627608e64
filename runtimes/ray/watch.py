"""The driver's watch on the cluster's nodes: which nodes the cluster lists dead, refreshed
every :data:`INTERVAL` seconds by one daemon thread while any ray sandbox of this process is
open (:data:`NODES`).

It is what lets a ray sandbox say it is lost without asking its node
(:attr:`~runtimes.ray.runtime.RayRuntime.lost`): a pool does not hand out stock on a dead
node, and a call to a sandbox on one fails at once instead of after a probe. It only ever
learns of deaths; a sandbox on a node it has not yet seen die is found out by its calls, as
before (:mod:`runtimes.ray.calls`).
"""

from __future__ import annotations

import logging
import threading

from . import calls

__all__ = ["INTERVAL", "NODES", "NodeWatch"]

log = logging.getLogger("runtimes.ray")

INTERVAL = 1.0
"""Seconds between two listings of the cluster's nodes (one GCS call each)."""


class NodeWatch:
    """The nodes the cluster lists dead, as last seen. :meth:`hold` while a sandbox is open,
    :meth:`release` when it closes: the thread runs while anything is held."""

    def __init__(self, interval: float = INTERVAL) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._dead: set[str] = set()
        self._holders = 0
        self._wake: threading.Event | None = None
        """Set to stop the running thread (each thread has its own)."""

    def dead(self, node_id: str) -> bool:
        """Whether the cluster listed ``node_id`` dead (free: no call is made)."""
        return node_id in self._dead

    def hold(self) -> None:
        with self._lock:
            self._holders += 1
            if self._wake is None:
                self._wake = threading.Event()
                threading.Thread(
                    target=self._run, args=(self._wake,), name="vf-sandbox-ray-nodes", daemon=True
                ).start()

    def release(self) -> None:
        with self._lock:
            self._holders = max(0, self._holders - 1)
            if self._holders == 0 and self._wake is not None:
                self._wake.set()
                self._wake = None

    def refresh(self) -> None:
        """List the nodes now; a cluster that cannot be reached leaves what was known."""
        try:
            nodes = calls.ray_module().nodes()
        except Exception as exc:  # noqa: BLE001 - the calls themselves report the cluster
            log.debug("listing the cluster's nodes failed: %s", exc)
            return
        dead = {str(n.get("NodeID")) for n in nodes if not n.get("Alive")}
        self._dead = self._dead | dead  # a dead node never comes back under its id

    def _run(self, wake: threading.Event) -> None:
        while not wake.is_set():
            self.refresh()
            wake.wait(self.interval)


NODES = NodeWatch()
"""This process's watch, shared by its ray sandboxes."""
