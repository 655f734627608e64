"""The conformance kit's sandbox sharing (``docs/conformance.md``): which checks share a
sandbox, that a sharing check leaves nothing a later one could see, and how
:class:`CheckRunner`, ``run_conformance(share_sandbox=True)`` and ``RuntimeConformance``
open, reuse, replace and close sandboxes. On the subprocess runtime, whose sandboxes are host
directories the test can look into."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from runtimes import Runtime
from runtimes.testing import CHECKS, Check, CheckRunner, CheckSkipped, run_conformance
from runtimes.testing.checks import SCRATCH_PREFIX

pytest_plugins = ["pytester"]

SUBPROCESS = {"type": "subprocess"}
FRESH = {
    "alive_and_closed",
    "close_twice",
    "background_process_keeps_running",
    "stop_processes",
    "spawn_ended_by_stop_processes",
}
"""The checks that close their runtime or are about all of the sandbox's processes."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_only_closing_and_process_wide_checks_get_a_fresh_sandbox() -> None:
    assert {c.name for c in CHECKS if not c.shares_sandbox} == FRESH


class _Recorder:
    """Checks that record the runtime they were given (and optionally fail or close it)."""

    def __init__(self) -> None:
        self.seen: list[Runtime] = []

    def make(self, name: str, *, shares: bool, then: str = "") -> Check:
        async def fn(rt: Runtime) -> None:
            self.seen.append(rt)
            if then == "fail":
                raise AssertionError(f"{name} failed on purpose")
            if then == "skip":
                raise CheckSkipped(f"{name} does not apply")
            if then == "close":
                await rt.close()

        return Check(name, fn, f"records its runtime ({then or 'passes'})", shares)


@pytest.mark.anyio
async def test_runner_shares_one_sandbox_and_gives_the_others_fresh_ones() -> None:
    rec = _Recorder()
    shared_a, shared_b = rec.make("a", shares=True), rec.make("b", shares=True)
    fresh = rec.make("fresh", shares=False)
    async with CheckRunner(SUBPROCESS) as runner:
        for chk in (shared_a, fresh, shared_b):
            await runner.run(chk)
        first, middle, last = rec.seen
        assert first is last and not first.closed, "the sharing checks got one open sandbox"
        assert middle is not first and middle.closed, "the other check got its own, closed after"
    assert first.closed, "leaving the runner closes the shared sandbox"


@pytest.mark.anyio
async def test_runner_without_sharing_gives_every_check_a_fresh_sandbox() -> None:
    rec = _Recorder()
    async with CheckRunner(SUBPROCESS, share_sandbox=False) as runner:
        await runner.run(rec.make("a", shares=True))
        await runner.run(rec.make("b", shares=True))
    first, second = rec.seen
    assert first is not second and first.closed and second.closed


@pytest.mark.anyio
async def test_a_failed_check_costs_its_shared_sandbox_a_skip_does_not() -> None:
    rec = _Recorder()
    async with CheckRunner(SUBPROCESS) as runner:
        with pytest.raises(CheckSkipped):
            await runner.run(rec.make("skips", shares=True, then="skip"))
        await runner.run(rec.make("after-skip", shares=True))
        with pytest.raises(AssertionError, match="failed on purpose"):
            await runner.run(rec.make("fails", shares=True, then="fail"))
        await runner.run(rec.make("after-failure", shares=True))
        skipped, after_skip, failed, after_failure = rec.seen
        assert skipped is after_skip is failed
        assert failed.closed, "the sandbox a check failed in is closed at once"
        assert after_failure is not failed and not after_failure.closed


@pytest.mark.anyio
async def test_a_sharing_check_that_closes_its_sandbox_fails() -> None:
    rec = _Recorder()
    async with CheckRunner(SUBPROCESS) as runner:
        with pytest.raises(AssertionError, match="closer shares its sandbox but closed it"):
            await runner.run(rec.make("closer", shares=True, then="close"))
        await runner.run(rec.make("next", shares=True))
    closed, fresh = rec.seen
    assert fresh is not closed


def test_run_conformance_shares_when_asked() -> None:
    selected = ["stdout_exact", "env", "close_twice", "unreadable_file"]
    outcomes = run_conformance(SUBPROCESS, select=selected, share_sandbox=True)
    statuses = {o.name: o.status for o in outcomes}
    assert statuses == {
        "stdout_exact": "pass",
        "env": "pass",
        "close_twice": "pass",
        "unreadable_file": "skip" if _root() else "pass",
    }


def _root() -> bool:
    return os.geteuid() == 0


# ---------------------------------------------------------------------- verify_sharing
# Every sharing check is verified this way on every run: tests/conformance/test_subprocess.py.


@pytest.mark.anyio
async def test_verify_sharing_fails_a_check_that_leaves_a_process() -> None:
    token = "311.4159265"

    async def leaves_a_daemon(rt: Runtime) -> None:
        await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 &"])

    chk = Check("leaves_a_daemon", leaves_a_daemon, "leaves a process", True)
    async with CheckRunner(SUBPROCESS, verify_sharing=True) as runner:
        with pytest.raises(AssertionError, match="left 1 processes running"):
            await runner.run(chk)
    async with CheckRunner(SUBPROCESS, verify_sharing=False) as runner:
        await runner.run(chk)  # unverified, it passes (its sandbox's close ends the daemon)


@pytest.mark.anyio
async def test_verify_sharing_fails_a_check_that_writes_outside_its_scratch() -> None:
    async def writes_beside(rt: Runtime) -> None:
        await rt.write("notes.txt", b"left for the next check")

    async def writes_in_scratch(rt: Runtime) -> None:
        await rt.write(f"{SCRATCH_PREFIX}{os.getpid()}/notes.txt", b"mine")

    async with CheckRunner(SUBPROCESS, verify_sharing=True) as runner:
        with pytest.raises(AssertionError, match=r"made \['notes.txt'\] in the workdir"):
            await runner.run(Check("writes_beside", writes_beside, "", True))
        await runner.run(Check("writes_in_scratch", writes_in_scratch, "", True))


# ---------------------------------------------------------------------- the pytest suite


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Runtime]]:
    """Every runtime started while the test runs."""
    started: list[Runtime] = []
    original = Runtime.start

    async def start(self: Runtime) -> Runtime:
        started.append(self)
        return await original(self)

    monkeypatch.setattr(Runtime, "start", start)
    yield started


def test_pytest_suite_shares_one_sandbox_per_event_loop_and_closes_them(
    pytester: pytest.Pytester, opened: list[Runtime]
) -> None:
    """A ``share_sandbox`` class: the sharing checks of each event loop ran in one sandbox, the
    others each in a fresh one, and all are closed when the class ends."""
    pytester.makepyfile(
        test_shared="""
        from runtimes.testing import RuntimeConformance


        class TestShared(RuntimeConformance):
            config = {"type": "subprocess"}
            anyio_backends = ("asyncio", "trio")
            share_sandbox = True
        """
    )
    names = ["stdout_exact", "env", "file_round_trip", "close_twice"]
    ids = [f"test_shared.py::TestShared::test_conformance[{name}]" for name in names]
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", *ids)
    result.assert_outcomes(passed=len(names))
    fresh_runs = 2  # close_twice under asyncio and trio
    assert len(opened) == 2 + fresh_runs, opened
    assert all(rt.closed for rt in opened)
