"""Attack class 20: terminal control sequences in what the ``vf-sandbox`` command prints.

A policy that can put text where the CLI quotes it (a sandbox's labels, an install's stderr in
an error, a judge's failure, a check's detail, a backend's warning) writes terminal sequences:
``ESC ]0;...BEL`` retitles the window, ``ESC [2J`` clears the report, ``\\r`` rewinds a line so
a forged one covers the real one. Every such message comes out with its control characters
escaped (``\\x1b``), printable text unchanged. ``vf-sandbox exec``'s own output is the command's
stdout and stays byte-exact, as docs/cli.md says.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from harnesses.errors import HarnessInstallError
from placement.cli import main, print_judge_report
from runtimes import open_runtime
from runtimes.cli import check as cli_check
from runtimes.cli import exec as cli_exec
from runtimes.terminal import terminal_safe
from runtimes.testing import CheckOutcome
from tests.cli.cli import run

from .conftest import Hostile

HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x1b[1;1Hverdict: PASSED\rok\x9b31m\x7f\u202edesrever\udcff"
ESCAPED = (
    "\\x1b]0;pwned\\x07\\x1b[2J\\x1b[1;1Hverdict: PASSED\\x0dok\\x9b31m\\x7f\\u202edesrever\\xff"
)


def assert_inert(text: str) -> None:
    """No control character but newline and tab, no bidi override, reaches the terminal."""
    bad = [c for c in text if (ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0]
    assert not bad and "\u202e" not in text, f"control characters reached the terminal: {bad!r}"


@pytest.mark.attack(20)
def test_terminal_safe_escapes_every_control_and_keeps_text() -> None:
    assert terminal_safe(HOSTILE) == ESCAPED
    assert terminal_safe("two\nlines\tand ünïcödé ✓") == "two\nlines\tand ünïcödé ✓"
    assert_inert(terminal_safe("".join(map(chr, range(0x100))) + "\u2028\u2066"))


@pytest.mark.anyio
@pytest.mark.attack(20)
@pytest.mark.parametrize("hostile", ["subprocess"], indirect=True)
async def test_labels_a_policy_rewrote_are_listed_escaped(hostile: Hostile, tmp_path: Path) -> None:
    """On the subprocess backend the policy is the host user and can rewrite its sandbox's
    ``meta.json``: ``vf-sandbox ls -v`` prints its labels escaped; ``--json`` stays exact."""
    config = {**hostile.config, "root": str(tmp_path)}
    rewrite = (
        "import json, sys; m = json.load(open('../meta.json')); "
        "m['labels']['note'] = sys.argv[1]; json.dump(m, open('../meta.json', 'w'))"
    )
    async with open_runtime(config) as rt:
        done = await rt.exec(["python3", "-c", rewrite, HOSTILE.replace("\udcff", "")])
        assert done.exit_code == 0, done.stderr
        target = json.dumps(config)
        listed = await anyio.to_thread.run_sync(lambda: run("ls", "-v", "--runtime", target))
        as_json = await anyio.to_thread.run_sync(lambda: run("ls", "--json", "--runtime", target))
    assert listed.returncode == 0, listed.stderr
    assert rt.sandbox_id is not None and rt.sandbox_id in listed.stdout
    assert ESCAPED.replace("\\xff", "") in listed.stdout
    assert_inert(listed.stdout)
    assert_inert(as_json.stdout)
    [sandbox] = json.loads(as_json.stdout)["sandboxes"]
    assert sandbox["labels"]["note"] == HOSTILE.replace("\udcff", "")


@pytest.mark.attack(20)
def test_an_error_quoting_an_installs_stderr_is_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def failing_install(*_: Any) -> int:
        raise HarnessInstallError(f"installing mini-swe-agent failed (exit 1):\n{HOSTILE}")

    monkeypatch.setattr(cli_exec, "run_exec", failing_install)
    code = main(["exec", "--runtime", "subprocess", "--", "true"])
    err = capsys.readouterr().err
    assert code == 1
    said = "vf-sandbox: HarnessInstallError: installing mini-swe-agent failed (exit 1):"
    assert err == f"{said}\n{ESCAPED}\n"


@pytest.mark.attack(20)
def test_a_judges_failure_and_verdict_are_printed_escaped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run_ = SimpleNamespace(
        name="test-runner",
        placement="rollout",
        verdict={"passed": True, "reason": HOSTILE.replace("\udcff", "")},
        error_type="JudgeAgentFailed",
        error=f"the harness raised: {HOSTILE}",
        ok=False,
        seconds=1.0,
    )
    for verbose in (False, True):
        args = argparse.Namespace(json=False, verbose=verbose, rollout="r", out="o")
        print_judge_report(args, "subprocess", [run_])
        out = capsys.readouterr().out
        assert_inert(out)
        assert "the harness raised: \\x1b]0;pwned\\x07" in out
    print_judge_report(argparse.Namespace(json=True, rollout="r", out="o"), "subprocess", [run_])
    out = capsys.readouterr().out
    assert_inert(out)
    assert json.loads(out)["runs"][0]["error"] == run_.error


@pytest.mark.attack(20)
def test_a_checks_failure_detail_is_printed_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A conformance check that fails quotes what the sandbox answered."""

    def failed(chk: Any, config: Any, backend: str) -> CheckOutcome:
        return CheckOutcome(chk.name, "fail", f"AssertionError: got {HOSTILE}", 0.1)

    monkeypatch.setattr(cli_check, "run_one", failed)
    for verbose in ([], ["-v"]):
        code = main(["check", "--runtime", "subprocess", "--select", "stdout_exact", *verbose])
        out = capsys.readouterr().out
        assert code == 1 and "FAIL" in out
        assert_inert(out)
        assert "got \\x1b]0;pwned\\x07" in out


@pytest.mark.attack(20)
def test_a_backends_warning_reaches_stderr_escaped() -> None:
    """Warnings that no handler takes (Python prints them raw) go through the CLI's own."""
    code = (
        "import logging, sys; from runtimes.cli.output import terminal_safe_logging; "
        "terminal_safe_logging(); logging.getLogger('runtimes.x').warning('%s', sys.argv[1])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, HOSTILE.replace("\udcff", "")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stderr == ESCAPED.replace("\\xff", "") + "\n"


@pytest.mark.attack(20)
def test_exec_passes_the_commands_own_output_through_byte_exact() -> None:
    """The documented exception: what ``exec`` runs prints what it prints (piped or not)."""
    done = subprocess.run(
        [
            *cli_argv(),
            "exec",
            "--runtime",
            "subprocess",
            "--",
            "printf",
            "\\033[2J\\r\\033]0;t\\007",
        ],
        capture_output=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"\x1b[2J\r\x1b]0;t\x07"


def cli_argv() -> list[str]:
    return [sys.executable, "-m", "placement.cli"]
