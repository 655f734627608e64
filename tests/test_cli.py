"""The `vf-sandbox` command: check and config errors, run as users run them.

exec, --json, doctor, ls and cleanup have their own modules under tests/cli/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "runtimes.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL
    )


# The whole kit runs on the echo plugin in tests/conformance/test_plugin.py; here, what the
# command prints and returns, on a selection that includes the two checks a root sandbox skips.
CLI_SELECTION = [
    "stdout_exact",
    "exit_codes",
    "unreadable_file",
    "unwritable_directory",
    "shell_pty",
]


def test_check_prints_a_table_and_passes_on_the_plugin() -> None:
    selection = [arg for name in CLI_SELECTION for arg in ("--select", name)]
    result = run("check", "--runtime", "echo", *selection)
    assert result.returncode == 0, result.stdout + result.stderr
    skipped = 2 if os.geteuid() == 0 else 0
    summary = f"echo: {len(CLI_SELECTION) - skipped} passed, 0 failed, {skipped} skipped"
    assert summary in result.stdout, result.stdout
    assert "stdout_exact" in result.stdout and "PASS" in result.stdout


def test_check_accepts_json_and_reports_failures_with_exit_code(tmp_path: Path) -> None:
    # A 1-byte output cap makes output checks fail: the command must say so, not pass.
    config = json.dumps({"type": "subprocess", "output_limit": 1, "root": str(tmp_path)})
    result = run("check", "--runtime", config, "--select", "stdout_exact")
    assert result.returncode == 1
    assert "FAIL" in result.stdout and "OutputLimitExceededError" in result.stdout


def test_broken_plugin_gives_a_clear_error_naming_the_package() -> None:
    # Not a usage error (the name is right, the installed plugin is broken): exit 1.
    result = run("check", "--runtime", "broken")
    assert result.returncode == 1
    assert "RuntimePluginError" in result.stderr and "vf-sandbox-broken" in result.stderr
    assert "Traceback" not in result.stderr


def test_malformed_runtime_config_names_the_field() -> None:
    result = run("exec", "--runtime", '{"type": "subprocess", "output_limit": -5}', "--", "true")
    assert result.returncode == 2
    assert "output_limit" in result.stderr
