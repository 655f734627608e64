"""Host routes from a Docker container: its default gateway, and whether this host owns it."""

from __future__ import annotations

import socket


def gateway_from_route_table(text: str) -> str | None:
    """The IPv4 default gateway in the text of a Linux ``/proc/net/route``, or ``None``."""
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[1] == "00000000" and fields[2] != "00000000":
            raw = bytes.fromhex(fields[2])
            return ".".join(str(b) for b in reversed(raw))
    return None


def _is_local_address(address: str) -> bool:
    """Whether ``address`` belongs to an interface of this host (it can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True
