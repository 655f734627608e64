"""RuntimePool on the subprocess backend, under asyncio and trio: what an acquirer gets, how
the pool refills, fails, expires and closes. The backend's ``_start`` is wrapped
(``conftest.Starts``) so that creations are counted, held or broken: no timing is asserted."""

from __future__ import annotations

import os
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from runtimes import (
    ProvisioningError,
    RuntimeConfigError,
    SandboxInvalidArgumentError,
    SandboxUnavailableError,
    live_runtimes,
)
from runtimes.base import Runtime
from runtimes.lifecycle import State
from runtimes.pool import POOL, PoolClosedError, PoolTimeoutError, RuntimePool, pool_for
from runtimes.subprocess import SubprocessRuntime

from .conftest import Starts

pytestmark = pytest.mark.anyio

CONFIG = {"type": "subprocess"}
QUICK = {"retry_backoff": (0.0, 0.0)}


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Starts:
    return Starts(monkeypatch, SubprocessRuntime)


def gone(runtime: Runtime, workdir: str) -> bool:
    return runtime.closed and not os.path.exists(workdir)


# ---------------------------------------------------------------------- acquiring


async def test_acquire_hands_out_a_started_distinct_sandbox_that_is_closed_after_its_block(
    starts: Starts,
) -> None:
    seen: list[tuple[Runtime, str]] = []
    async with RuntimePool(CONFIG, size=2) as pool:
        for _ in range(5):
            async with pool.acquire() as rt:
                assert rt.state is State.OPEN
                result = await rt.exec(["pwd"])
                assert result.exit_code == 0 and result.stdout.strip() == rt.workdir
                seen.append((rt, rt.workdir))
            assert gone(rt, seen[-1][1]), "closed, its directory removed, at the block's end"
        assert pool.handed_out == 5
    assert len({id(rt) for rt, _ in seen}) == 5
    assert len({workdir for _, workdir in seen}) == 5, "never the same sandbox twice"


async def test_a_sandbox_is_never_handed_out_twice_to_many_concurrent_acquirers(
    starts: Starts,
) -> None:
    held: list[Runtime] = []
    workdirs: list[str] = []

    async def acquirer(pool: RuntimePool) -> None:
        async with pool.acquire() as rt:
            held.append(rt)
            await anyio.lowlevel.checkpoint()  # the others run while this one holds its own
            result = await rt.exec(["sh", "-c", "test ! -e mine && touch mine && pwd"])
            assert result.exit_code == 0, "another acquirer used this sandbox"
            workdirs.append(result.stdout.strip())

    async with RuntimePool(CONFIG, size=3, max_create_concurrency=2) as pool:
        async with anyio.create_task_group() as group:
            for _ in range(25):
                group.start_soon(acquirer, pool)
        assert pool.handed_out == 25
    assert len({id(rt) for rt in held}) == 25 and len(set(workdirs)) == 25
    assert all(rt.closed for rt in held)
    assert set(map(id, held)) <= set(map(id, starts.started))


async def test_take_gives_the_caller_a_runtime_it_closes_itself(starts: Starts) -> None:
    async with RuntimePool(CONFIG, size=1) as pool:
        rt = await pool.take()
        assert rt.state is State.OPEN
    assert not rt.closed, "an acquired sandbox belongs to its acquirer, not to the pool"
    workdir = rt.workdir
    await rt.close()
    assert gone(rt, workdir)


