"""Reverse port forwards (``ssh -R``): each connection the server forwards is bridged to a new
local TCP connection by a thread of its own (see :meth:`SSHRuntime.forward_remote`)."""

from __future__ import annotations

import contextlib
import logging
import select
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("runtimes.ssh")


@dataclass
class Forward:
    local_host: str
    local_port: int


def bridge(channel: paramiko.Channel, forward: Forward, timeout: float) -> None:
    """Pump bytes between a forwarded channel and a new local TCP connection."""
    try:
        sock = socket.create_connection((forward.local_host, forward.local_port), timeout=timeout)
    except OSError as exc:
        log.warning("forward to %s:%s failed: %s", forward.local_host, forward.local_port, exc)
        channel.close()
        return
    sock.settimeout(None)
    open_ends: list[Any] = [sock, channel]
    try:
        while open_ends:
            ready, _, _ = select.select(open_ends, [], [])
            for end in ready:
                data = end.recv(64 * 1024)
                if end is sock:
                    if data:
                        channel.sendall(data)
                    else:
                        channel.shutdown_write()
                        open_ends.remove(sock)
                elif data:
                    sock.sendall(data)
                else:
                    with contextlib.suppress(OSError):
                        sock.shutdown(socket.SHUT_WR)
                    open_ends.remove(channel)
    except (OSError, EOFError) as exc:
        log.debug("forward to %s:%s ended: %s", forward.local_host, forward.local_port, exc)
    finally:
        channel.close()
        sock.close()
