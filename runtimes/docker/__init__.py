"""The ``docker`` runtime: one container per sandbox, driven through the Engine API.

The package: :mod:`.config` (:class:`DockerConfig`), :mod:`.client` (engine access),
:mod:`.container` (making or finding the container), :mod:`.stream` (the hijacked exec
connection), :mod:`.process` (one command: the wrapper's report, output and errors),
:mod:`.files` (the archive API), :mod:`.agent` (the channel agent's transport and trust
checks), :mod:`.network` (host routes), :mod:`.ports` (published ports), :mod:`.mounts`
(bind mounts and volumes), :mod:`.pull` (the pull policy), :mod:`.build_context` and
:mod:`.build` (the ``build`` option: its context read on the host, the build on the engine),
``scripts/`` (the shell programs) and
:mod:`.runtime` (:class:`DockerRuntime`).
"""

from .build_context import BuildSpec
from .config import DEFAULT_IMAGE, DockerConfig
from .mounts import MountSpec
from .network import _is_local_address as _is_local_address  # the old module's names
from .network import gateway_from_route_table as gateway_from_route_table
from .ports import PortSpec
from .runtime import DockerRuntime

__all__ = ["DEFAULT_IMAGE", "BuildSpec", "DockerConfig", "DockerRuntime", "MountSpec", "PortSpec"]