async def test_a_ready_sandbox_known_lost_is_never_handed_out_and_is_closed(
    starts: Starts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox whose runtime knows it is gone (``lost()``: a ray sandbox whose node left
    the cluster) is dropped from the stock when its turn comes, closed, and the acquirer gets
    a sandbox that is not lost."""
    async with RuntimePool(CONFIG, size=2) as pool:
        await pool.wait_ready()
        stock = [rt for rt in live_runtimes() if isinstance(rt, SubprocessRuntime)]
        assert len(stock) == 2
        doomed = {stock[0]}
        monkeypatch.setattr(
            SubprocessRuntime, "lost", lambda self: "its node left" if self in doomed else None
        )
        taken = [await pool.take() for _ in range(2)]
        try:
            assert not doomed & set(taken), "a lost sandbox was handed out"
            assert stock[1] in taken and pool.handed_out == 2
            for _ in range(3000):  # closed in the pool's task group, soon
                if stock[0].closed:
                    break
                await anyio.sleep(0.01)
            assert stock[0].closed, "the lost sandbox was not closed"
        finally:
            for rt in taken:
                await rt.close()


async def test_each_pooled_sandbox_carries_the_config_labels_and_the_pool_label(
    starts: Starts,
) -> None:
    config = {**CONFIG, "labels": {"team": "rl"}}
    async with RuntimePool(config, size=3) as pool:
        await pool.wait_ready()
        listed = await SubprocessRuntime.list_sandboxes()
        mine = [info for info in listed if info.labels.get(POOL) == pool.id]
        assert len(mine) == 3
        assert all(info.labels["team"] == "rl" for info in mine)
        assert pool.config.labels == {"team": "rl"}, "the caller's config is unchanged"
    listed = await SubprocessRuntime.list_sandboxes()
    assert [info for info in listed if info.labels.get(POOL) == pool.id] == []


# ---------------------------------------------------------------------- refilling


async def test_refill_keeps_size_ready_and_never_exceeds_the_creations_in_flight(
    starts: Starts,
) -> None:
    starts.hold()
    async with RuntimePool(CONFIG, size=6, max_create_concurrency=2) as pool:
        await starts.until(lambda: starts.in_flight == 2)
        await anyio.wait_all_tasks_blocked()
        assert (starts.calls, pool.creating, pool.ready) == (2, 2, 0), "2 in flight, no more"
        starts.open()
        await pool.wait_ready()
        assert (pool.ready, starts.calls, starts.max_in_flight) == (6, 6, 2)

        held = [await pool.take() for _ in range(3)]  # each take starts a replacement
        await pool.wait_ready()
        assert (pool.ready, starts.calls) == (6, 9)
        assert starts.max_in_flight == 2
        for rt in held:
            await rt.close()
        await anyio.wait_all_tasks_blocked()
        assert (pool.ready, starts.calls, pool.creating) == (6, 9, 0), "full: nothing made"


async def test_an_empty_pool_makes_the_acquirer_wait_for_the_next_creation(
    starts: Starts,
) -> None:
    async with RuntimePool(CONFIG, size=0, max_create_concurrency=3) as pool:
        await anyio.wait_all_tasks_blocked()
        assert starts.calls == 0, "size 0 keeps nothing ready"
        async with pool.acquire() as rt:
            assert rt.state is State.OPEN
        assert starts.calls == 1 and pool.ready == 0


async def test_acquire_timeout_is_a_typed_error_and_the_late_sandbox_is_kept(
    starts: Starts,
) -> None:
    starts.hold()
    async with RuntimePool(CONFIG, size=0) as pool:
        with pytest.raises(PoolTimeoutError) as info:
            async with pool.acquire(timeout=0.05):
                raise AssertionError("nothing should have been ready")
        assert isinstance(info.value, TimeoutError)
        assert pool.waiting == 0 and pool.creating == 1
        starts.open()
        await starts.until(lambda: pool.ready == 1)  # the creation lands in the stock
        async with pool.acquire(timeout=0) as rt:  # ready now: no wait needed
            assert rt is starts.started[0]
        with pytest.raises(SandboxInvalidArgumentError):
            await pool.take(timeout=-1)


async def test_a_cancelled_acquirer_leaves_no_waiter_behind(starts: Starts) -> None:
    starts.hold()
    async with RuntimePool(CONFIG, size=0) as pool:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await pool.take()
        assert pool.waiting == 0 and starts.calls == 0, "a cancelled caller takes nothing"
        async with anyio.create_task_group() as group:
            group.start_soon(pool.take)
            await starts.until(lambda: pool.waiting == 1)
            group.cancel_scope.cancel()
        assert pool.waiting == 0
        starts.open()
        await starts.until(lambda: pool.ready == 1)
        assert not starts.started[0].closed, "the creation it started serves the next one"


# ---------------------------------------------------------------------- failing creations


async def test_a_failing_create_is_retried_then_a_provisioning_error_and_the_pool_recovers(
    starts: Starts,
) -> None:
    starts.failure = lambda: ProvisioningError("no capacity")
    pool = RuntimePool(CONFIG, size=1, max_create_concurrency=1, create_attempts=3, **QUICK)
    async with pool:
        with pytest.raises(ProvisioningError) as info:
            async with pool.acquire():
                raise AssertionError("no sandbox should have been handed out")
        assert starts.calls == 3, "exactly create_attempts tries"
        assert isinstance(info.value.__cause__, ProvisioningError)
        assert "no capacity" in str(info.value.__cause__)
        assert "3 attempts" in str(info.value)
        await anyio.wait_all_tasks_blocked()
        assert (pool.creating, starts.calls) == (0, 3), "no retry loop in the background"

        starts.failure = None
        async with pool.acquire() as rt:
            assert rt.state is State.OPEN
        await pool.wait_ready()
        assert pool.ready == 1


async def test_every_waiting_acquirer_gets_the_provisioning_error(starts: Starts) -> None:
    starts.failure = lambda: ProvisioningError("image missing")
    errors: list[BaseException] = []

    async def acquirer(pool: RuntimePool) -> None:
        try:
            await pool.take()
        except ProvisioningError as exc:
            errors.append(exc)

    pool = RuntimePool(CONFIG, size=0, max_create_concurrency=1, create_attempts=2, **QUICK)
    async with pool:
        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(acquirer, pool)
        assert len(errors) == 4 and pool.waiting == 0
        assert all(isinstance(e.__cause__, ProvisioningError) for e in errors)


async def test_an_error_that_can_never_work_is_not_retried(starts: Starts) -> None:
    starts.failure = lambda: SandboxInvalidArgumentError("argv over the kernel's limit")
    async with RuntimePool(CONFIG, size=0, create_attempts=5, **QUICK) as pool:
        with pytest.raises(ProvisioningError) as info:
            await pool.take()
    assert starts.calls == 1
    assert isinstance(info.value.__cause__, SandboxInvalidArgumentError)


async def test_a_backend_bug_reaches_the_acquirer_typed_with_its_cause(starts: Starts) -> None:
    starts.failure = lambda: KeyError("bug")
    async with RuntimePool(CONFIG, size=0, create_attempts=2, **QUICK) as pool:
        with pytest.raises(ProvisioningError) as info:
            await pool.take()
    assert isinstance(info.value.__cause__, KeyError) and starts.calls == 2


async def test_wait_ready_raises_when_filling_fails(starts: Starts) -> None:
    starts.failure = lambda: ProvisioningError("quota")
    async with RuntimePool(CONFIG, size=2, create_attempts=1, **QUICK) as pool:
        with pytest.raises(ProvisioningError):
            await pool.wait_ready()
        with pytest.raises(SandboxInvalidArgumentError):
            await pool.wait_ready(3)


# ---------------------------------------------------------------------- idle expiry


async def test_idle_sandboxes_expire_and_the_pool_refills_only_when_used_again(
    starts: Starts,
) -> None:
    async with RuntimePool(CONFIG, size=2, idle_timeout=0.2) as pool:
        await pool.wait_ready()
        first = list(starts.started)
        workdirs = [rt.workdir for rt in first]
        await starts.until(lambda: all(rt.closed for rt in first))
        assert all(gone(rt, w) for rt, w in zip(first, workdirs, strict=True))
        assert pool.ready == 0 and pool.creating == 0
        await anyio.sleep(0.5)  # longer than idle_timeout: a refill would have started
        assert starts.calls == 2, "an unused pool is not refilled"

        async with pool.acquire() as rt:
            assert rt.state is State.OPEN
        await pool.wait_ready()
        assert pool.ready == 2 and starts.calls == 5, "used again: full again"


async def test_without_idle_timeout_ready_sandboxes_wait_forever(starts: Starts) -> None:
    async with RuntimePool(CONFIG, size=1, idle_timeout=None) as pool:
        await pool.wait_ready()
        await anyio.sleep(0.3)
        assert pool.ready == 1 and not starts.started[0].closed


# ---------------------------------------------------------------------- closing


async def test_closing_the_pool_closes_ready_sandboxes_and_in_flight_creations(
    starts: Starts,
) -> None:
    before = set(map(id, live_runtimes()))
    pool = RuntimePool(CONFIG, size=4, max_create_concurrency=4)

    async def open_when_closing() -> None:
        await starts.until(lambda: pool.closed)
        starts.open()

    async with anyio.create_task_group() as outside, pool:
        await pool.wait_ready()
        starts.hold()  # the next creation is caught in flight by the close
        async with pool.acquire():
            pass  # used: a replacement starts, held at the gate
        await starts.until(lambda: starts.in_flight == 1)
        assert pool.ready == 3
        outside.start_soon(open_when_closing)
    assert len(starts.started) == 5, "4, and the replacement caught in flight"
    assert all(rt.closed for rt in starts.started)
    assert [rt for rt in live_runtimes() if id(rt) not in before] == []
    listed = await SubprocessRuntime.list_sandboxes()
    assert [info for info in listed if info.labels.get(POOL) == pool.id] == []


async def test_state_goes_new_open_closed_and_repr_names_it(starts: Starts) -> None:
    pool = RuntimePool(CONFIG, size=0)
    assert pool.state is State.NEW and repr(pool).endswith(", new)")
    async with pool:
        assert pool.state is State.OPEN and repr(pool).endswith(", open)")
    assert pool.state is State.CLOSED and pool.closed and repr(pool).endswith(", closed)")


async def test_a_closed_pool_refuses_acquirers_and_wakes_waiting_ones(starts: Starts) -> None:
    pool = RuntimePool(CONFIG, size=0)
    with pytest.raises(PoolClosedError):
        await pool.take()
    woken: list[BaseException] = []
    starts.hold()

    async def waiter() -> None:
        try:
            await pool.take()
        except PoolClosedError as exc:
            woken.append(exc)

    async def open_when_closed() -> None:
        await starts.until(lambda: pool.closed)
        starts.open()  # the creation in flight ends after the close, and is closed

    async with anyio.create_task_group() as outside, pool:
        outside.start_soon(waiter)
        await starts.until(lambda: pool.waiting == 1)
        outside.start_soon(open_when_closed)
    assert len(woken) == 1 and isinstance(woken[0], SandboxUnavailableError)
    with pytest.raises(PoolClosedError):
        async with pool.acquire():
            pass
    with pytest.raises(PoolClosedError):
        async with pool:
            pass
    assert all(rt.closed for rt in starts.started)


# ---------------------------------------------------------------------- configuration


async def test_configs_that_cannot_be_pooled_are_refused() -> None:
    with pytest.raises(RuntimeConfigError, match="keep"):
        RuntimePool({**CONFIG, "keep": True}, size=1)
    with pytest.raises(RuntimeConfigError, match="attach"):
        RuntimePool({"type": "docker", "container": "someone-elses"}, size=1)
    for bad in ({"size": -1}, {"size": 1, "max_create_concurrency": 0},
                {"size": 1, "idle_timeout": 0}, {"size": 1, "create_attempts": 0},
                {"size": 1, "retry_backoff": (2.0, 1.0)}):  # fmt: skip
        with pytest.raises(SandboxInvalidArgumentError):
            RuntimePool(CONFIG, **bad)  # type: ignore[arg-type]


async def test_pool_for_matches_equal_configs_only(tmp_path: Path) -> None:
    plain = RuntimePool(CONFIG, size=1)
    labelled = RuntimePool({**CONFIG, "labels": {"a": "b"}}, size=1)
    pools = [labelled, plain]
    assert pool_for(pools, "subprocess") is plain
    assert pool_for(pools, {"type": "subprocess", "labels": {"a": "b"}}) is labelled
    assert pool_for(pools, {"type": "subprocess", "root": str(tmp_path)}) is None
    assert pool_for(None, CONFIG) is None
    assert plain.serves({"type": "subprocess"}) and not labelled.serves("subprocess")
