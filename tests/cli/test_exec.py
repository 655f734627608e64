"""`vf-sandbox exec` on the subprocess runtime: shell conventions a user relies on."""

from __future__ import annotations

import json
import os
import pty
import random
import signal
import subprocess
import time
from pathlib import Path

from .cli import CLI, REPO, finish, read_until, run, start


def _sandbox_root(tmp_path: Path) -> str:
    return json.dumps({"type": "subprocess", "root": str(tmp_path)})


def test_only_the_first_separator_is_stripped() -> None:
    result = run("exec", "--", "printf", r"%s\n", "--")
    assert (result.returncode, result.stdout) == (0, "--\n"), result.stderr
    result = run("exec", "--", "sh", "-c", 'printf "%s," "$@"', "sh", "a", "--", "b")
    assert result.stdout == "a,--,b,", result.stderr


def test_piped_stdin_is_forwarded() -> None:
    result = run("exec", "--", "cat", stdin=b"hi\nthere\n")
    assert (result.returncode, result.stdout) == (0, "hi\nthere\n"), result.stderr


def test_exit_code_and_streams_pass_through() -> None:
    result = run("exec", "--", "sh", "-c", "printf out; printf err >&2; exit 7")
    assert (result.returncode, result.stdout, result.stderr) == (7, "out", "err")


def test_output_is_streamed_to_the_matching_stream_as_it_comes() -> None:
    proc = start("exec", "--", "sh", "-c", "echo first; sleep 6; echo second >&2")
    try:
        early = read_until(proc, b"first\n", deadline=5)
        assert early["stdout"] == b"first\n", early
        assert early["stderr"] == b"", "stderr line arrived before it was written"
        assert proc.poll() is None, "the first line only showed after the command ended"
    finally:
        code, out, err = finish(proc)
    assert (code, out, err) == (0, b"", b"second\n")


def test_env_cwd_and_user_reach_the_command(tmp_path: Path) -> None:
    result = run(
        "exec", "--env", "A=x=y", "--env", "B=", "--", "sh", "-c", 'printf "%s|%s" "$A" "$B"'
    )
    assert result.stdout == "x=y|", result.stderr
    result = run("exec", "--cwd", str(tmp_path), "--", "pwd")
    assert result.stdout == f"{tmp_path}\n", result.stderr
    # The tests run as root (the subprocess runtime can switch users).
    result = run("exec", "--user", "nobody", "--", "id", "-un")
    assert (result.returncode, result.stdout) == (0, "nobody\n"), result.stderr


def test_timeout_exits_124_after_printing_partial_output() -> None:
    started = time.monotonic()
    result = run("exec", "--timeout", "1", "--", "sh", "-c", "echo partial; sleep 60")
    assert result.returncode == 124, result.stderr
    assert result.stdout == "partial\n"
    assert "timed out after 1.0s" in result.stderr
    assert time.monotonic() - started < 30


def test_missing_program_exits_127_with_one_short_message() -> None:
    result = run("exec", "--", "nosuchprog")
    assert result.returncode == 127
    assert result.stderr == "vf-sandbox: nosuchprog: program not found\n"


def test_missing_cwd_is_not_a_missing_program() -> None:
    result = run("exec", "--cwd", "no-such-dir", "--", "true")
    assert result.returncode == 1, result.stderr
    assert "SandboxFileNotFoundError" in result.stderr and "no-such-dir" in result.stderr
    assert "program not found" not in result.stderr


def test_not_executable_exits_126(tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    script.chmod(0o644)
    result = run("exec", "--", str(script))
    assert result.returncode == 126, result.stderr
    assert result.stderr == f"vf-sandbox: {script}: permission denied (not executable)\n"


def test_usage_errors_exit_2_without_a_traceback() -> None:
    for args in (
        ["exec", "--env", "NOEQUALS", "--", "true"],
        ["exec", "--env", "=v", "--", "true"],
        ["exec", "--"],
        ["exec", "--runtime", "{not json", "--", "true"],
        ["exec", "--runtime", "no-such-backend", "--", "true"],
        ["exec", "--timeout", "soon", "--", "true"],
    ):
        result = run(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert "NOEQUALS" in run("exec", "--env", "NOEQUALS", "--", "true").stderr


def _processes_with(token: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if token in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_ctrl_c_exits_130_and_removes_the_sandbox(tmp_path: Path) -> None:
    token = f"{random.randint(300, 399)}.{random.randint(10**5, 10**6 - 1)}"
    proc = start(
        "exec", "--runtime", _sandbox_root(tmp_path), "--", "sh", "-c", f"echo ready; sleep {token}"
    )
    try:
        ready = read_until(proc, b"ready\n", deadline=60)
        assert ready["stdout"] == b"ready\n", ready
        assert _processes_with(f"sleep {token}"), "the command should be running"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("sbx-")], "no sandbox?"
        proc.send_signal(signal.SIGINT)
    finally:
        code, _, err = finish(proc)
    assert code == 130, err
    assert b"Traceback" not in err and err.strip() == b"vf-sandbox: interrupted"
    assert _processes_with(f"sleep {token}") == []
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("sbx-")] == []


def test_terminal_stdin_is_not_read() -> None:
    # With a terminal on stdin, reading it would wait for the user's Ctrl-D; the command
    # gets no stdin instead, so `cat` ends at once.
    primary, secondary = pty.openpty()
    try:
        result = subprocess.run(
            [*CLI, "exec", "--", "cat"], stdin=secondary, capture_output=True, timeout=60, cwd=REPO
        )
    finally:
        os.close(primary)
        os.close(secondary)
    assert (result.returncode, result.stdout) == (0, b""), result.stderr


def test_closed_stdout_exits_141_quietly_and_stops_the_command() -> None:
    # `vf-sandbox exec -- yes | head`: the reader goes away, as for a local command.
    token = f"vf-yes-{random.randrange(1 << 30)}"
    proc = start("exec", "--", "yes", token)
    assert proc.stdout is not None
    assert proc.stdout.read(len(token) + 1) == f"{token}\n".encode()
    proc.stdout.close()
    code, _, err = finish(proc)
    assert (code, err) == (141, b"")
    assert _processes_with(f"yes {token}") == []
