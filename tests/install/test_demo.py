"""`make demo`, the README's first command, as a user runs it on a bare clone: in a copy of the
working tree with no venv, the Makefile's own target creates ``.venv``, installs what it
installs (the project with the demo's extras, nothing of the dev set) and judges the example
rollout. The output and ``agent-runs.json`` are checked against ``examples/``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from .venvs import REPO, copy_source, installed, run_as_user

EXAMPLES = REPO / "examples"
JUDGES = [
    judge["name"] for judge in yaml.safe_load((EXAMPLES / "judges.yaml").read_text())["judges"]
]
PLACEMENTS = {
    "reply-grader": "host (no sandbox)",
    "test-runner": "rollout",
    "transcript-auditor": "clean-room:subprocess",
}
"""Where each judge of examples/judges.yaml ran: no placement (a tool-less harness), the
rollout's own sandbox, a clean-room subprocess sandbox."""
VERDICTS = {
    "reply-grader": (
        "The transcript shows fizzbuzz.py written and run, printing the expected lines."
    ),
    "test-runner": "all 15 lines match",
    "transcript-auditor": "3 turns, error: None",
}
"""The ``reason`` of each verdict: the scripted replies of examples/scripted.json."""
NOT_IN_THE_DEMO = ("pytest", "ruff", "mypy", "trio", "hypothesis", "testcontainers", "deptry")
OTHER_EXTRAS = ("modal", "ray", "inspect-ai", "trl", "torch", "openenv")


def test_make_demo_on_a_bare_clone(tmp_path: Path) -> None:
    clone = copy_source(tmp_path / "clone")
    assert not (clone / ".venv").exists()
    result = run_as_user(["make", "--no-print-directory", "demo"], clone, tmp_path, timeout=900)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"make demo exited {result.returncode}:\n{out[-4000:]}\n{err}"

    # what it installed: the run set into the clone's own .venv
    assert "==> creating .venv with python3" in out
    assert "==> installing vf-sandbox[docker,ssh] into .venv" in out
    found = installed(clone / ".venv" / "bin" / "python")
    assert {"vf-sandbox", "docker", "paramiko"} <= set(found)
    assert not set(found) & {*NOT_IN_THE_DEMO, *OTHER_EXTRAS}, sorted(found)

    # what it said: the offline run, and a verdict of every judge
    assert "==> judging examples/rollout with examples/judges.yaml on the subprocess runtime" in out
    assert "SCRIPTED model replies from examples/scripted.json" in err
    assert "Traceback" not in err
    for name in JUDGES:
        assert f"judge {name}: ok in " in err
        (row,) = [line for line in out.splitlines() if line.startswith(f"{name} ")]
        assert PLACEMENTS[name] in row and VERDICTS[name] in row, row
    assert "agent runs written to agent-runs.json" in err

    # what it wrote: one record per judge, each with its verdict and no error
    runs = json.loads((clone / "agent-runs.json").read_text())
    assert sorted(run["name"] for run in runs) == sorted(JUDGES) == sorted(PLACEMENTS)
    for run in runs:
        name = run["name"]
        assert run["role"] == "judge" and run["model"] == "grader", run
        assert run["placement"] == PLACEMENTS[name]
        assert run["error"] is None and run["error_type"] is None, run
        assert run["verdict"] == {"passed": True, "score": 1.0, "reason": VERDICTS[name]}
        assert run["endpoint_model"] == "scripted-model"
        assert run["trace"]["turns"], run["trace"]
    shutil.rmtree(clone / ".venv")  # kept when the test fails, to look at
