"""The reaper (runtimes/reaper.py): background removals are run, waited for, and their
failures raised by the next drain, never dropped."""

from __future__ import annotations

import threading

import pytest

from runtimes import SandboxError, SandboxTransportError, drain_removals, drain_removals_blocking
from runtimes.reaper import pending_removals, remove_in_background

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_drain_waits_for_every_queued_removal() -> None:
    done: list[int] = []
    gate = threading.Event()

    def slow(n: int) -> None:
        gate.wait(10)
        done.append(n)

    for n in range(8):
        remove_in_background(f"box {n}", lambda n=n: slow(n))
    assert pending_removals() == 8
    gate.set()
    await drain_removals()
    assert sorted(done) == list(range(8)) and pending_removals() == 0


async def test_one_failure_is_raised_once_as_it_was() -> None:
    def refuse() -> None:
        raise SandboxTransportError("engine did not answer")

    remove_in_background("box", refuse)
    with pytest.raises(SandboxTransportError, match="engine did not answer"):
        await drain_removals()
    await drain_removals()  # taken: not raised again


def test_several_failures_are_named_in_one_error_and_a_bug_is_typed_too() -> None:
    def bug() -> None:
        raise KeyError("oops")

    def refuse() -> None:
        raise SandboxError("refused")

    remove_in_background("box a", bug)
    remove_in_background("box b", refuse)
    with pytest.raises(SandboxError, match="2 background removals failed") as caught:
        drain_removals_blocking()
    assert "box a" in str(caught.value) and "KeyError" in str(caught.value)
    assert "refused" in str(caught.value)


def test_a_removal_still_running_after_the_timeout_is_a_transport_error() -> None:
    gate = threading.Event()
    remove_in_background("stuck box", lambda: gate.wait(10) and None)
    try:
        with pytest.raises(SandboxTransportError, match="1 sandbox removal"):
            drain_removals_blocking(timeout=0.2)
    finally:
        gate.set()
    drain_removals_blocking()
