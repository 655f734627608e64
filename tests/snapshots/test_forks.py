"""Snapshots and forks on every backend: what a fork holds (files exactly, never processes), what
it leaves alone (the source, other forks), the typed errors, and leaks (a SIGKILLed holder's
snapshots are listed and removed by ``cleanup``; the exit backstop removes the rest)."""

from __future__ import annotations

import os
import signal

import pytest

from runtimes import SandboxUnavailableError, open_runtime, ownership
from runtimes.cleanup import cleanup_sandboxes
from runtimes.lifecycle import State
from runtimes.registry import load_runtime_class
from runtimes.snapshot import (
    SandboxSnapshot,
    SnapshotNotFoundError,
    held_snapshots,
    remove_snapshot,
)

from .support import (
    Backend,
    child_process,
    manifest,
    policy,
    populate,
    sleepers,
    start_sleeper,
)

pytestmark = pytest.mark.anyio


async def _listed(backend: Backend) -> dict[str, SandboxSnapshot]:
    cls = load_runtime_class(backend.config.type)
    return {snap.id: snap for snap in await cls.list_snapshots(backend.config)}


async def test_a_fork_holds_the_files_exactly_and_none_of_the_processes(backend: Backend) -> None:
    async with open_runtime(backend.config) as source:
        await populate(source)
        await start_sleeper(source)
        before = await manifest(source)
        snap = await source.snapshot()
        assert snap.backend == backend.config.type and snap.source == source.sandbox_id
        assert snap.holds == ("filesystem" if backend.holds_filesystem else "workdir")
        try:
            async with open_runtime(backend.config, snapshot=snap) as fork:
                assert fork.snapshot_source == snap
                assert await manifest(fork) == before
                assert await sleepers(fork) == 0, "processes are never part of a snapshot"
                assert not await fork.exists("deleted.txt")
                assert await fork.read("changed.txt") == b"v2, longer"
                # the policy works on in its copy (its account and the workdir are its own)
                done = await fork.exec(["sh", "-c", "echo more >> changed.txt"], user=policy(fork))
                assert done.exit_code == 0, done
            assert await sleepers(source) == 1, "the source's processes run on"
            assert await manifest(source) == before, "the fork changed nothing of the source"
            assert await source.alive()
        finally:
            await remove_snapshot(snap)


async def test_two_forks_of_one_snapshot_are_independent(backend: Backend) -> None:
    async with open_runtime(backend.config) as source:
        await source.write("shared.txt", b"base")
        snap = await source.snapshot()
        try:
            async with (
                open_runtime(backend.config, snapshot=snap) as one,
                open_runtime(backend.config, snapshot=snap) as two,
            ):
                assert one.sandbox_id != two.sandbox_id
                await one.write("shared.txt", b"one")
                await one.write("only-one.txt", b"1")
                await two.remove("shared.txt")
                assert not await two.exists("only-one.txt")
                assert await one.read("shared.txt") == b"one"
                assert await source.read("shared.txt") == b"base"
                assert not await source.exists("only-one.txt")
        finally:
            await remove_snapshot(snap)


async def test_a_snapshot_of_a_fork_carries_its_changes_and_deletions(backend: Backend) -> None:
    async with open_runtime(backend.config) as source:
        await populate(source)
        first = await source.snapshot()
        try:
            async with open_runtime(backend.config, snapshot=first) as fork:
                await fork.remove("hard1")
                await fork.remove("keep/sub", missing_ok=False)
                await fork.write("changed.txt", b"v3")
                expected = await manifest(fork)
                second = await fork.snapshot()
            try:
                async with open_runtime(backend.config, snapshot=second) as grandchild:
                    assert await manifest(grandchild) == expected
            finally:
                await remove_snapshot(second)
        finally:
            await remove_snapshot(first)


async def test_a_snapshot_of_a_closed_runtime_is_unavailable(backend: Backend) -> None:
    runtime = open_runtime(backend.config)
    with pytest.raises(SandboxUnavailableError, match="never started"):
        await runtime.snapshot()
    async with runtime:
        pass
    with pytest.raises(SandboxUnavailableError, match="closed"):
        await runtime.snapshot()


async def test_a_removed_snapshot_is_not_listed_and_cannot_be_opened(backend: Backend) -> None:
    async with open_runtime(backend.config) as source:
        snap = await source.snapshot()
    listed = await _listed(backend)
    assert snap.id in listed, "a snapshot outlives its source"
    assert listed[snap.id].source == snap.source and not listed[snap.id].kept
    assert listed[snap.id].labels[ownership.CREATOR] == ownership.CREATOR_ID
    assert snap in held_snapshots(), "removed at exit unless removed before"
    await remove_snapshot(snap)
    await remove_snapshot(snap, backend.config)  # gone already is fine
    assert snap not in held_snapshots()
    assert snap.id not in await _listed(backend)
    fork = open_runtime(backend.config, snapshot=snap)
    with pytest.raises(SnapshotNotFoundError, match="gone"):
        await fork.start()
    assert not await fork.alive() and fork.state != State.OPEN, "nothing was left open"


async def test_cleanup_removes_the_snapshot_of_a_sigkilled_holder(
    backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    child, said = child_process(backend, "hang")
    try:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        taken = SandboxSnapshot.model_validate(said["snapshot"])
        listed = await _listed(backend)
        assert taken.id in listed, "SIGKILL skips every backstop: the labels are what is left"
        assert ownership.creator_is_dead(listed[taken.id].labels) is True

        results = await cleanup_sandboxes([backend.config])
        mine = {(r.kind, r.info.id): r for r in results}
        # Missing from the results: a backend skipped (the log says why) or removed by another.
        swept = mine.get(("snapshot", taken.id))
        assert swept is not None, (results, caplog.text, await _listed(backend))
        assert swept.action == "removed", results
        assert "session is dead" in swept.reason
        assert mine[("sandbox", said["sandbox"])].action == "removed"
        assert taken.id not in await _listed(backend)
    finally:
        if child.poll() is None:
            child.kill()
        child.communicate(timeout=30)
