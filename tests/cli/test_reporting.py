"""`--json`, `-v`, `check --list/--select`, `doctor`, `--version` and help, run as users do."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest

from runtimes.cli import build_parser
from runtimes.testing import CHECKS

from .cli import REPO, finish, run, run_json, start

HEADER = {"command", "schema_version", "vf_sandbox_version"}


def _header_ok(document: dict[str, object], command: str) -> None:
    assert document.keys() >= HEADER
    assert document["command"] == command and document["schema_version"] == 1
    assert document["vf_sandbox_version"] == version("vf-sandbox")


# ---------------------------------------------------------------------- version, help


def test_version_is_the_installed_distributions() -> None:
    result = run("--version")
    assert (result.returncode, result.stdout) == (0, f"vf-sandbox {version('vf-sandbox')}\n")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


def test_every_option_and_positional_has_help() -> None:
    parser = build_parser()
    parsers = {"vf-sandbox": parser, **_subparsers(parser)}
    missing = [
        f"{name} {action.dest}"
        for name, sub in parsers.items()
        for action in sub._actions
        if not action.help
    ]
    assert missing == []


def test_help_is_plain_text() -> None:
    top = run("--help")
    assert top.returncode == 0
    assert "``" not in top.stdout and ":class:" not in top.stdout
    # RawDescriptionHelpFormatter keeps the command list's layout.
    assert "\n  check    the conformance suite against any backend\n" in top.stdout
    for name in _subparsers(build_parser()):
        text = run(name, "--help").stdout
        assert "``" not in text and ":func:" not in text, name


# ---------------------------------------------------------------------- check


def test_check_list_names_every_check() -> None:
    result = run("check", "--list")
    assert result.returncode == 0
    listed = [line.split()[0] for line in result.stdout.splitlines()[2:]]
    assert listed == [c.name for c in CHECKS]
    _, document = run_json("check", "--list")
    _header_ok(document, "check")
    assert [c["name"] for c in document["checks"]] == [c.name for c in CHECKS]


def test_unknown_select_is_a_usage_error_naming_it_and_close_names() -> None:
    result = run("check", "--runtime", "subprocess", "--select", "stdout_exakt")
    assert result.returncode == 2
    assert "unknown check 'stdout_exakt'" in result.stderr
    assert "did you mean stdout_exact" in result.stderr
    assert "passed" not in result.stdout


def test_check_without_runtime_or_list_is_a_usage_error() -> None:
    result = run("check")
    assert result.returncode == 2 and "--runtime" in result.stderr


def test_ctrl_c_stops_the_suite_and_closes_the_current_sandbox(tmp_path: Path) -> None:
    config = json.dumps({"type": "subprocess", "root": str(tmp_path)})
    proc = start("check", "--runtime", config)
    # A sandbox directory shows the suite is running (past the interpreter's start-up,
    # however loaded the machine); the whole suite takes about 10 s here.
    deadline = time.monotonic() + 120
    while not any(p.name.startswith("sbx-") for p in tmp_path.iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, "the suite never started"
        time.sleep(0.05)
    time.sleep(1)
    assert proc.poll() is None, "the suite ended before the test could interrupt it"
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc, timeout=60)
    assert (code, out) == (130, b""), err
    assert err.strip() == b"vf-sandbox: interrupted"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("sbx-")] == []


def test_check_json_reports_each_outcome(tmp_path: Path) -> None:
    config = json.dumps({"type": "subprocess", "output_limit": 1, "root": str(tmp_path)})
    result, document = run_json(
        "check", "--runtime", config, "--select", "stdout_exact", "--select", "exists"
    )
    assert result.returncode == 1
    _header_ok(document, "check")
    assert document["runtime"] == "subprocess" and document["backend"] == "asyncio"
    by_name = {c["name"]: c for c in document["checks"]}
    assert set(by_name) == {"stdout_exact", "exists"}
    assert set(by_name["exists"]) == {"name", "status", "seconds", "detail"}
    assert by_name["stdout_exact"]["status"] == "fail"
    assert "OutputLimitExceededError" in by_name["stdout_exact"]["detail"]
    assert document["summary"] == {"passed": 1, "failed": 1, "skipped": 0}


# ---------------------------------------------------------------------- doctor


def test_doctor_exit_code_follows_the_requested_backends() -> None:
    assert run("doctor", "--runtime", "subprocess").returncode == 0
    result, document = run_json("doctor", "--runtime", "subprocess", "--runtime", "broken")
    assert result.returncode == 1
    _header_ok(document, "doctor")
    assert document["requested"] == ["subprocess", "broken"]
    rows = {row["name"]: row for row in document["backends"]}
    assert set(rows["subprocess"]) == {"name", "package", "status", "detail", "seconds"}
    assert rows["subprocess"]["status"] == "ok"
    assert rows["broken"]["status"] == "unavailable"
    assert rows["broken"]["package"] == "vf-sandbox-broken"


def test_doctor_cuts_details_unless_verbose() -> None:
    # The broken plugin's error is longer than a table cell; its cause is at the end.
    short = run("doctor", "--runtime", "broken")
    line = next(x for x in short.stdout.splitlines() if x.startswith("broken"))
    assert line.endswith("…") and "missing native library" not in line
    full = run("doctor", "--runtime", "broken", "-v")
    assert "simulated import failure (missing native library)" in full.stdout


@pytest.fixture
def silent_listener() -> Iterator[socket.socket]:
    """A loopback socket that accepts connections and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener


@pytest.fixture
def silent_port(silent_listener: socket.socket) -> int:
    port: int = silent_listener.getsockname()[1]
    return port


