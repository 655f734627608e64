"""``vf-sandbox shell`` for the subprocess runtime: the user's shell on the host, in a
sandbox directory's workdir (the one its ``meta.json`` records, else ``<dir>/work``)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SandboxUnavailableError
from .sweep import read_meta

_CD_AND_SHELL = 'cd -- "$1" || exit 1; exec "${SHELL:-/bin/sh}"'


def sandbox_workdir(directory: Path) -> Path:
    """The workdir of the sandbox directory ``directory``.

    Raises:
        SandboxUnavailableError: the directory or its workdir is gone.
    """
    meta = read_meta(directory)
    if not meta:
        raise SandboxUnavailableError(f"subprocess sandbox {directory.name} is gone")
    declared = meta.get("workdir")
    workdir = Path(declared) if isinstance(declared, str) and declared.startswith("/") else None
    workdir = workdir or directory / "work"
    if not workdir.is_dir():
        raise SandboxUnavailableError(
            f"subprocess sandbox {directory.name}: its workdir {workdir} is gone"
        )
    return workdir


def local_shell_argv(directory: Path) -> list[str]:
    """``sh -c 'cd WORKDIR; exec $SHELL'``: the user's shell (``/bin/sh`` without ``$SHELL``)
    in the workdir; it reads commands from stdin when stdin is not a terminal.

    Raises:
        SandboxUnavailableError: the directory or its workdir is gone.
    """
    return ["/bin/sh", "-c", _CD_AND_SHELL, "sh", str(sandbox_workdir(directory))]
