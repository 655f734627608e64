"""The typed errors of snapshots, whatever the backend: a backend that cannot (a plugin), a
snapshot of another backend, a runtime already started."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtimes import (
    SandboxInvalidArgumentError,
    SandboxUnavailableError,
    open_runtime,
    remove_snapshot,
)
from runtimes.docker import DockerConfig
from runtimes.snapshot import SandboxSnapshot, SnapshotUnsupportedError
from runtimes.subprocess import SubprocessConfig

pytestmark = pytest.mark.anyio


def _a_snapshot(backend: str) -> SandboxSnapshot:
    return SandboxSnapshot(
        backend=backend, id="x", labels={}, source="s", holds="workdir", workdir="/w"
    )


async def test_a_backend_that_cannot_snapshot_says_so_by_name() -> None:
    async with open_runtime("echo") as rt:
        with pytest.raises(SnapshotUnsupportedError, match="echo backend cannot take snapshots"):
            await rt.snapshot()
    with pytest.raises(SnapshotUnsupportedError, match="echo backend cannot open"):
        open_runtime("echo", snapshot=_a_snapshot("echo"))
    with pytest.raises(SnapshotUnsupportedError, match="echo backend"):
        await remove_snapshot(_a_snapshot("echo"))


def test_a_snapshot_of_another_backend_is_refused_before_anything_starts() -> None:
    with pytest.raises(SandboxInvalidArgumentError, match="open it with a 'subprocess' config"):
        open_runtime(DockerConfig(), snapshot=_a_snapshot("subprocess"))
    with pytest.raises(SandboxInvalidArgumentError, match="'docker' config"):
        open_runtime("subprocess", snapshot=_a_snapshot("docker"))


async def test_a_runtime_already_started_cannot_become_a_fork(tmp_path: Path) -> None:
    config = SubprocessConfig(root=str(tmp_path))
    async with open_runtime(config) as rt:
        snap = await rt.snapshot()
        with pytest.raises(SandboxUnavailableError, match="already started"):
            rt.fork_from(snap)
        await remove_snapshot(snap)


async def test_removing_needs_a_config_of_the_snapshots_backend(tmp_path: Path) -> None:
    async with open_runtime(SubprocessConfig(root=str(tmp_path))) as rt:
        snap = await rt.snapshot()
    with pytest.raises(SandboxInvalidArgumentError, match="'docker' config"):
        await remove_snapshot(snap, DockerConfig())
    await remove_snapshot(snap)
    with pytest.raises(SandboxInvalidArgumentError, match="not a subprocess snapshot"):
        await remove_snapshot(snap.model_copy(update={"id": str(tmp_path)}))
    assert tmp_path.is_dir(), "nothing but a snapshot directory is ever removed"
