"""The project's wheel, built once per test session from a copy of the working tree."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from .venvs import build_wheel, copy_source, exclusive


@pytest.fixture(scope="session")
def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``vf_sandbox-*.whl``, built once per session: under pytest-xdist the workers' tmp dirs
    are siblings under one directory of this run, and the first worker to take the lock there
    builds it for all (into a scratch directory renamed into place, so a failed build leaves
    nothing the next worker would take for a wheel)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    done = shared / "vf-sandbox-wheel"
    with exclusive(shared / "vf-sandbox-wheel.lock"):
        if not done.is_dir():
            scratch = shared / f"vf-sandbox-wheel.{os.getpid()}"
            shutil.rmtree(scratch, ignore_errors=True)
            build_wheel(copy_source(scratch / "src"), scratch / "dist")
            (scratch / "dist").rename(done)
            shutil.rmtree(scratch)
    (wheel,) = done.glob("vf_sandbox-*.whl")
    return wheel
