"""How the agent starts in a sandbox: the probe for ``python3``, the bootstrap that makes the
process non-dumpable and runs the agent's source read from stdin, and that source. The shell
session's driver (:mod:`runtimes.shell`) starts the same way, with its own source."""

from __future__ import annotations

from functools import cache

from . import agent

NO_PYTHON = b"vf-sandbox:no-python"
"""What the probe or the bootstrap says when the sandbox has no usable ``python3``."""
READY = b"vf-sandbox:ready\n"
"""What the bootstrap writes once the process is non-dumpable: the key is sent only then."""

PROBE = (
    "command -v python3 >/dev/null 2>&1 || { echo vf-sandbox:no-python; exit 0; }; "
    'exec python3 -I -S -B -c "$1"'
)
"""The command that starts the agent the first time: ``sh -c PROBE sh BOOTSTRAP``. Without
python3 it says so on stdout (the channel is then never tried again in this sandbox). Later
starts run the interpreter the first agent reported, by absolute path (:func:`agent_command`)."""

BOOTSTRAP = (
    "import os,sys\n"
    "if sys.version_info<(3,8):os.write(1,b'vf-sandbox:no-python\\n');sys.exit(0)\n"
    "d=0\n"
    "try:\n"
    " import ctypes;d=ctypes.CDLL(None).prctl(4,0,0,0,0)==0\n"
    "except Exception:pass\n"
    "os.write(1,b'vf-sandbox:ready\\n')\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:sys.exit(3)\n"
    "  b+=c\n"
    " return b\n"
    "exec(compile(r(int(r(10))),'vf-sandbox-agent','exec'),"
    "{'__name__':'__vf_sandbox_agent__','_vf_nodump':d})\n"
)
"""Python's ``-c`` program: makes the process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``: no
``/proc/<pid>/fd``, no ptrace by other processes without CAP_SYS_PTRACE), says ``ready``, then
reads the agent's length-prefixed source from stdin and runs it. The agent then reads the
per-start key from stdin (sent by the host only after ``ready``)."""


@cache
def agent_source() -> bytes:
    """The agent's joined source (:func:`runtimes.channel.agent.joined_source`), prefixed
    with its length as the bootstrap expects."""
    return shipped(agent.joined_source())


def shipped(source: str) -> bytes:
    """``source`` as :data:`BOOTSTRAP` reads it from stdin: its length in ten ASCII digits,
    then its UTF-8. The shell driver ships this way too (:mod:`runtimes.shell.protocol`)."""
    data = source.encode("utf-8")
    return b"%010d" % len(data) + data


def agent_command(interpreter: str | None = None, *, shell: str = "sh") -> list[str]:
    """argv that starts the agent: through ``shell`` and a ``PATH`` search for ``python3``
    the first time, else straight through ``interpreter`` (an absolute path, pinned at the
    first start: no shell, no ``PATH``). The shell driver names ``/bin/sh``: its ``PATH`` is
    the caller's, which need not lead to a ``sh``."""
    if interpreter is not None:
        return [interpreter, "-I", "-S", "-B", "-c", BOOTSTRAP]
    return [shell, "-c", PROBE, "sh", BOOTSTRAP]
