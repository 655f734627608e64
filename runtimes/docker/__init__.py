"""The ``docker`` runtime: one container per sandbox, driven through the Engine API.

The package: :mod:`.config` (:class:`DockerConfig`), :mod:`.client` (engine access: one
call in a worker thread, retried), :mod:`.sdk_errors` (the one table reading the SDK's
exceptions as typed errors), :mod:`.container` (making or finding the container; listing
and removing them on an engine), :mod:`.stream` (the hijacked exec connection and the
engine's frame demultiplexer), :mod:`.process` (one command: the wrapper's report, output,
errors and kills), :mod:`.files` (the archive API), :mod:`.fastpath` (the backend's files
through it), :mod:`.agent` (the channel agent's transport and trust checks), :mod:`.network`
(host routes), :mod:`.ports` (published ports), :mod:`.mounts` (bind mounts and volumes),
:mod:`.pull` (the pull policy), :mod:`.build_context` and :mod:`.build` (the ``build``
option: its context read on the host, the build on the engine), :mod:`.snapshots`
(commits, forks' images, listing and removing them), ``scripts/`` (the shell programs)
and :mod:`.runtime` (:class:`DockerBackend`, which composes them, and :class:`DockerRuntime`,
the runtime over it).
"""

from .build_context import BuildSpec
from .config import DEFAULT_IMAGE, DockerConfig
from .mounts import MountSpec
from .network import gateway_from_route_table
from .ports import PortSpec
from .runtime import DockerBackend, DockerRuntime

__all__ = [
    "DEFAULT_IMAGE",
    "BuildSpec",
    "DockerBackend",
    "DockerConfig",
    "DockerRuntime",
    "MountSpec",
    "PortSpec",
    "gateway_from_route_table",
]
