"""Published ports of the ``docker`` runtime: the ``ports`` config entries, the engine's
port bindings made from them, and the host address the engine gave a container port.

The safe default binds the host side to ``127.0.0.1`` with a port the engine chooses, so a
service in the sandbox is reachable from this host only, and never collides with another
sandbox's; an explicit ``host_ip`` / ``host_port`` overrides either.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..errors import SandboxInvalidArgumentError

Protocol = Literal["tcp", "udp", "sctp"]

_SHORTHAND = re.compile(r"^(\d+)(?:/(tcp|udp|sctp))?$")


class PortSpec(BaseModel):
    """One published container port. In a config: ``8000``, ``"8000/udp"`` or a mapping
    ``{"container_port": 8000, "host_ip": "0.0.0.0", "host_port": 18000}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    container_port: int = Field(ge=1, le=65535)
    protocol: Protocol = "tcp"
    host_ip: str = Field(default="127.0.0.1", description="host address to bind (loopback)")
    host_port: int | None = Field(default=None, ge=1, le=65535, description="None: engine picks")

    @field_validator("host_ip")
    @classmethod
    def _ip_address(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"host_ip must be an IP address, got {value!r}") from None
        return value

    @property
    def key(self) -> str:
        """The engine's name of the container port: ``"8000/tcp"``."""
        return f"{self.container_port}/{self.protocol}"


def parse_port(value: object) -> object:
    """A ``ports`` entry in shorthand (``8000``, ``"8000/udp"``) as a :class:`PortSpec` mapping;
    anything else is left for pydantic to validate."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return {"container_port": value}
    if isinstance(value, str):
        match = _SHORTHAND.match(value.strip())
        if match is None:
            raise ValueError(f"a port is 8000, '8000/udp' or a mapping, got {value!r}")
        return {"container_port": int(match[1]), "protocol": match[2] or "tcp"}
    return value


def check_ports(ports: tuple[PortSpec, ...], network: str | None) -> None:
    """Raise ValueError (a config error on ``ports``) for ports the engine cannot publish:
    without a network, on the host's network, or the same container port twice."""
    if not ports:
        return
    if network == "none":
        raise ValueError(
            "publishing ports needs a network: set network='bridge' (or a named network); "
            "the default network='none' has no interface to publish on"
        )
    if network == "host":
        raise ValueError(
            "network='host' shares the host's ports already (the engine ignores published "
            "ports there): drop ports, or use network='bridge'"
        )
    keys = [port.key for port in ports]
    doubled = sorted({key for key in keys if keys.count(key) > 1})
    if doubled:
        raise ValueError(f"container port published twice: {', '.join(doubled)}")


def port_bindings(ports: tuple[PortSpec, ...]) -> dict[str, tuple[str, int | None]]:
    """The docker SDK's ``ports`` create option (which also exposes them)."""
    return {port.key: (port.host_ip, port.host_port) for port in ports}


def published_address(
    info: dict[str, Any], port: int, protocol: str, describe: str, engine_host: str | None
) -> tuple[str, int]:
    """The host address of ``port/protocol`` in a container's inspection.

    A binding to every address (``0.0.0.0``/``::``) is reported as ``engine_host`` (the
    engine's machine for a remote engine) or ``127.0.0.1``.

    Raises:
        SandboxInvalidArgumentError: the port is not published.
    """
    key = f"{port}/{protocol}"
    published = ((info.get("NetworkSettings") or {}).get("Ports") or {}).get(key) or []
    if not published:
        raise SandboxInvalidArgumentError(
            f"{describe} does not publish container port {key} "
            "(list it in the config's ports, with a network other than 'none')"
        )
    ipv4 = [b for b in published if ":" not in str(b.get("HostIp", ""))]
    binding = (ipv4 or published)[0]
    host = str(binding.get("HostIp") or "")
    if host in ("", "0.0.0.0", "::"):
        host = engine_host or "127.0.0.1"
    return host, int(binding["HostPort"])


def engine_host(base_url: str | None) -> str | None:
    """The host name of a remote engine (``tcp://``/``ssh://``), where its ports are
    published; ``None`` for a local one."""
    if base_url is None or not re.match(r"^(tcp|ssh|http|https)://", base_url):
        return None
    from urllib.parse import urlsplit

    return urlsplit(base_url).hostname
