"""Running the host's own commands ("the machinery") in a sandbox the policy has used.

After a policy ran, anything it could write may be waiting for a more privileged process
to load it: its working directory (Python puts the current directory first on
``sys.path`` for ``-c`` and ``-m``), a directory early on ``PATH``, a file a shell's
start-up variables name (``BASH_ENV``, ``ENV``), a ``pip`` configuration file. So every
command the machinery starts in a sandbox goes through :func:`run_machinery`:

- ``cwd`` is ``/`` (:data:`MACHINERY_CWD`), never the policy's workdir;
- ``PATH`` is fixed to the system directories (:data:`MACHINERY_PATH`): a program named
  without a slash is searched there only, whatever the image's ``PATH`` holds;
- ``BASH_ENV``, ``ENV`` and ``CDPATH`` are empty, and so is ``TMPDIR`` (temporary files go
  to the system's default, a sticky ``/tmp``, never a directory the caller's environment
  names and the policy may own); the Python variables that load code
  (``PYTHONPATH``, ``PYTHONSTARTUP``, ``PYTHONUSERBASE``) are empty (CPython ignores an
  empty one) and ``PYTHONNOUSERSITE`` is set, for a Python child that is not isolated;
- ``PIP_CONFIG_FILE`` is ``/dev/null``: pip then reads no configuration file at all (its
  ``--isolated`` ignores ``PIP_*`` variables and the user's file, not this one or the
  global ``/etc/pip.conf``).

The values are passed as the command's ``env``, which every backend lays over the
sandbox's own environment (the request's variables win: :func:`runtimes.arguments.exec_request`,
``docker exec``'s ``Env``, the exec wrapper's ``export`` lines, the channel agent's
``env.update``) and from which the program named in ``argv[0]`` is searched. The rest of
the runtime config's ``env`` still applies (it is the caller's, not the policy's).

Python the machinery starts runs with :func:`isolated_python` flags (``-I``: no current or
script directory on ``sys.path``, no user site, no ``PYTHON*`` variables); pip runs with
:data:`PIP_ISOLATION`. A program given as a path (``/usr/bin/python3``) is run as given.

docs/security.md ("What the host runs inside a sandbox") lists every place that runs a
program in a sandbox, with its account, cwd, interpreter and ``PATH``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .models import ExecResult

if TYPE_CHECKING:  # runtimes.base uses this module
    from .base import Runtime

__all__ = [
    "MACHINERY_CWD",
    "MACHINERY_ENV",
    "MACHINERY_PATH",
    "PIP_ISOLATION",
    "isolated_python",
    "machinery_env",
    "run_machinery",
]

MACHINERY_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
"""The only directories a machinery command's program is searched in."""

MACHINERY_CWD = "/"
"""Where machinery commands run: a directory no unprivileged policy can write."""

MACHINERY_ENV: Mapping[str, str] = {
    "PATH": MACHINERY_PATH,
    "BASH_ENV": "",
    "ENV": "",
    "CDPATH": "",
    "TMPDIR": "",
    "PYTHONPATH": "",
    "PYTHONSTARTUP": "",
    "PYTHONUSERBASE": "",
    "PYTHONNOUSERSITE": "1",
    "PIP_CONFIG_FILE": "/dev/null",
}
"""The variables every machinery command gets, over the sandbox's own."""

PIP_ISOLATION = ("--isolated", "--no-input", "--disable-pip-version-check", "--no-cache-dir")
"""pip's flags for a machinery install: no ``PIP_*`` variables or user configuration, no
prompt, no self-check, no cache a policy could have filled."""


def isolated_python(python: str, *args: str, site: bool = True) -> list[str]:
    """``[python, "-I", ...args]``; ``site=False`` adds ``-S`` (not even site-packages).

    ``-I`` keeps the current and the script's directory off ``sys.path`` and ignores the
    user site and every ``PYTHON*`` variable (so ``-B`` must be given where bytecode must
    not be written).
    """
    return [python, "-I", *([] if site else ["-S"]), *args]


def machinery_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """:data:`MACHINERY_ENV` with ``extra`` laid over it (``extra`` may not change ``PATH``
    or any other variable of :data:`MACHINERY_ENV`: those always win)."""
    return {**(extra or {}), **MACHINERY_ENV}


async def run_machinery(
    runtime: Runtime,
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    stdin: bytes | str | None = None,
    env: Mapping[str, str] | None = None,
    user: str | None = None,
    output_limit: int | None = None,
) -> ExecResult:
    """Run one machinery command in ``runtime``: ``cwd`` ``/``, :data:`MACHINERY_ENV` (see
    the module doc), as ``user`` (default: the sandbox's default user).

    Raises:
        SandboxError: as :meth:`runtimes.base.Runtime.exec` (typed, from :mod:`runtimes.errors`).
    """
    return await runtime.exec(
        argv,
        timeout=timeout,
        cwd=MACHINERY_CWD,
        env=machinery_env(env),
        stdin=stdin,
        user=user,
        output_limit=output_limit,
    )
