"""``examples/gated_rollout.py`` runs as documented and prints a scored rollout record."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harnesses.session import RolloutRecord

from .conftest import containers_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gated_rollout.py"


@pytest.mark.parametrize(
    "runtime", [pytest.param("docker", marks=pytest.mark.docker), pytest.param("subprocess")]
)
def test_example_prints_a_scored_record(runtime: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), runtime], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    record = RolloutRecord.model_validate_json(done.stdout)
    assert record.status == "completed" and record.reward == 1.0
    assert record.verification is not None
    assert record.verification["verdicts"] == {"file-check": {"score": 1.0}}
    assert [t.message_index for t in record.turns] == [2, 4]
    assert record.turns[0].completion.metadata["token_ids"] == [101, 102, 103]
    assert "reward 1.0 (completed)" in done.stderr
    if runtime == "docker":
        assert containers_of("example-0") == []
