"""`vf-sandbox judge`: the main job, run as users run it, on the shipped example."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CLI = [sys.executable, "-m", "placement.cli"]


def judge(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    env.update(env_extra or {})
    return subprocess.run(
        [*CLI, "judge", *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=env
    )


def test_example_rollout_is_judged_offline_with_scripted_models(tmp_path: Path) -> None:
    out = tmp_path / "runs.json"
    result = judge(
        str(EXAMPLES / "rollout"),
        "--judges", str(EXAMPLES / "judges.yaml"),
        "--scripted", str(EXAMPLES / "scripted.json"),
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SCRIPTED" in result.stderr
    for name in ("reply-grader", "test-runner", "transcript-auditor"):
        assert name in result.stdout
    runs = json.loads(out.read_text())
    assert [r["name"] for r in runs] == ["reply-grader", "test-runner", "transcript-auditor"]
    assert all(r["verdict"]["passed"] is True and r["error"] is None for r in runs)
    assert all(r["role"] == "judge" and r["trainable"] is False for r in runs)
    # the test-runner really ran the policy's program: its tool call exited 0
    runner = runs[1]["trace"]["turns"][0]["tool_results"][0]
    assert runner["exit_code"] == 0 and "FizzBuzz" in runner["output"]


def test_a_broken_world_fails_the_judge_not_silently(tmp_path: Path) -> None:
    rollout = tmp_path / "rollout"
    (rollout / "files").mkdir(parents=True)
    for name in ("task.json", "trace.json"):
        (rollout / name).write_bytes((EXAMPLES / "rollout" / name).read_bytes())
    (rollout / "files" / "fizzbuzz.py").write_text("print('nope')\n")
    out = tmp_path / "runs.json"
    result = judge(
        str(rollout),
        "--judges", str(EXAMPLES / "judges.yaml"),
        "--scripted", str(EXAMPLES / "scripted.json"),
        "--out", str(out),
    )  # fmt: skip
    runs = {r["name"]: r for r in json.loads(out.read_text())}
    assert runs["test-runner"]["verdict"]["passed"] is False
    assert result.returncode == 0  # a failing verdict is a verdict, not an error


def test_judge_errors_make_the_command_fail(tmp_path: Path) -> None:
    judges = yaml.safe_load((EXAMPLES / "judges.yaml").read_text())
    script = json.loads((EXAMPLES / "scripted.json").read_text())
    script["test-runner"] = [script["test-runner"][0], {"content": "no verdict, sorry"}]
    (tmp_path / "scripted.json").write_text(json.dumps(script))
    (tmp_path / "judges.yaml").write_text(yaml.safe_dump(judges))
    out = tmp_path / "runs.json"
    result = judge(
        str(EXAMPLES / "rollout"),
        "--judges", str(tmp_path / "judges.yaml"),
        "--scripted", str(tmp_path / "scripted.json"),
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 1
    assert "VerdictMissing" in result.stdout
    runs = {r["name"]: r for r in json.loads(out.read_text())}
    assert runs["test-runner"]["error_type"] == "VerdictMissing"
    assert runs["reply-grader"]["verdict"]["passed"] is True


def test_malformed_judges_file_names_the_field(tmp_path: Path) -> None:
    (tmp_path / "judges.yaml").write_text(
        "judges:\n  - name: j\n    harness: bash\n    prompt: p\n    budget: {max_turns: -1}\n"
        "    verdict_schema: {passed: boolean}\n"
    )
    result = judge(str(EXAMPLES / "rollout"), "--judges", str(tmp_path / "judges.yaml"))
    assert result.returncode == 2
    assert "budget.max_turns" in result.stderr
