"""Running ``vf-sandbox`` as users do: a child process, its streams and exit status."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "runtimes.cli"]


def run(
    *args: str, stdin: bytes | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """The CLI to completion. stdin is /dev/null unless given: an inherited pipe that never
    closes would make ``exec`` wait for its end."""
    return subprocess.run(
        [*CLI, *args],
        input=stdin.decode() if stdin is not None else None,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def run_json(*args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    result = run(*args, "--json")
    document: dict[str, Any] = json.loads(result.stdout)
    return result, document


def ctrl_c_as_at_a_terminal() -> None:
    # A suite started in the background by a non-interactive shell (`make test &`) runs with
    # SIGINT ignored, and a child inherits that; a user's CLI at a terminal does not.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args: str) -> subprocess.Popen[bytes]:
    """The CLI in the background, with piped unbuffered output to read as it comes, and
    Ctrl-C (SIGINT) delivered as at a terminal."""
    return subprocess.Popen(
        [*CLI, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )


def read_until(proc: subprocess.Popen[bytes], needle: bytes, deadline: float) -> dict[str, bytes]:
    """Read both pipes incrementally until stdout holds ``needle`` or ``deadline`` seconds
    pass; returns what each stream delivered so far (empty dict entries if nothing)."""
    assert proc.stdout is not None and proc.stderr is not None
    got = {"stdout": b"", "stderr": b""}
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    end = time.monotonic() + deadline
    try:
        while needle not in got["stdout"] and (left := end - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                got[key.data] += chunk
            if not sel.get_map():
                break
    finally:
        sel.close()
    return got


def finish(proc: subprocess.Popen[bytes], timeout: float = 60) -> tuple[int, bytes, bytes]:
    """Exit status and the rest of both streams; the child is killed if it hangs."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"vf-sandbox did not exit within {timeout}s: {err!r}") from None
    return proc.returncode, out, err
