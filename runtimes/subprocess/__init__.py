"""The ``subprocess`` runtime: sandboxes that are local process trees. The embedded default.

NOT AN ISOLATION BOUNDARY. Commands run on the host, as the host user (or as ``user=``
when the host process is root), with the host's filesystem and network. What it gives:
a private working directory per sandbox (removed on close), every command in its own
process group and session (``timeout=``, output caps and cancellation kill the whole
group), and the same typed errors as every other backend. Use it for trusted code,
tests, and judges that only need a scratch directory; use Docker, SSH or Modal to
contain untrusted code.

A process that calls ``setsid`` itself leaves its group and escapes the tree kill.
``close()``, ``stop_processes()`` and the ``cleanup`` sweep find what is left with a
freeze-then-kill sweep of ``/proc`` (see :func:`sweep_target`): every process started after the
sandbox that carries its environment mark, belongs to a session one of its commands
started, or has its cwd, root, executable, an open file or a mapping under the sandbox's
directories is stopped (SIGSTOP, through a pidfd), the scan repeats until a pass finds
nothing new, and then all of them are SIGKILLed - a fork loop cannot outrun it. The
sandbox's directory is then removed without ever following a symbolic link.
"""

from __future__ import annotations

from .config import SubprocessConfig, default_root
from .runtime import SubprocessBackend, SubprocessRuntime

__all__ = ["SubprocessBackend", "SubprocessConfig", "SubprocessRuntime", "default_root"]
