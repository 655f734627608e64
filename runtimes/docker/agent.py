"""The channel agent in a Docker container: its transport (an exec stream with stdin
attached, see :mod:`runtimes.channel`) and the engine-side checks that its files and
interpreter are still the image's before it (re)starts."""

from __future__ import annotations

import contextlib
import posixpath
import socket
from collections.abc import Mapping

from ..channel import ChannelTransport
from .client import ContainerRef, engine_call
from .sdk_errors import refused
from .stream import STREAM_CHUNK, GuardedSocket, Hijacked, hijack, take_frames


class AgentStream(ChannelTransport):
    """The channel agent's exec stream (see :mod:`runtimes.channel`), for blocking use by
    the channel's threads: the engine's 8-byte frame headers are stripped, stdout is the
    agent's framed protocol, the tail of stderr is kept for failure messages."""

    def __init__(self, hijacked: Hijacked) -> None:
        with contextlib.suppress(OSError, AttributeError):
            hijacked.sock.settimeout(None)  # _buffered_bytes may have left it non-blocking
        # The channel's reader and writer threads use it while close() may come from another.
        self._sock = GuardedSocket(hijacked.sock, on_release=hijacked.response.close)
        self._plain = type(hijacked.sock) is socket.socket
        self._raw = bytearray(hijacked.leftover)
        self._stderr = bytearray()

    def recv(self) -> bytes:
        while True:
            out = self._demultiplex()
            if out:
                return out
            data: bytes = self._sock.recv(STREAM_CHUNK)
            if not data:
                return b""
            self._raw += data

    def _demultiplex(self) -> bytes:
        out = bytearray()
        for kind, payload in take_frames(self._raw):
            if kind == 2:
                self._stderr += payload
                del self._stderr[:-4096]
            else:
                out += payload
        return bytes(out)

    def send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def try_send(self, data: bytes) -> int:
        if not self._plain:
            return 0  # TLS or an ssh:// channel: the writer thread does it
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0

    def close(self) -> None:
        self._sock.close()

    def diagnostics(self) -> str:
        return self._stderr.decode("utf-8", "replace").strip()[-500:]


_LIBRARY_DIRS = (
    "/lib",
    "/lib32",
    "/lib64",
    "/usr/lib",
    "/usr/lib32",
    "/usr/lib64",
    "/usr/local/lib",
)


def untrusted_change(changed: list[str], digests: Mapping[str, bytes]) -> str | None:
    """Why the container's changes (sorted paths, the engine's diff) make the channel agent's
    files untrustworthy, or ``None``."""
    for path in changed:
        if path in digests:
            return f"{path} changed in the container"
    # Leaves only: a directory listed because something under it changed says nothing.
    parents = set()
    for path in changed:
        parent = posixpath.dirname(path)
        while parent not in parents and parent != "/":
            parents.add(parent)
            parent = posixpath.dirname(parent)
    for path in changed:
        if path not in parents and _protected_system_path(path):
            return f"{path} changed in the container"
    return None


JUDGE_SHELLS = frozenset(("bash", "env", "timeout", "setsid", "nohup"))
"""The programs a judge's commands run through (the bash harness's ``bash -c``). ``sh`` is
not among them: the machinery no longer runs the sandbox's ``sh`` around a judge (its probes
are the channel agent's), and the bash harness runs ``bash``."""


def judge_untrusted(changed: list[str]) -> str | None:
    """Why the container's changes (the engine's diff) make its system unfit to run a
    judge's commands in, or ``None``: the dynamic loader's preload list or configuration
    (code loaded into every program), or a shell a judge's commands run through, changed
    since the image. A root policy's package installs (libraries, ``ld.so.cache``) pass."""
    for path in changed:
        if path == "/etc/ld.so.preload" or path.startswith("/etc/ld.so.conf"):
            return f"{path} changed in the container (code every program would load)"
        folder, name = posixpath.split(path)
        if folder in ("/bin", "/usr/bin", "/usr/local/bin", "/sbin", "/usr/sbin") and (
            name in JUDGE_SHELLS
        ):
            return f"{path} changed in the container (a shell the judge's commands run through)"
    return None


def _protected_system_path(path: str) -> bool:
    """A path whose change makes the channel agent's interpreter untrustworthy: a shared
    library or the Python standard library (site-/dist-packages aside: ``-I -S`` never
    imports from them), the dynamic loader's configuration, a ``python`` binary."""
    if path.startswith("/etc/ld.so"):
        return True
    name = posixpath.basename(path)
    if posixpath.dirname(path) in ("/bin", "/usr/bin", "/usr/local/bin") and name.startswith(
        "python"
    ):
        return True
    if not any(path == d or path.startswith(d + "/") for d in _LIBRARY_DIRS):
        return False
    return "/site-packages" not in path and "/dist-packages" not in path


async def open_agent_stream(ref: ContainerRef, argv: list[str]) -> AgentStream:
    """Start the channel agent (``argv``: :func:`runtimes.channel.agent_command`) with stdin
    attached, as the sandbox's default user.

    Raises:
        SandboxUnavailableError: the container is gone.
        SandboxError: the engine refused to start the agent.
    """
    api = ref.api

    def open_stream() -> Hijacked:
        created = api.exec_create(
            ref.id,
            argv,
            stdin=True,
            stdout=True,
            stderr=True,
            user=ref.user,
            workdir="/",
        )
        return hijack(api, str(created["Id"]))

    refusal = refused("the engine refused the channel agent", subject=ref.describe)
    return AgentStream(await engine_call(open_stream, ref.config, refusal=refusal))


def untrusted_python(changed: list[str]) -> str | None:
    """Why a container's changes (the engine's diff) make its ``python3`` untrustworthy for a
    first agent: a system library changed, or any ``python*`` anywhere; else ``None``."""
    reason = untrusted_change(changed, {})
    if reason is not None:
        return reason
    for path in changed:
        if posixpath.basename(path).startswith("python"):
            return f"{path} changed in the container (python3 on PATH may not be the image's)"
    return None
