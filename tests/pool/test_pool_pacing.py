"""Adaptive creation: the :class:`CreationPacer` on its own (AIMD between 1 and the ceiling,
the cool-down, stale rounds, the gate), then a :class:`RuntimePool` on the subprocess backend
whose creations are counted, held or broken (``conftest.Starts``), under asyncio and trio."""

from __future__ import annotations

import anyio
import pytest

from runtimes import (
    ExecTimeoutError,
    ProvisioningError,
    RuntimeConfigError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from runtimes.errors import BuildContextError
from runtimes.pacing import CreationPacer, create_paced, is_overload
from runtimes.pool import PoolClosedError, RuntimePool
from runtimes.snapshot import SnapshotNotFoundError
from runtimes.subprocess import SubprocessRuntime

from .conftest import Starts

pytestmark = pytest.mark.anyio

CONFIG = {"type": "subprocess"}
NO_WAIT = (0.0, 0.0)
OVERLOADED = ProvisioningError("Modal refused the sandbox 3 times (quota, rate limit or capacity)")


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Starts:
    return Starts(monkeypatch, SubprocessRuntime)


# ---------------------------------------------------------------------- the pacer


@pytest.mark.parametrize(
    ("exc", "overload"),
    [
        (ProvisioningError("rate limit"), True),
        (SandboxTransportError("the engine did not answer"), True),
        (TimeoutError(), True),
        (ConnectionResetError(), True),
        (ExecTimeoutError(["start"], 5.0), True),
        (SandboxInvalidArgumentError("bad image name"), False),
        (RuntimeConfigError("bad config"), False),
        (BuildContextError("a symlink out of the context", path="x"), False),
        (SnapshotNotFoundError("gone"), False),
        (SandboxUnavailableError("dead"), False),
        (KeyError("bug"), False),
    ],
)
def test_what_counts_as_overload(exc: BaseException, overload: bool) -> None:
    assert is_overload(exc) is overload


async def test_overloads_halve_the_limit_never_below_one() -> None:
    pacer = CreationPacer(8, (0.0, 0.0))
    assert (pacer.limit, pacer.ceiling, pacer.round) == (8, 8, 0), "starts at the ceiling"
    limits = []
    for _ in range(5):
        assert pacer.failed(OVERLOADED)
        limits.append(pacer.limit)
    assert limits == [4, 2, 1, 1, 1]
    assert pacer.round == 5


async def test_successes_bring_the_limit_back_one_at_a_time_never_above_the_ceiling() -> None:
    pacer = CreationPacer(5, (0.0, 0.0))
    pacer.failed(SandboxTransportError("engine timed out"))
    pacer.failed(TimeoutError())
    assert pacer.limit == 1
    limits = []
    for _ in range(6):
        pacer.succeeded()
        limits.append(pacer.limit)
    assert limits == [2, 3, 4, 5, 5, 5]


async def test_failures_that_are_not_overload_leave_the_limit_alone() -> None:
    pacer = CreationPacer(4, (10.0, 10.0))
    harmless = [
        SandboxInvalidArgumentError("argv too long"),
        KeyError("bug"),
        BuildContextError("a device file in the context", path="dev"),
    ]
    for exc in harmless:
        assert not pacer.failed(exc)
    assert (pacer.limit, pacer.round) == (4, 0)
    assert not pacer.cooling(), "no cool-down either"


async def test_a_stale_outcome_counts_for_nothing() -> None:
    pacer = CreationPacer(8, (0.0, 0.0))
    admitted = pacer.round
    assert pacer.failed(OVERLOADED, admitted=admitted)
    assert pacer.limit == 4
    # the rest of the burst admitted with it hit the same limit: no second halving
    assert not pacer.failed(OVERLOADED, admitted=admitted)
    assert pacer.limit == 4
    pacer.succeeded(admitted=admitted)  # a straggler that made it does not undo it
    assert pacer.limit == 4
    pacer.succeeded(admitted=pacer.round)
    assert pacer.limit == 5


async def test_the_cool_down_doubles_per_overload_in_a_row_is_bounded_and_jittered() -> None:
    pacer = CreationPacer(4, (1.0, 3.0))
    assert not pacer.cooling()
    # each bound holds whether the new cool-down or a longer one still running wins
    for low, high in [(0.5, 1.0), (1.0, 2.0), (1.5, 3.0), (1.5, 3.0), (1.5, 3.0)]:
        before = anyio.current_time()
        pacer.failed(OVERLOADED)
        after = anyio.current_time()
        assert before + low <= pacer.resume_at <= after + high
        assert pacer.cooling()


async def test_a_success_ends_the_run_of_overloads() -> None:
    pacer = CreationPacer(4, (0.01, 10.0))
    for _ in range(5):
        pacer.failed(OVERLOADED)  # the fifth cool-down: up to 0.16 s
    await anyio.sleep_until(pacer.resume_at)
    pacer.succeeded()
    before = anyio.current_time()
    pacer.failed(OVERLOADED)
    assert pacer.resume_at <= anyio.current_time() + 0.01, "back to the first cool-down"
    assert pacer.resume_at >= before + 0.005


async def test_the_gate_admits_at_most_the_limit_and_counts_outcomes() -> None:
    pacer = CreationPacer(2, (0.0, 0.0))
    release = anyio.Event()
    inside = 0
    most = 0

    async def creation() -> None:
        nonlocal inside, most
        async with pacer.attempt():
            inside += 1
            most = max(most, inside)
            await release.wait()
            inside -= 1

    async with anyio.create_task_group() as group:
        for _ in range(5):
            group.start_soon(creation)
        await anyio.wait_all_tasks_blocked()
        assert (inside, pacer.in_flight) == (2, 2), "the others wait at the gate"
        release.set()
    assert most == 2 and pacer.in_flight == 0 and pacer.limit == 2


async def test_the_gate_holds_every_attempt_until_the_cool_down_ends() -> None:
    pacer = CreationPacer(3, (0.1, 0.1))
    with pytest.raises(SandboxTransportError):
        async with pacer.attempt():
            raise SandboxTransportError("the engine did not answer")
    assert pacer.limit == 1 and pacer.in_flight == 0 and pacer.cooling()
    resume_at = pacer.resume_at
    async with pacer.attempt():
        assert anyio.current_time() >= resume_at
    assert pacer.limit == 2


async def test_a_cancelled_attempt_frees_its_place_and_changes_nothing() -> None:
    pacer = CreationPacer(2, (0.0, 0.0))
    with anyio.CancelScope() as scope:
        async with pacer.attempt():
            scope.cancel()
            await anyio.sleep(10)
    assert (pacer.in_flight, pacer.limit, pacer.round) == (0, 2, 0)


async def test_a_bad_ceiling_or_backoff_is_an_invalid_argument() -> None:
    for ceiling, backoff in [(0, (0.0, 0.0)), (2, (2.0, 1.0)), (2, (-1.0, 1.0))]:
        with pytest.raises(SandboxInvalidArgumentError):
            CreationPacer(ceiling, backoff)


async def test_create_paced_retries_through_the_pacer() -> None:
    pacer = CreationPacer(4, (0.0, 0.0))
    calls = 0

    async def create() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise SandboxTransportError("engine timed out")
        return "made"

    assert await create_paced(pacer, create, attempts=3, backoff=(0.0, 0.0)) == "made"
    assert (calls, pacer.limit) == (3, 2), "halved twice, then one success"

    async def invalid() -> str:
        nonlocal calls
        calls += 1
        raise SandboxInvalidArgumentError("never works")

    calls = 0
    with pytest.raises(SandboxInvalidArgumentError):
        await create_paced(pacer, invalid, attempts=5, backoff=(0.0, 0.0))
    assert (calls, pacer.limit) == (1, 2), "not retried, not a load signal"


# ---------------------------------------------------------------------- the pool


async def test_the_pool_limit_halves_on_overload_and_recovers_on_success(
    starts: Starts,
) -> None:
    pool = RuntimePool(
        CONFIG, size=0, max_create_concurrency=4, create_attempts=1, retry_backoff=NO_WAIT
    )
    assert pool.create_limit == 4 == pool.max_create_concurrency
    async with pool:
        starts.failure = lambda: OVERLOADED
        limits = []
        for _ in range(3):
            with pytest.raises(ProvisioningError):
                await pool.take()
            limits.append(pool.create_limit)
        assert limits == [2, 1, 1], "never below 1"

        starts.failure = None
        for _ in range(5):
            async with pool.acquire():
                pass
            limits.append(pool.create_limit)
        assert limits[3:] == [2, 3, 4, 4, 4], "back up by one per success, never above 4"


async def test_an_invalid_argument_or_a_bug_does_not_shrink_the_pool_limit(
    starts: Starts,
) -> None:
    async with RuntimePool(CONFIG, size=0, max_create_concurrency=3, retry_backoff=NO_WAIT) as pool:
        starts.failure = lambda: SandboxInvalidArgumentError("argv over the kernel's limit")
        with pytest.raises(ProvisioningError):
            await pool.take()
        starts.failure = lambda: KeyError("bug")
        with pytest.raises(ProvisioningError):
            await pool.take()
        assert pool.create_limit == 3


async def test_creations_that_keep_failing_reach_every_waiting_acquirer_in_bounded_time(
    starts: Starts,
) -> None:
    starts.failure = lambda: SandboxTransportError("the engine did not answer within 60s")
    errors: list[BaseException] = []

    async def acquirer(pool: RuntimePool) -> None:
        try:
            await pool.take()
        except ProvisioningError as exc:
            errors.append(exc)

    pool = RuntimePool(
        CONFIG, size=2, max_create_concurrency=4, create_attempts=3, retry_backoff=(0.01, 0.05)
    )
    async with pool:
        with anyio.fail_after(20):  # never a hang: attempts x (backoff + cool-down) bound it
            async with anyio.create_task_group() as group:
                for _ in range(6):
                    group.start_soon(acquirer, pool)
            await starts.until(lambda: pool.creating == 0)
        assert len(errors) == 6 and pool.waiting == 0
        assert all(isinstance(e.__cause__, SandboxTransportError) for e in errors)
        assert pool.create_limit == 1, "the engine kept timing out: one at a time"
        assert starts.calls <= 4 * 3, "no more than create_attempts per creation"

        starts.failure = None  # the engine answers again
        async with pool.acquire():
            pass
        await pool.wait_ready()
        assert pool.ready == 2 and pool.create_limit == 4, "three successes: back to 4"


async def test_creations_in_flight_never_exceed_the_current_limit(starts: Starts) -> None:
    pool = RuntimePool(
        CONFIG, size=0, max_create_concurrency=4, create_attempts=1, retry_backoff=NO_WAIT
    )
    async with pool:
        starts.failure = lambda: OVERLOADED
        for _ in range(2):
            with pytest.raises(ProvisioningError):
                await pool.take()
        assert pool.create_limit == 1
        starts.failure = None
        starts.max_in_flight = 0
        starts.hold()
        try:
            async with anyio.create_task_group() as group:
                for _ in range(4):
                    group.start_soon(pool.take)
                await starts.until(lambda: pool.waiting == 4 and starts.in_flight == 1)
                await anyio.wait_all_tasks_blocked()
                assert (starts.in_flight, pool.creating) == (1, 1), "limit 1: one at a time"

                starts.open()
                starts.hold()  # the next ones wait again
                await starts.until(lambda: pool.waiting == 3 and starts.in_flight == 2)
                await anyio.wait_all_tasks_blocked()
                assert (starts.in_flight, pool.create_limit) == (2, 2), "one success: two"
                starts.open()
        finally:
            starts.open()  # a failed assertion must not leave a shielded start held
        assert starts.max_in_flight == 2 and pool.create_limit == 4
        assert starts.calls == 2 + 4 and pool.handed_out == 4
        for rt in starts.started:
            await rt.close()


async def test_no_creation_starts_during_a_cool_down(starts: Starts) -> None:
    pool = RuntimePool(
        CONFIG, size=0, max_create_concurrency=2, create_attempts=1, retry_backoff=(0.2, 0.2)
    )
    async with pool:
        starts.failure = lambda: SandboxTransportError("engine timed out")
        with pytest.raises(ProvisioningError):
            await pool.take()
        failed_at = anyio.current_time()
        starts.failure = None
        async with pool.acquire():
            assert anyio.current_time() - failed_at >= 0.1, "cool-down: at least half of 0.2s"
        assert starts.calls == 2


async def test_closing_the_pool_during_a_cool_down_does_not_wait_for_it(starts: Starts) -> None:
    pool = RuntimePool(
        CONFIG, size=0, max_create_concurrency=2, create_attempts=1, retry_backoff=(60.0, 60.0)
    )
    outcome: list[BaseException] = []

    async def acquirer() -> None:
        try:
            await pool.take()
        except PoolClosedError as exc:
            outcome.append(exc)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group, pool:
            starts.failure = lambda: OVERLOADED
            with pytest.raises(ProvisioningError):
                await pool.take()
            starts.failure = None
            group.start_soon(acquirer)
            await starts.until(lambda: pool.waiting == 1 and pool.creating == 1)
            await anyio.wait_all_tasks_blocked()
            assert starts.calls == 1, "the creation waits out the cool-down"
    assert len(outcome) == 1 and starts.calls == 1 and starts.started == []
