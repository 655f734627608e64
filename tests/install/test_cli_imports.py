"""The CLI imports no optional backend it is not using: neither an extra's package (Ray, Modal's
SDK, docker-py, paramiko, inspect_ai, TRL, ...) nor the project's own package of that backend
(``runtimes.ray``, ...), which a user without the extra may not be able to import. Each command
runs in a fresh interpreter of the dev venv (which has every extra installed, so an import
that happens is seen, not hidden by an ImportError)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from .venvs import REPO, run_as_user

EXTRAS_PACKAGES = frozenset(
    {"ray", "modal", "docker", "paramiko", "inspect_ai", "trl", "transformers", "torch"}
    | {"openenv", "datasets"}
)
"""The top-level modules the extras install."""
BACKEND_PACKAGES = (
    *("runtimes.docker", "runtimes.ssh", "runtimes.modal", "runtimes.ray"),
    *("runtimes.inspect_sandbox", "placement.trainers"),
)
"""The project's own modules that serve an extra."""

CODE = """
import contextlib, io, json, sys
from runtimes.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _imported_by(*argv: str, tmp_path: Path) -> tuple[set[str], set[str]]:
    """The extras' packages and the project's backend packages that ``vf-sandbox ARGV``
    imported (it must exit 0)."""
    result = run_as_user([sys.executable, "-c", CODE, *argv], REPO, tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    assert report["code"] == 0, report["code"]
    modules: list[str] = report["modules"]
    extras = {m.split(".")[0] for m in modules} & EXTRAS_PACKAGES
    ours = {b for b in BACKEND_PACKAGES for m in modules if m == b or m.startswith(b + ".")}
    return extras, ours


EXAMPLES = REPO / "examples"
UNUSED_BACKEND = {
    "help": ["--help"],
    "version": ["--version"],
    "ls": ["ls", "--runtime", "subprocess"],
    "cleanup": ["cleanup", "--dry-run", "--runtime", "subprocess"],
    "doctor": ["doctor", "--runtime", "subprocess"],
    "exec": ["exec", "--runtime", "subprocess", "--", "true"],
    "check": ["check", "--list"],
}


@pytest.mark.parametrize("argv", UNUSED_BACKEND.values(), ids=UNUSED_BACKEND.keys())
def test_a_command_on_the_subprocess_runtime_imports_no_other_backend(
    argv: list[str], tmp_path: Path
) -> None:
    assert _imported_by(*argv, tmp_path=tmp_path) == (set(), set())


def test_the_demo_judges_importing_no_other_backend(tmp_path: Path) -> None:
    judge = ["judge", str(EXAMPLES / "rollout"), "--judges", str(EXAMPLES / "judges.yaml")]
    judge += ["--scripted", str(EXAMPLES / "scripted.json"), "--out", str(tmp_path / "runs.json")]
    assert _imported_by(*judge, tmp_path=tmp_path) == (set(), set())


def test_ls_of_every_backend_imports_only_the_sdks_it_lists_with(tmp_path: Path) -> None:
    """Without a cluster named (no RAY_ADDRESS) the ray backend lists nothing and loads no Ray;
    no trainer or inspect package is loaded by any listing."""
    extras, ours = _imported_by("ls", tmp_path=tmp_path)
    assert extras <= {"docker", "modal", "paramiko"}, extras
    assert "runtimes.inspect_sandbox" not in ours and "placement.trainers" not in ours, ours
