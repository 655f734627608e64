"""The host's wheelhouse for an installed harness: wheels of the pinned requirements for the
sandbox's interpreter and platform, downloaded on the host (the sandbox needs no network)
and cached. See :mod:`harnesses.installed` for how they are installed and checked.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio

from .errors import HarnessInstallError

__all__ = ["SandboxPython", "prepare_wheelhouse", "wheelhouse_cache_dir"]


@dataclass(frozen=True)
class SandboxPython:
    """The sandbox interpreter a wheelhouse must fit."""

    version: str
    machine: str
    glibc: str

    def pip_platforms(self) -> list[str]:
        """The ``--platform`` tags pip may pick wheels for (manylinux up to this glibc)."""
        tags = [f"linux_{self.machine}"]
        match = re.fullmatch(r"2\.(\d+)", self.glibc)
        if match is not None:
            newest = int(match.group(1))
            tags += [f"manylinux_2_{minor}_{self.machine}" for minor in range(5, newest + 1)]
            tags += [f"manylinux2014_{self.machine}", f"manylinux2010_{self.machine}"]
            tags += [f"manylinux1_{self.machine}"]
        return tags

    def cache_key(self, requirements: Sequence[str]) -> str:
        label = re.sub(r"[^A-Za-z0-9_.-]+", "_", requirements[0])
        digest = hashlib.sha256(f"{list(requirements)}|{self}".encode()).hexdigest()[:12]
        return f"{label}-py{self.version}-{self.machine}-{digest}"


def wheelhouse_cache_dir() -> Path:
    """Where host-built wheelhouses are cached (``VF_SANDBOX_CACHE`` or ``~/.cache``)."""
    base = os.environ.get("VF_SANDBOX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vf-sandbox"
    )
    return Path(base) / "wheelhouses"


async def prepare_wheelhouse(requirements: Sequence[str], target: SandboxPython) -> Path:
    """A host directory holding wheels of ``requirements`` and their dependencies for ``target``.

    Cached: a complete wheelhouse is reused; a new one is downloaded into a temporary
    directory and renamed into place, so concurrent preparations never see half of one.

    Raises:
        HarnessInstallError: pip could not download the wheels (the message has pip's output).
    """
    cache = wheelhouse_cache_dir()
    final = cache / target.cache_key(requirements)
    if (final / ".complete").is_file():
        return final
    await anyio.Path(cache).mkdir(parents=True, exist_ok=True)
    staging = Path(await anyio.to_thread.run_sync(lambda: tempfile.mkdtemp(dir=cache)))
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    argv += ["--only-binary=:all:", "--python-version", target.version, "--dest", str(staging)]
    for platform_tag in target.pip_platforms():
        argv += ["--platform", platform_tag]
    argv += list(requirements)
    result = await anyio.run_process(argv, check=False)
    if result.returncode != 0:
        await anyio.to_thread.run_sync(_remove_tree, staging)
        raise HarnessInstallError(
            f"pip could not download {' '.join(requirements)} for python {target.version} "
            f"({target.machine}, glibc {target.glibc}): {_tail(result.stderr)}"
        )
    await anyio.Path(staging / ".complete").touch()
    await anyio.to_thread.run_sync(_place_directory, staging, final)
    return final


def _place_directory(staging: Path, final: Path) -> None:
    try:
        staging.rename(final)
    except OSError:
        # Someone else placed it first (rename onto a non-empty directory fails): keep theirs.
        _remove_tree(staging)
        if not (final / ".complete").is_file():
            raise


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _tail(data: bytes | str, limit: int = 3000) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]