def test_doctor_probes_in_parallel_within_its_timeout(silent_port: int) -> None:
    # An SSH server that never answers, with the backend's own timeout far away: only
    # the doctor's --timeout can end these probes, and four of them share one wait.
    hung = json.dumps(
        {
            "type": "ssh",
            "host": "127.0.0.1",
            "port": silent_port,
            "username": "u",
            "password": "p",
            "accept_unknown_host_key": True,
            "connect_timeout": 120,
        }
    )
    started = time.monotonic()
    result, document = run_json("doctor", "--timeout", "3", *["--runtime", hung] * 4)
    elapsed = time.monotonic() - started
    assert result.returncode == 1
    assert [row["detail"] for row in document["backends"]] == ["no answer within 3s"] * 4
    assert elapsed < 11.5, f"4 probes of 3 s took {elapsed:.1f}s: not in parallel"


def test_doctor_stops_at_ctrl_c(silent_listener: socket.socket) -> None:
    hung = json.dumps(
        {
            "type": "ssh",
            "host": "127.0.0.1",
            "port": silent_listener.getsockname()[1],
            "username": "u",
            "password": "p",
            "accept_unknown_host_key": True,
            "connect_timeout": 120,
        }
    )
    proc = start("doctor", "--timeout", "120", "--runtime", hung)
    # Once the probe has connected, the CLI is past its imports and waiting: Ctrl-C now is
    # the user's, not one that lands in the interpreter's start-up (a slow, loaded machine).
    silent_listener.settimeout(120)
    probe, _ = silent_listener.accept()
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    stopped = time.monotonic()
    code, out, err = finish(proc, timeout=30)
    assert (code, out) == (130, b""), err
    assert err.strip() == b"vf-sandbox: interrupted"
    assert time.monotonic() - stopped < 10
    probe.close()


def test_doctor_without_request_lists_every_backend_and_passes_if_one_works() -> None:
    result = run("doctor", "--timeout", "30")
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[2:] if line.strip()}
    assert "ok" in lines["subprocess"] and "ok" in lines["echo"]
    assert "unavailable" in lines["broken"] and "vf-sandbox-broken" in lines["broken"]


# ---------------------------------------------------------------------- ls, cleanup


def _leaked_sandbox(root: Path) -> Path:
    leaked = root / "sbx-leaked"
    (leaked / "work").mkdir(parents=True)
    labels = {"vf-sandbox.session": "gone", "vf-sandbox.host": "elsewhere"}
    (leaked / "meta.json").write_text(json.dumps({"labels": labels}))
    return leaked


def test_ls_json_lists_the_labelled_sandbox(tmp_path: Path) -> None:
    _leaked_sandbox(tmp_path)
    config = json.dumps({"type": "subprocess", "root": str(tmp_path)})
    result, document = run_json("ls", "--runtime", config, "--runtime", "broken")
    assert result.returncode == 0, result.stderr
    _header_ok(document, "ls")
    [sandbox] = document["sandboxes"]
    assert {"backend", "id", "state", "created", "session", "labels"} <= set(sandbox)
    assert (sandbox["backend"], sandbox["id"], sandbox["session"]) == (
        "subprocess",
        "sbx-leaked",
        "unknown",
    )
    assert sandbox["labels"]["vf-sandbox.session"] == "gone"
    [unlisted] = document["unlisted"]
    assert unlisted["backend"] == "broken" and "vf-sandbox-broken" in unlisted["error"]


def test_ls_names_a_backend_that_cannot_list_instead_of_showing_nothing() -> None:
    """The echo test plugin has no list_sandboxes: an empty table would read as "no leaks"."""
    result, document = run_json("ls", "--runtime", "echo")
    assert result.returncode == 0, result.stderr
    assert document["sandboxes"] == []
    [unlisted] = document["unlisted"]
    assert unlisted["backend"] == "echo"
    assert "does not implement list_sandboxes" in unlisted["error"]
    assert "echo: not listed" in result.stderr


def test_cleanup_dry_run_counts_would_remove_and_removes_nothing(tmp_path: Path) -> None:
    leaked = _leaked_sandbox(tmp_path)
    config = json.dumps({"type": "subprocess", "root": str(tmp_path)})
    dry = run("cleanup", "--runtime", config, "--all", "--dry-run")
    assert dry.returncode == 0 and "would remove" in dry.stdout
    assert "0 removed, 1 would remove, 0 failed, 0 kept" in dry.stdout
    result, document = run_json("cleanup", "--runtime", config, "--all", "--dry-run")
    _header_ok(document, "cleanup")
    assert document["dry_run"] is True
    assert document["results"] == [
        {"backend": "subprocess", "id": "sbx-leaked", "action": "would remove", "reason": "--all"}
    ]
    assert document["summary"]["would_remove"] == 1 and document["summary"]["removed"] == 0
    assert leaked.exists()
    result, document = run_json("cleanup", "--runtime", config, "--all")
    assert result.returncode == 0 and document["summary"]["removed"] == 1
    assert document["dry_run"] is False
    assert not leaked.exists()


# ---------------------------------------------------------------------- judge


def test_judge_json_reports_each_run(tmp_path: Path) -> None:
    examples = REPO / "examples"
    out = tmp_path / "runs.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable, "-m", "placement.cli", "judge", str(examples / "rollout"),
            "--judges", str(examples / "judges.yaml"),
            "--scripted", str(examples / "scripted.json"),
            "--out", str(out), "--json",
        ],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    _header_ok(document, "judge")
    assert document["out"] == str(out) and document["runtime"] == "subprocess"
    names = [r["name"] for r in document["runs"]]
    assert names == ["reply-grader", "test-runner", "transcript-auditor"]
    keys = {"name", "placement", "ok", "verdict", "error_type", "error", "seconds"}
    assert all(set(r) == keys for r in document["runs"])
    assert [r["name"] for r in json.loads(out.read_text())] == names
