"""The ``ray`` runtime: a sandbox of any other runtime type on a node of a Ray cluster.

:class:`RayRuntime` (the driver's side) forwards the whole Runtime API to a Ray actor,
:class:`~runtimes.ray.host.SandboxHost`, on the node Ray's scheduler chose (or the one the
config pins), which owns the sandbox's own runtime and its host side. The package:
:mod:`.config` (:class:`RayConfig`), :mod:`.calls` (the boundary to Ray: connecting, awaiting,
the error table, the liveness probe), :mod:`.placement` (the actor's options, nodes, snapshots
on a node), :mod:`.host` (the actor) and :mod:`.runtime`. Ray itself is imported only when a
ray sandbox starts. ``docs/ray.md`` is the guide.
"""

from .config import SLOT_RESOURCE, RayConfig
from .runtime import RayRuntime

__all__ = ["SLOT_RESOURCE", "RayConfig", "RayRuntime"]
