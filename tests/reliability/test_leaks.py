"""Leaks: a process holding sandboxes on every local backend is SIGKILLed; the real
``vf-sandbox cleanup`` then leaves zero sandboxes and zero processes behind.

Backends: subprocess (directories under the default root, processes on this host),
docker (labelled containers), ssh (directories on the remote host, processes there) and
modal (the fake Modal service, whose containers play the sandboxes; its CLI run is
``placement.cli.main`` with the fake SDK swapped in, see ``fake_modal_cli.py``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest

from runtimes import ownership
from runtimes.subprocess import default_root
from tests.modal.fake_modal import FakeModalService
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures
from tests.ssh.sshd import SSHServer

from .conftest import REPO, TALLY, session_containers, token

pytestmark = [pytest.mark.docker, pytest.mark.ssh]

PER_BACKEND = 2


def _cli(*args: str, fake_state: Path | None = None) -> subprocess.CompletedProcess[str]:
    if fake_state is None:
        argv = [sys.executable, "-m", "placement.cli", *args]
    else:
        argv = [sys.executable, "-m", "tests.reliability.fake_modal_cli", str(fake_state), *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)


def _processes_anywhere(mark: str) -> list[str]:
    """``sleep <mark>`` processes on this kernel: the host's and every container's."""
    found = subprocess.run(["pgrep", "-af", f"sleep {mark}"], capture_output=True, text=True)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]


def _remote_processes(server: SSHServer, mark: str) -> list[str]:
    listing = server.docker_exec("ps -eo pid,args")
    return [line for line in listing.splitlines() if f"sleep {mark}" in line]


def _remote_dirs(server: SSHServer) -> set[str]:
    listing = server.docker_exec("ls -d /tmp/vf-sandbox.* 2>/dev/null || true")
    return set(listing.split())


def _start_child(
    configs: list[dict[str, Any]], mark: str, state: Path
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.reliability.leak_child",
            json.dumps(configs),
            mark,
            str(state),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.kill()
        _, err = child.communicate(timeout=30)
        raise AssertionError(f"the child failed to open its sandboxes: {err[-3000:]}")
    return child, json.loads(line)


def test_sigkilled_session_is_swept_by_the_cli_on_every_backend(
    shared_sshd: SSHServer,
    fake_service: FakeModalService,  # noqa: F811
    fake_modal: types.ModuleType,  # noqa: F811
    docker_client: Any,
) -> None:
    ssh = {**shared_sshd.config().model_dump(mode="json"), "password": None}
    modal = fake_config()
    configs = [
        *({"type": "subprocess"} for _ in range(PER_BACKEND)),
        *({"type": "docker"} for _ in range(PER_BACKEND)),
        *(ssh for _ in range(PER_BACKEND)),
        *(modal for _ in range(PER_BACKEND)),
    ]
    mark = token()
    child, opened = _start_child(configs, mark, fake_service.state_dir)
    ids: dict[str, set[str]] = {}
    for entry in opened["sandboxes"]:
        ids.setdefault(entry["backend"], set()).add(entry["id"])
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)  # reaped: its pid is gone, so its session is dead

    # SIGKILL skipped every backstop: everything is still there.
    root = Path(default_root())
    assert all((root / sid).is_dir() for sid in ids["subprocess"])
    assert len(_processes_anywhere(mark)) == PER_BACKEND * len(ids), "one per sandbox"
    assert len(session_containers(docker_client, opened["session"])) == PER_BACKEND
    assert ids["ssh"] <= _remote_dirs(shared_sshd)
    assert len(_remote_processes(shared_sshd, mark)) == PER_BACKEND
    assert all(fake_service.load(sid).status is None for sid in ids["modal"])

    started = time.monotonic()
    runs = {
        "subprocess": _cli("cleanup", "--runtime", "subprocess"),
        "docker": _cli("cleanup", "--runtime", "docker"),
        "ssh": _cli("cleanup", "--runtime", json.dumps(ssh)),
        "modal": _cli("cleanup", "--runtime", json.dumps(modal), fake_state=fake_service.state_dir),
    }
    seconds = time.monotonic() - started
    for backend, run in runs.items():
        assert run.returncode == 0, (backend, run.stdout, run.stderr)
        removed = [line for line in run.stdout.splitlines() if " removed " in f" {line} "]
        assert len(removed) >= PER_BACKEND, (backend, run.stdout)

    leaked = {
        "subprocess": [sid for sid in ids["subprocess"] if (root / sid).exists()],
        "docker": session_containers(docker_client, opened["session"]),
        "ssh": sorted(ids["ssh"] & _remote_dirs(shared_sshd)),
        "modal": [sid for sid in ids["modal"] if fake_service.load(sid).status != "terminated"],
    }
    assert leaked == {"subprocess": [], "docker": [], "ssh": [], "modal": []}, leaked
    processes = {
        "anywhere": _processes_anywhere(mark),
        "ssh host": _remote_processes(shared_sshd, mark),
    }
    assert processes == {"anywhere": [], "ssh host": []}, processes
    assert not any(
        c.labels.get(ownership.SESSION) == opened["session"]
        for c in fake_service.docker.containers.list(filters={"status": "running"})
    ), "the fake Modal service still runs a sandbox of the dead session"
    TALLY.add("leaks: sandboxes SIGKILLed then swept", sum(len(v) for v in ids.values()))
    TALLY.add("leaks: sandboxes left after cleanup", sum(len(v) for v in leaked.values()))
    print(f"\nleaks: {sum(len(v) for v in ids.values())} sandboxes swept in {seconds:.1f}s, 0 left")
