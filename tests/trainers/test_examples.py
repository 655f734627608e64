"""``examples/openenv_session.py`` runs as documented: an OpenEnv loop-owning session whose
training trace validates and whose judge scores it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from openenv.core.harness import TrainingTrace

from tests.sessions.conftest import containers_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "openenv_session.py"


@pytest.mark.parametrize(
    "runtime", [pytest.param("docker", marks=pytest.mark.docker), pytest.param("subprocess")]
)
def test_example_prints_a_scored_training_trace(runtime: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), runtime], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    trace = TrainingTrace.model_validate(printed["training_trace"])
    assert [t.completion_token_ids for t in trace.turns] == [[101, 102, 103], [104, 105]]
    assert trace.turns[0].loss_mask == [0, 0, 0, 1, 1, 1]
    assert printed["env_reward"] == 1.0
    assert printed["metrics"]["verdicts"] == {"file-check": {"score": 1.0}}
    assert "exit code 0, reward 1.0, 2 turns" in done.stderr
    if runtime == "docker":
        assert containers_of("example-0") == []
