"""The `vf-sandbox` command: check, cleanup, doctor, exec — run as users run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from runtimes.testing import CHECKS

CLI = [sys.executable, "-m", "placement.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=600)


def test_check_prints_a_table_and_passes_on_the_plugin() -> None:
    result = run("check", "--runtime", "echo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"echo: {len(CHECKS) - 2} passed, 0 failed, 2 skipped" in result.stdout
    assert "stdout_exact" in result.stdout and "PASS" in result.stdout


def test_check_accepts_json_and_reports_failures_with_exit_code(tmp_path: Path) -> None:
    # A 1-byte output cap makes output checks fail: the command must say so, not pass.
    config = json.dumps({"type": "subprocess", "output_limit": 1, "root": str(tmp_path)})
    result = run("check", "--runtime", config, "--select", "stdout_exact")
    assert result.returncode == 1
    assert "FAIL" in result.stdout and "OutputLimitExceededError" in result.stdout


def test_broken_plugin_gives_a_clear_error_naming_the_package() -> None:
    result = run("check", "--runtime", "broken")
    assert result.returncode == 2
    assert "RuntimePluginError" in result.stderr and "vf-sandbox-broken" in result.stderr


def test_malformed_runtime_config_names_the_field() -> None:
    result = run("exec", "--runtime", '{"type": "subprocess", "output_limit": -5}', "--", "true")
    assert result.returncode == 2
    assert "output_limit" in result.stderr


def test_exec_passes_output_and_exit_code_through() -> None:
    result = run("exec", "--", "sh", "-c", "printf out; printf err >&2; exit 7")
    assert (result.returncode, result.stdout, result.stderr) == (7, "out", "err")


def test_doctor_lists_every_backend_and_survives_the_broken_one() -> None:
    result = run("doctor", "--timeout", "30")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[2:] if line.strip()}
    assert "ok" in lines["subprocess"] and "ok" in lines["echo"]
    assert "unavailable" in lines["broken"] and "vf-sandbox-broken" in lines["broken"]


def test_cleanup_dry_run_reports_and_removes_nothing(tmp_path: Path) -> None:
    leaked = tmp_path / "sbx-leaked"
    (leaked / "work").mkdir(parents=True)
    labels = {"vf-sandbox.session": "gone", "vf-sandbox.host": "elsewhere"}
    (leaked / "meta.json").write_text(json.dumps({"labels": labels}))
    config = json.dumps({"type": "subprocess", "root": str(tmp_path)})
    dry = run("cleanup", "--runtime", config, "--all", "--dry-run")
    assert dry.returncode == 0 and "would remove" in dry.stdout
    assert leaked.exists()
    real = run("cleanup", "--runtime", config, "--all")
    assert real.returncode == 0 and "1 removed" in real.stdout
    assert not leaked.exists()
