"""Fresh venvs holding only what a user installs, and the project's commands run in them.

Nothing here writes into the repository: the source is copied first (:func:`copy_source`, what
a clone of the working tree holds: its tracked files and the new ones git does not ignore), and
every build, venv and output lives under pytest's tmp paths. pip runs as this machine
configures it (its find-links and extra indexes), without byte-compiling (``--no-compile``:
CPU these venvs never get back).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT = 900.0
"""Seconds one venv's install may take (the [trl] venv's torch is the longest, ~1 min here)."""
TORCH_PIN = "torch==2.13.0"
"""The CPU build on this machine's disk: a bare ``torch`` (what [trl] names) would pull several
GB of CUDA wheels (the Makefile pins it the same way)."""

SCRUBBED = (
    *("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV", "RAY_ADDRESS"),
    *("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"),
)
"""Variables of the suite's own environment a user's fresh shell does not have: a PYTHONPATH
would put the repository's packages in front of the installed ones, a RAY_ADDRESS would send
``doctor`` to the suite's cluster, and `make test`'s flags (its variables, its jobserver) would
reach the `make demo` run inside it."""


def copy_source(dest: Path) -> Path:
    """The working tree's tracked files and its untracked ones that git does not ignore (what a
    clone holds once they are committed), copied to ``dest``; no venv, no build output."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout
    for name in sorted({n for n in listed.decode().split("\0") if n}):
        source = REPO / name
        if not source.is_file():  # deleted in the working tree, not yet in the index
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return dest


@contextmanager
def exclusive(lock: Path) -> Iterator[None]:
    """Held by one process at a time (pytest-xdist workers building one shared thing)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_wheel(source: Path, out: Path) -> Path:
    """The project's wheel, built from ``source`` by the dev venv's pip and setuptools."""
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run(
        [*pip, "-w", str(out), str(source)],
        check=True,
        capture_output=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    (wheel,) = out.glob("vf_sandbox-*.whl")
    return wheel


def user_env(tmp: Path, venv: Path | None = None) -> dict[str, str]:
    """The environment of a user's shell with ``venv`` activated: no engine to reach (Docker's
    socket is a path that does not exist, so ``doctor`` has a backend that must say it is
    unavailable), no cluster, no PYTHONPATH; pip does not byte-compile."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    env["DOCKER_HOST"] = f"unix://{tmp / 'no-engine.sock'}"
    env["PIP_NO_COMPILE"] = "1"
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def make_venv(venv: Path, requirements: Sequence[str]) -> Path:
    """A new venv at ``venv`` holding ``requirements`` and what they depend on, nothing else
    (not even pip: the dev venv's pip installs into it with ``--python``)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-compile", "-q"]
    result = subprocess.run(
        [*pip, *requirements],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=INSTALL_TIMEOUT,
        env=user_env(venv.parent),
        check=False,
    )
    assert result.returncode == 0, f"pip install {' '.join(requirements)}:\n{result.stderr}"
    return python


def installed(python: Path) -> dict[str, str]:
    """The distributions installed in ``python``'s environment: canonical name -> version."""
    code = (
        "import importlib.metadata as m, json, re; "
        "print(json.dumps({re.sub(r'[-_.]+', '-', d.metadata['Name']).lower(): d.version "
        "for d in m.distributions()}))"
    )
    result = subprocess.run(
        [str(python), "-I", "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    found: dict[str, str] = json.loads(result.stdout)
    return found


def run_as_user(
    argv: Sequence[str], cwd: Path, tmp: Path, venv: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``argv`` run in ``cwd`` as a user's shell would (:func:`user_env` under ``tmp``, with
    ``venv`` activated), with no standard input; its output captured, its exit code kept."""
    return subprocess.run(
        list(argv),
        cwd=cwd,
        env=user_env(tmp, venv),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_in(
    venv: Path, argv: Sequence[str], cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``argv`` (a command of ``venv/bin``, or an absolute path) run as a user of ``venv`` would,
    in ``cwd``, with no standard input."""
    program = argv[0] if os.path.isabs(argv[0]) else str(venv / "bin" / argv[0])
    return run_as_user([program, *argv[1:]], cwd, cwd, venv, timeout)


def json_of(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The one JSON document a reporting command printed with ``--json``."""
    try:
        document: dict[str, Any] = json.loads(result.stdout)
    except json.JSONDecodeError as exc:
        raise AssertionError(
            f"not one JSON document ({exc}):\n{result.stdout}\n{result.stderr}"
        ) from None
    return document
