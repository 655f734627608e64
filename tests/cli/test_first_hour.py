"""What a user reaches for in the first hour (issue 31): exec's output cap and units,
``exec --image``, ``rm ID``, did-you-mean on typos, ``judge --require``, full error text
below the judge table, and an ``--out`` that is not overwritten silently."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runtimes import RuntimeConfigError, resolve_runtime_config

from .cli import REPO, run

MiB = 1 << 20
EXAMPLES = REPO / "examples"


def _subprocess_at(root: Path, **fields: object) -> str:
    return json.dumps({"type": "subprocess", "root": str(root), **fields})


# ---------------------------------------------------------------------- exec output and units


def test_streamed_output_is_not_cut_at_64_mib() -> None:
    size = 64 * MiB + 4096
    result = subprocess.run(
        [sys.executable, "-m", "placement.cli", "exec", "--", "head", "-c", str(size), "/dev/zero"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) == size


def test_output_limit_takes_the_units_of_memory_in_the_cli_and_the_config(tmp_path: Path) -> None:
    result = run("exec", "--output-limit", "1KiB", "--", "head", "-c", "5000", "/dev/zero")
    assert result.returncode == 1
    assert len(result.stdout) == 1024
    assert "exceeded the limit of 1024 bytes" in result.stderr and "--output-limit" in result.stderr

    config = _subprocess_at(tmp_path, output_limit="2k")
    result = run("exec", "--runtime", config, "--", "head", "-c", "5000", "/dev/zero")
    assert (result.returncode, len(result.stdout)) == (1, 2048), result.stderr
    assert resolve_runtime_config({"type": "subprocess", "output_limit": "1GiB"}).output_limit == (
        1 << 30
    )
    assert resolve_runtime_config({"type": "subprocess", "output_limit": 1000}).output_limit == 1000

    bad = run("exec", "--output-limit", "1.5b", "--", "true")
    assert bad.returncode == 2 and "whole number of bytes" in bad.stderr


def test_exec_image_sets_the_image_or_is_refused_by_a_backend_without_one() -> None:
    from runtimes.cli.exec import with_image

    docker = with_image(resolve_runtime_config({"type": "docker", "memory": "1GiB"}), "alpine:3")
    assert (docker.type, getattr(docker, "image", None), docker.memory) == (
        "docker",
        "alpine:3",
        1024,
    )
    with pytest.raises(RuntimeConfigError, match="has no image"):
        with_image(resolve_runtime_config("subprocess"), "alpine:3")
    result = run("exec", "--image", "alpine:3", "--", "true")
    assert result.returncode == 2
    assert "--image: the 'subprocess' backend's config has no image" in result.stderr


# ---------------------------------------------------------------------- rm


def test_rm_removes_a_kept_sandbox_by_id_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    config = _subprocess_at(tmp_path)
    kept = run("exec", "--keep", "--runtime", config, "--", "sh", "-c", "echo x > f")
    assert kept.returncode == 0, kept.stderr
    listed = json.loads(run("ls", "--json", "--runtime", config).stdout)
    (sandbox_id,) = [s["id"] for s in listed["sandboxes"]]
    assert (tmp_path / sandbox_id).is_dir()

    removed = run("rm", sandbox_id, "--runtime", config)
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout == f"removed subprocess {sandbox_id}\n"
    assert not (tmp_path / sandbox_id).exists()

    again = run("rm", sandbox_id, "sbx-nosuch", "--runtime", config)
    assert again.returncode == 1
    assert again.stderr.count("SandboxUnavailableError") == 2 and "sbx-nosuch" in again.stderr
    assert "Traceback" not in again.stderr


# ---------------------------------------------------------------------- did you mean


def test_typos_in_a_backend_name_or_a_config_key_suggest_the_right_one() -> None:
    result = run("exec", "--runtime", "subproces", "--", "true")
    assert result.returncode == 2
    assert "unknown runtime type 'subproces'; did you mean subprocess?" in result.stderr
    result = run("exec", "--runtime", '{"type": "subprocess", "outptu_limit": 5}', "--", "true")
    assert result.returncode == 2
    assert "outptu_limit: Extra inputs are not permitted; did you mean output_limit" in (
        result.stderr
    )


def test_a_typo_in_a_judges_file_key_suggests_the_field(tmp_path: Path) -> None:
    from placement.errors import PlacementConfigError
    from placement.specs import load_judges

    judges = {"judges": [{"name": "g", "harness": "null", "model": "m", "promt": "p"}]}
    (tmp_path / "judges.yaml").write_text(yaml.safe_dump(judges))
    with pytest.raises(PlacementConfigError) as caught:
        load_judges(tmp_path / "judges.yaml")
    assert "promt: Extra inputs are not permitted; did you mean prompt?" in str(caught.value)


# ---------------------------------------------------------------------- judge


def _one_judge(tmp_path: Path, reply: str) -> list[str]:
    judges = {
        "judges": [
            {
                "name": "grader",
                "harness": "null",
                "model": "my-grader",
                "prompt": "Grade it.",
                "verdict_schema": {"passed": "boolean", "score": "number"},
            }
        ]
    }
    (tmp_path / "judges.yaml").write_text(yaml.safe_dump(judges))
    (tmp_path / "scripted.json").write_text(json.dumps({"grader": [{"content": reply}]}))
    return [
        str(EXAMPLES / "rollout"),
        "--judges", str(tmp_path / "judges.yaml"),
        "--scripted", str(tmp_path / "scripted.json"),
    ]  # fmt: skip


def judge(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    return subprocess.run(
        [sys.executable, "-m", "placement.cli", "judge", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_judge_require_sets_the_exit_status_for_ci(tmp_path: Path) -> None:
    base = _one_judge(tmp_path, '{"passed": true, "score": 0.4}')
    out = str(tmp_path / "runs.json")
    met = judge(*base, "--out", out, "--require", "passed==true", "--require", "score>0.3")
    assert met.returncode == 0, met.stdout + met.stderr

    unmet = judge(*base, "--out", out, "--force", "--require", "grader:score>=0.5", "--json")
    assert unmet.returncode == 3, unmet.stderr
    document = json.loads(unmet.stdout)
    assert document["unmet"] == [
        {"requirement": "grader:score>=0.5", "judge": "grader", "reason": "score is 0.4"}
    ]

    typo = judge(*base, "--out", out, "--force", "--require", "grade:passed==true")
    assert typo.returncode == 2 and "did you mean grader?" in typo.stderr
    malformed = judge(*base, "--out", out, "--force", "--require", "score=>0.5")
    assert malformed.returncode == 2 and "[JUDGE:]FIELD OP VALUE" in malformed.stderr


def test_judge_out_is_not_overwritten_silently_and_records_the_logical_model(
    tmp_path: Path,
) -> None:
    base = _one_judge(tmp_path, '{"passed": true, "score": 1}')
    out = tmp_path / "runs.json"
    first = judge(*base, "--out", str(out))
    assert first.returncode == 0, first.stdout + first.stderr
    [record] = json.loads(out.read_text())
    assert record["model"] == "my-grader" and record["endpoint_model"] == "scripted-model"

    out.write_text("[] # earlier results")
    again = judge(*base, "--out", str(out))
    assert again.returncode == 2
    assert "exists: pass --force" in again.stderr
    assert out.read_text() == "[] # earlier results"
    forced = judge(*base, "--out", str(out), "--force")
    assert forced.returncode == 0 and json.loads(out.read_text())[0]["name"] == "grader"


def test_judge_table_shows_the_whole_error_naming_the_missing_variable(tmp_path: Path) -> None:
    base = _one_judge(tmp_path, "{}")[:3]  # no --scripted: a model table instead
    variable = "VF_SANDBOX_KEY_OF_A_GRADER_THAT_NOBODY_HAS_SET_ANYWHERE"
    table = {"models": {"my-grader": {"base_url": "http://127.0.0.1:9/v1", "model": "m",
                                      "api_key_env": variable}}}  # fmt: skip
    (tmp_path / "models.yaml").write_text(yaml.safe_dump(table))
    result = judge(*base, "--models", str(tmp_path / "models.yaml"), "--out", str(tmp_path / "o"))
    assert result.returncode == 1
    row = next(line for line in result.stdout.splitlines() if line.startswith("grader "))
    assert variable not in row and row.endswith("…")  # the table cuts it ...
    assert "\nerrors:\n" in result.stdout
    assert f"environment variable {variable}" in result.stdout  # ... and prints it whole below
