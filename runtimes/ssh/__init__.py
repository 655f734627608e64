"""The ``ssh`` runtime: a private directory on a remote host, driven over one SSH connection.

One paramiko transport per sandbox carries everything: a channel per command (no pty),
one SFTP client for files, a short control channel to kill process groups, and any
reverse port forwards (:meth:`SSHRuntime.forward_remote`). paramiko blocks, so every
call runs in a worker thread (``anyio.to_thread``) under a capacity limiter; the event
loop never waits on a socket.

Commands go through the one exec wrapper (:mod:`runtimes.wrapper`, ``wait`` mode) that
checks ``cwd`` and the program first (so a missing program is
``SandboxFileNotFoundError`` even when a real program exits 127), sets the environment,
starts the command under ``setsid`` (its own session and process group) and reports the
group id on stderr ahead of the command's own output. ``timeout=``, the output cap and
cancellation kill that whole group through a second channel; ``close()`` kills every
process still carrying the runtime's mark (``VF_SANDBOX_RUNTIME``, which also names the
sandbox directory), then removes the sandbox directory.

Requirements on the remote host: Linux (``/proc``), a POSIX ``sh``, util-linux
(``setsid``; ``runuser`` for ``user=``), coreutils, GNU grep (for the sweep), an SFTP
subsystem, and a POSIX-compatible login shell whose startup files print nothing on
stdout (stderr noise before the wrapper's report is dropped). See ``docs/ssh.md``.

The package: :mod:`~runtimes.ssh.config` (the config model), :mod:`~runtimes.ssh.client`
(connecting: host keys, credentials, the handshake), :mod:`~runtimes.ssh.connected`
(connection upkeep: reconnects, retries, worker threads, forwards),
:mod:`~runtimes.ssh.commands` (commands on exec channels, kills on control channels),
:mod:`~runtimes.ssh.files` (SFTP), :mod:`~runtimes.ssh.process` (the wrapper's arguments and
the stream pump), :mod:`~runtimes.ssh.control` with :mod:`~runtimes.ssh.scripts` (bookkeeping
scripts), :mod:`~runtimes.ssh.forward` (bridging forwarded connections),
:mod:`~runtimes.ssh.faults` (paramiko's exception table, applied at the boundary) and
:mod:`~runtimes.ssh.runtime` (:class:`SSHBackend`, and :class:`SSHRuntime` composed around
it).
"""

from __future__ import annotations

from .client import (
    HostKeyMismatchError,
    HostKeyVerificationError,
    HostUnreachableError,
    SSHAuthenticationError,
    UnknownHostKeyError,
)
from .config import SSHConfig
from .runtime import SSHBackend, SSHRuntime

__all__ = [
    "HostKeyMismatchError",
    "HostKeyVerificationError",
    "HostUnreachableError",
    "SSHAuthenticationError",
    "SSHBackend",
    "SSHConfig",
    "SSHRuntime",
    "UnknownHostKeyError",
]
