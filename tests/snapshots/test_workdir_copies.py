"""Snapshots that copy the workdir (subprocess, SSH): owners survive the copy. Plus the subprocess
backend's lifecycle: the exit backstop, ``keep``, the CLI. (What a hostile workdir does to a
copy — planted links, a workdir swapped for a link, directories swapped during the copy — is
played by the attack suite: ``tests/security/test_snapshot_attacks.py``.)"""

from __future__ import annotations

import functools
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from runtimes import open_runtime, ownership, remove_snapshot
from runtimes.cleanup import cleanup_sandboxes
from runtimes.snapshot import SandboxSnapshot, held_snapshots
from runtimes.subprocess import SubprocessConfig, SubprocessRuntime
from runtimes.subprocess.snapshots import SNAPSHOT_PREFIX

from .conftest import make_backend
from .support import REPO, Backend, child_process, populate


@pytest.mark.anyio
@pytest.mark.ssh
@pytest.mark.docker
async def test_files_of_the_policy_account_keep_their_owners(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """SSH logged in as root with a policy account: the copy keeps owners both ways, and the
    fork's policy can still reach its workdir (the private directory above it lets it pass)."""
    backend = make_backend("ssh", request, tmp_path)
    async with open_runtime(backend.config) as source:
        await populate(source)
        snap = await source.snapshot()
        assert snap.policy_user == "sandbox"
        try:
            async with open_runtime(backend.config, snapshot=snap) as fork:
                owners = await fork.exec(["stat", "-c", "%U %n", "changed.txt", "machinery.txt"])
                assert owners.stdout == "sandbox changed.txt\nroot machinery.txt\n"
                done = await fork.exec(["touch", "new.txt"], user="sandbox")
                assert done.exit_code == 0, done
        finally:
            await remove_snapshot(snap)


# ---------------------------------------------------------------------- the subprocess backend


@pytest.mark.anyio
async def test_the_snapshot_lives_under_the_runtime_root_private(tmp_path: Path) -> None:
    config = SubprocessConfig(root=str(tmp_path / "root"))
    async with open_runtime(config) as source:
        snap = await source.snapshot()
    directory = Path(snap.id)
    try:
        assert directory.parent == tmp_path / "root" and directory.name.startswith(SNAPSHOT_PREFIX)
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        assert [info.id for info in await SubprocessRuntime.list_sandboxes(config)] == [], (
            "a snapshot directory is not listed as a sandbox"
        )
    finally:
        await remove_snapshot(snap)
    assert not directory.exists()


@pytest.mark.anyio
async def test_a_cancelled_snapshot_is_removed_again(tmp_path: Path) -> None:
    config = SubprocessConfig(root=str(tmp_path / "root"))
    async with open_runtime(config) as source:
        await source.write("a.txt", b"a")
        with anyio.CancelScope() as scope:
            scope.cancel()
            await source.snapshot()
        assert scope.cancelled_caught
        assert await SubprocessRuntime.list_snapshots(config) == []
        assert not held_snapshots()


def test_the_exit_backstop_removes_snapshots_not_kept(tmp_path: Path) -> None:
    backend = Backend("subprocess", SubprocessConfig(root=str(tmp_path / "root")))
    child, said = child_process(backend, "exit")
    assert child.wait(60) == 0, child.communicate()
    assert not Path(said["snapshot"]["id"]).exists()
    assert anyio.run(SubprocessRuntime.list_snapshots, backend.config) == []


def test_a_kept_snapshot_outlives_its_holder_until_cleanup_kept(tmp_path: Path) -> None:
    backend = Backend("subprocess", SubprocessConfig(root=str(tmp_path / "root")))
    child, said = child_process(backend, "exit", keep=True)
    assert child.wait(60) == 0, child.communicate()
    snap = SandboxSnapshot.model_validate(said["snapshot"])
    assert snap.kept and Path(snap.id).is_dir()

    def sweep(kept: bool) -> list[tuple[str, str]]:
        results = anyio.run(functools.partial(cleanup_sandboxes, [backend.config], kept=kept))
        return [(r.info.id, r.action) for r in results if r.kind == "snapshot"]

    assert sweep(kept=False) == [(snap.id, "kept")], "spared by the dead-session sweep"
    assert Path(snap.id).is_dir()
    assert sweep(kept=True) == [(snap.id, "removed")]
    assert not Path(snap.id).exists()


def test_the_cli_lists_snapshots_and_cleanup_removes_a_dead_sessions(tmp_path: Path) -> None:
    backend = Backend("subprocess", SubprocessConfig(root=str(tmp_path / "root")))
    child, said = child_process(backend, "hang")
    child.kill()
    child.communicate(timeout=30)
    runtime = json.dumps({"type": "subprocess", "root": str(tmp_path / "root")})
    cli = [sys.executable, "-m", "placement.cli"]

    listed = subprocess.run(
        [*cli, "ls", "--json", "--runtime", runtime], cwd=REPO, capture_output=True, text=True
    )
    assert listed.returncode == 0, listed.stderr
    snapshots = json.loads(listed.stdout)["snapshots"]
    assert [(s["id"], s["session"], s["holds"], s["source"]) for s in snapshots] == [
        (said["snapshot"]["id"], "dead", "workdir", said["sandbox"])
    ]
    assert snapshots[0]["labels"][ownership.CREATOR] == said["session"]
    table = subprocess.run(
        [*cli, "ls", "--runtime", runtime], cwd=REPO, capture_output=True, text=True
    )
    assert "snapshots:" in table.stdout and said["snapshot"]["id"] in table.stdout

    swept = subprocess.run(
        [*cli, "cleanup", "--json", "--runtime", runtime], cwd=REPO, capture_output=True, text=True
    )
    assert swept.returncode == 0, swept.stderr
    document = json.loads(swept.stdout)
    assert [(r["id"], r["action"]) for r in document["snapshots"]] == [
        (said["snapshot"]["id"], "removed")
    ]
    assert [(r["id"], r["action"]) for r in document["results"]] == [(said["sandbox"], "removed")]
    assert document["summary"]["removed"] == 2
    assert not os.path.exists(said["snapshot"]["id"])
