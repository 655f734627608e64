"""Host routes from a Docker container: which ones its network offers, its default gateway,
and whether this host owns that gateway (so a host service can listen on it)."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from ..errors import HostRouteError
from ..routes import RouteKind

if TYPE_CHECKING:
    from .config import DockerConfig


def gateway_from_route_table(text: str) -> str | None:
    """The IPv4 default gateway in the text of a Linux ``/proc/net/route``, or ``None``."""
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[1] == "00000000" and fields[2] != "00000000":
            raw = bytes.fromhex(fields[2])
            return ".".join(str(b) for b in reversed(raw))
    return None


def is_local_address(address: str) -> bool:
    """Whether ``address`` belongs to an interface of this host (it can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def host_routes(config: DockerConfig) -> tuple[RouteKind, ...]:
    """The routes to the host the container's network offers besides the channel."""
    if config.network == "host":
        return ("loopback",)  # the host's loopback as it is: no relay hop
    return () if config.network == "none" else ("gateway",)


def route_hint(config: DockerConfig) -> str:
    """What to change when no route serves."""
    if config.network == "none":
        return (
            "network='none' has only the channel route (python3 in the image, "
            "channel=True); the gateway route needs network='bridge' or a named network"
        )
    return "the channel route needs python3 in the image and channel=True"


ROUTE_TABLE = ["cat", "/proc/net/route"]
"""The command that reads a container's routes (run as the machinery: ``cwd`` ``/``, the
fixed ``PATH`` of :mod:`runtimes.machinery`)."""
GATEWAY_TIMEOUT = 30.0
"""Seconds :data:`ROUTE_TABLE` may take."""


def host_gateway(table: str | None, where: str) -> str:
    """The container's IPv4 default gateway, read from the text of its ``/proc/net/route``
    (``None``: it could not be read), if it is an address of this host (so a service can
    listen on it).

    Raises:
        HostRouteError: no default route, or the gateway is not this host's (a remote
            engine).
    """
    gateway = gateway_from_route_table(table) if table is not None else None
    if gateway is None:
        raise HostRouteError(
            f"{where} has no default gateway: no gateway route to the host", via="gateway"
        )
    if not is_local_address(gateway):
        raise HostRouteError(
            f"{where} routes through {gateway}, which is not an address of this "
            "host (a remote engine?): use the channel route",
            via="gateway",
        )
    return gateway
