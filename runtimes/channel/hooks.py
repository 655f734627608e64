"""What a backend gives its :class:`~runtimes.channel.supervisor.ChannelSupervisor`
(:class:`ChannelHooks`: how to start the agent, kill through the plain path, probe and
verify), the helper that verifies the agent's files by reading them
(:func:`verify_by_reading`), and what the supervisor reports back (:class:`ChannelInfo`).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from ..errors import SandboxError
from .protocol import ChannelTransport

__all__ = ["ABSENT", "UNKNOWN", "ChannelHooks", "ChannelInfo", "verify_by_reading"]


@dataclass(frozen=True)
class ChannelHooks:
    """What a backend gives its :class:`ChannelSupervisor`.

    ``open_transport``: start ``agent_command(interpreter)`` with stdin attached and return
    the stream (raise a ``SandboxError`` when it cannot); ``interpreter`` is ``None`` the first
    time, then the absolute path pinned then. ``kill_group``: kill a process group through
    the plain path (the agent died holding it). ``lost_means_dead``: after the channel died,
    whether the sandbox itself is gone. ``probe_dead``: a cheap check, during a long silence,
    that the sandbox stopped (``None``: no such check). ``verify_agent``: before a restart,
    check through the backend's own file access (never by running sandbox code) that the
    files the first agent ran from are unchanged: given their sha256 (32 zero bytes: absent;
    :data:`UNKNOWN`: the first agent died before it reported) as the first agent reported
    them, the pinned interpreter always among them, return ``None`` or why they cannot be
    trusted (``None`` hook: a restart is never trusted, the plain path serves).
    ``verify_first``: before the first start, whether the sandbox's ``python3`` can be trusted
    (a sandbox commands ran in before this runtime attached); ``None`` or why not.
    """

    open_transport: Callable[[str | None], Awaitable[ChannelTransport]]
    kill_group: Callable[[int], Awaitable[None]]
    lost_means_dead: Callable[[], Awaitable[bool]]
    probe_dead: Callable[[], Awaitable[bool]] | None = None
    verify_agent: Callable[[Mapping[str, bytes]], Awaitable[str | None]] | None = None
    verify_first: Callable[[], Awaitable[str | None]] | None = None


ABSENT = bytes(32)
"""The digest the agent reports for a file that is not there (``/etc/ld.so.preload``)."""
UNKNOWN = b""
"""The digest of a file the first agent did not report (it died first)."""


async def verify_by_reading(
    read_file: Callable[[str], Awaitable[bytes | None]], digests: Mapping[str, bytes]
) -> str | None:
    """A ``verify_agent`` for backends that can read a file without running sandbox code
    (SFTP, a filesystem API): every file hashed again and compared. ``read_file`` returns
    ``None`` for a missing file and may raise ``SandboxError``."""
    for path, digest in digests.items():
        if digest == UNKNOWN:
            return f"the first agent died before it reported the digest of {path!r}"
        try:
            data = await read_file(path)
        except SandboxError as exc:
            return f"could not read {path!r} to verify it: {exc}"
        now = ABSENT if data is None else hashlib.sha256(data).digest()
        if not hmac.compare_digest(now, digest):
            return f"{path!r} changed since the agent first ran"
    return None


@dataclass(frozen=True)
class ChannelInfo:
    """The state of a runtime's channel, for tests, logs and ``vf-sandbox doctor``.

    ``state`` is ``disabled`` (``channel=False``), ``unsupported`` (no python3 in the
    sandbox, or an agent that cannot protect itself), ``running``, ``down`` (died or never
    came up; restarted on the next call while the restart budget allows), ``distrusted``
    (the stream was tampered with, or the agent could not be restarted from verified files:
    the plain path serves for good; ``reason`` says why) or ``closed``. ``served`` counts
    the calls the channel served, ``fallbacks`` those that took the backend's plain path
    while the channel was enabled.
    """

    state: str
    agent_pid: int | None
    python: str | None
    restarts: int
    served: int
    fallbacks: int
    reason: str | None
