"""Leaks: a process holding sandboxes, warm pools and snapshots on every local backend is
SIGKILLed; the real ``vf-sandbox cleanup`` then leaves zero sandboxes, zero snapshots and
zero processes behind.

Backends: subprocess (directories under the default root, processes on this host),
docker (labelled containers and images), ssh (directories on the remote host, processes
there) and modal (the fake Modal service, whose containers play the sandboxes and whose
images and Dict records play the snapshots; its CLI run is ``placement.cli.main`` with the
fake SDK swapped in, see ``fake_modal_cli.py``).

Per backend the child (``leak_child.py``) holds :data:`PER_BACKEND` plain sandboxes, a
``RuntimePool(size=1)`` with one sandbox handed out and one idle in stock, and one snapshot
(not kept) of a plain sandbox. What is still there is looked up where each backend keeps it
(:func:`_left`), not through vf-sandbox's own listing, which is checked on its own
(:func:`_listed`): a listing that missed something would otherwise hide it from both the
sweep and the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import docker.errors
import pytest
from modal.exception import NotFoundError

from runtimes import ownership
from runtimes.cleanup import cleanup_sandboxes, list_target
from runtimes.pool import POOL
from runtimes.registry import resolve_runtime_config
from runtimes.subprocess import default_root
from tests.modal.fake_modal import FAKE_LABEL, FakeModalService
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures
from tests.processes import running_anywhere
from tests.ssh.sshd import SSHServer

from .conftest import REPO, TALLY, session_containers, token

pytestmark = [pytest.mark.docker, pytest.mark.ssh]

PER_BACKEND = 2
"""Plain sandboxes per backend (besides the pool's two)."""


@dataclass
class _Held:
    """What the child held on one backend at the kill."""

    plain: set[str]
    pool: str
    held: str
    snapshot: str
    stock: set[str] = field(default_factory=set)
    """The pool's idle sandboxes: found by the pool label after the kill."""

    @property
    def sandboxes(self) -> set[str]:
        return self.plain | {self.held} | self.stock


def _cli(*args: str, fake_state: Path | None = None) -> subprocess.CompletedProcess[str]:
    if fake_state is None:
        argv = [sys.executable, "-m", "placement.cli", *args]
    else:
        argv = [sys.executable, "-m", "tests.reliability.fake_modal_cli", str(fake_state), *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=180)


def _remote_processes(server: SSHServer, mark: str) -> list[str]:
    listing = server.docker_exec("ps -eo pid,args")
    return [line for line in listing.splitlines() if f"sleep {mark}" in line]


def _remote_dirs(server: SSHServer) -> set[str]:
    listing = server.docker_exec("ls -d /tmp/vf-sandbox.* 2>/dev/null || true")
    return set(listing.split())


def _remote_exists(server: SSHServer, path: str) -> bool:
    return server.docker_exec(f"if [ -e '{path}' ]; then echo yes; fi").strip() == "yes"


def _start_child(
    configs: list[dict[str, Any]], mark: str, state: Path
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.reliability.leak_child",
            json.dumps(configs),
            str(PER_BACKEND),
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


@dataclass
class _Listing:
    """What vf-sandbox's own listing shows of one session on one backend."""

    sandboxes: dict[str, dict[str, str]]
    """id -> labels."""
    snapshots: set[str]


async def _list_backend(config: dict[str, Any], session: str) -> _Listing:
    cls, cfg, infos = await list_target(resolve_runtime_config(config))
    snapshots = await cls.list_snapshots(cfg)
    return _Listing(
        {i.id: dict(i.labels) for i in infos if i.labels.get(ownership.CREATOR) == session},
        {s.id for s in snapshots if s.labels.get(ownership.CREATOR) == session},
    )


def _listed(configs: dict[str, dict[str, Any]], session: str) -> dict[str, _Listing]:
    """``list_sandboxes`` / ``list_snapshots`` of every backend (what ``ls`` and ``cleanup``
    read), narrowed to ``session``."""

    async def list_all() -> dict[str, _Listing]:
        return {name: await _list_backend(config, session) for name, config in configs.items()}

    return anyio.run(list_all)


def _left(
    held: dict[str, _Held],
    server: SSHServer,
    fake: FakeModalService,
    client: Any,
    session: str,
) -> dict[str, list[str]]:
    """What of the child's is still there, per backend and kind, looked up where each
    backend keeps it: directories, containers, images, remote directories, the fake's
    sandbox records and images."""
    root = Path(default_root())
    local, docker_, ssh, modal = (held[b] for b in ("subprocess", "docker", "ssh", "modal"))
    containers = {c.id for c in session_containers(client, session)}
    remote = _remote_dirs(server)
    modal_running = {
        c.labels.get("fake-modal.sandbox-id")
        for c in client.containers.list(filters={"label": f"{FAKE_LABEL}={fake.state_dir}"})
    }
    return {
        "subprocess sandboxes": sorted(s for s in local.sandboxes if (root / s).exists()),
        "subprocess snapshot": [s for s in [local.snapshot] if Path(s).exists()],
        "docker sandboxes": sorted(containers),  # every container of the session
        "docker snapshot": [s for s in [docker_.snapshot] if _image_exists(client, s)],
        "ssh sandboxes": sorted(ssh.sandboxes & remote),
        "ssh snapshot": [s for s in [ssh.snapshot] if _remote_exists(server, s)],
        "modal sandboxes": sorted(
            s for s in modal.sandboxes if fake.load(s).status is None or s in modal_running
        ),
        "modal snapshot": [s for s in [modal.snapshot] if _fake_image_exists(fake, client, s)],
    }


def _image_exists(client: Any, image_id: str) -> bool:
    try:
        client.images.get(image_id)
    except docker.errors.ImageNotFound:
        return False
    return True


def _fake_image_exists(fake: FakeModalService, client: Any, image_id: str) -> bool:
    """Registered with the fake service, or its Docker image still on the engine."""
    try:
        fake.snapshot_image(image_id)
    except NotFoundError:
        images = client.images.list(filters={"label": f"fake-modal.image-id={image_id}"})
        return bool(images)
    return True


def _everything(held: dict[str, _Held]) -> dict[str, list[str]]:
    return {
        key: sorted(held[backend].sandboxes) if kind == "sandboxes" else [held[backend].snapshot]
        for backend in held
        for kind in ("sandboxes", "snapshot")
        for key in [f"{backend} {kind}"]
    }


def _removed(run: subprocess.CompletedProcess[str]) -> dict[str, set[str]]:
    """The ids ``cleanup --json`` says it removed: sandboxes and snapshots."""
    document = json.loads(run.stdout)
    return {
        "sandboxes": {r["id"] for r in document["results"] if r["action"] == "removed"},
        "snapshots": {r["id"] for r in document["snapshots"] if r["action"] == "removed"},
    }


def _kill(child: subprocess.Popen[str]) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)  # reaped: its pid is gone, so its session is dead


def _find_stock(held: dict[str, _Held], listed: dict[str, _Listing]) -> None:
    """Fill in each pool's idle sandboxes from the listing: the sandboxes carrying the pool
    label, but the held one (a pool of size 1: exactly one)."""
    for backend, listing in listed.items():
        pooled = {s for s, labels in listing.sandboxes.items() if labels.get(POOL)}
        pools = {listing.sandboxes[s][POOL] for s in pooled}
        assert pools == {held[backend].pool}, (backend, pools)
        assert held[backend].held in pooled and len(pooled) == 2, (backend, "held + 1 idle")
        held[backend].stock = pooled - {held[backend].held}


def _sweep_after_failure(configs: dict[str, dict[str, Any]], session: str) -> None:
    """A failed test leaves the dead session's leftovers: remove them (in this process)."""
    targets = [resolve_runtime_config(config) for config in configs.values()]
    match = {ownership.CREATOR: session}
    anyio.run(lambda: cleanup_sandboxes(targets, match=match))


def test_sigkilled_session_is_swept_by_the_cli_on_every_backend(
    shared_sshd: SSHServer,
    fake_service: FakeModalService,  # noqa: F811
    fake_modal: types.ModuleType,  # noqa: F811
    docker_client: Any,
) -> None:
    ssh = {**shared_sshd.config().model_dump(mode="json"), "password": None}
    modal = fake_config()
    configs = {"subprocess": {"type": "subprocess"}, "docker": {"type": "docker"}}
    configs |= {"ssh": ssh, "modal": modal}
    mark = token()
    child, report = _start_child(list(configs.values()), mark, fake_service.state_dir)
    _kill(child)
    session = report["session"]
    try:
        _check_swept(configs, report, mark, shared_sshd, fake_service, docker_client)
    except BaseException:
        _sweep_after_failure(configs, session)
        raise


def _check_swept(
    configs: dict[str, dict[str, Any]],
    report: dict[str, Any],
    mark: str,
    server: SSHServer,
    fake: FakeModalService,
    client: Any,
) -> None:
    session = report["session"]
    held = {
        b["backend"]: _Held(set(b["sandboxes"]), b["pool"], b["held"], b["snapshot"])
        for b in report["backends"]
    }
    assert set(held) == set(configs), report

    # SIGKILL skipped every backstop: the listing shows everything, the pools' stock included.
    listed = _listed(configs, session)
    _find_stock(held, listed)
    for backend, listing in listed.items():
        assert set(listing.sandboxes) == held[backend].sandboxes, (backend, listing)
        assert listing.snapshots == {held[backend].snapshot}, (backend, listing)
    # ... and it is all really there, each where its backend keeps it.
    before = _left(held, server, fake, client, session)
    assert before == _everything(held)
    assert len(running_anywhere(f"sleep {mark}")) == (PER_BACKEND + 1) * len(held), "plain + held"
    assert len(_remote_processes(server, mark)) == PER_BACKEND + 1

    started = time.monotonic()
    runs = {
        backend: _cli(
            "cleanup",
            "--json",
            "--runtime",
            backend if config == {"type": backend} else json.dumps(config),
            fake_state=fake.state_dir if backend == "modal" else None,
        )
        for backend, config in configs.items()
    }
    seconds = time.monotonic() - started
    for backend, run in runs.items():
        assert run.returncode == 0, (backend, run.stdout, run.stderr)
        removed = _removed(run)
        assert held[backend].sandboxes <= removed["sandboxes"], (backend, run.stdout)
        assert held[backend].snapshot in removed["snapshots"], (backend, run.stdout)

    left = _left(held, server, fake, client, session)
    assert left == {key: [] for key in before}, left
    assert _listed(configs, session) == {b: _Listing({}, set()) for b in configs}
    processes = {
        "anywhere": running_anywhere(f"sleep {mark}"),
        "ssh host": _remote_processes(server, mark),
    }
    assert processes == {"anywhere": [], "ssh host": []}, processes
    sandboxes = sum(len(h.sandboxes) for h in held.values())
    TALLY.add("leaks: sandboxes SIGKILLed then swept", sandboxes)
    TALLY.add("leaks: pooled sandboxes among them", sum(1 + len(h.stock) for h in held.values()))
    TALLY.add("leaks: snapshots SIGKILLed then swept", len(held))
    TALLY.add("leaks: sandboxes and snapshots left after cleanup", sum(map(len, left.values())))
    print(f"\nleaks: {sandboxes} sandboxes, {len(held)} snapshots swept in {seconds:.1f}s, 0 left")
