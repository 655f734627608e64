"""The one table at the Ray boundary (runtimes/ray/calls.py), on Ray's own exception classes,
and the bounded retry of idempotent calls. No cluster needed."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Generator

import pytest
from ray import exceptions as rx

from runtimes import (
    SandboxError,
    SandboxFileNotFoundError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from runtimes.ray.calls import ray_error, retried, settle

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def task_error(cause: BaseException) -> rx.RayTaskError:
    return rx.RayTaskError("SandboxHost.read", "traceback", cause)


def test_a_typed_error_raised_on_the_node_is_itself() -> None:
    cause = SandboxFileNotFoundError("/work/missing")
    translated = ray_error(task_error(cause), "read")
    assert translated is cause
    # Ray's copy of it (a RayTaskError subclassing the cause) is unwrapped the same way
    dual = task_error(cause).as_instanceof_cause()
    assert ray_error(dual, "read") is cause


@pytest.mark.parametrize(
    "exc",
    [
        rx.ActorDiedError(),
        rx.NodeDiedError("node gone"),
        rx.WorkerCrashedError(),
        rx.OwnerDiedError("00" * 28, None, "call site"),
        rx.ObjectLostError("00" * 28, None, "call site"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_dead_actor_or_node_is_unavailable(exc: BaseException) -> None:
    translated = ray_error(exc, "exec")
    assert isinstance(translated, SandboxUnavailableError)
    assert "exec" in str(translated)


@pytest.mark.parametrize(
    "exc",
    [
        rx.ActorUnavailableError("connection reset", None),
        rx.RaySystemError("the GCS is gone"),
        rx.GetTimeoutError("timed out"),
        ConnectionResetError("reset"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_failed_connection_to_the_cluster_is_a_transport_error(exc: BaseException) -> None:
    assert isinstance(ray_error(exc, "read"), SandboxTransportError)


def test_anything_else_the_node_raised_is_a_sandbox_error_with_it_attached() -> None:
    translated = ray_error(task_error(KeyError("bug")), "write")
    assert type(translated) is SandboxError and "KeyError" in str(translated)


async def test_an_idempotent_call_is_retried_a_bounded_number_of_times() -> None:
    attempts: list[int] = []

    async def flaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise SandboxTransportError("lost")
        return "ok"

    assert await retried(flaky, 3) == "ok" and len(attempts) == 3
    attempts.clear()

    async def down() -> str:
        attempts.append(1)
        raise SandboxTransportError("lost")

    with pytest.raises(SandboxTransportError):
        await retried(down, 2)
    assert len(attempts) == 3  # the first and two retries, no more

    async def gone() -> str:
        attempts.append(1)
        raise SandboxUnavailableError("gone")

    attempts.clear()
    with pytest.raises(SandboxUnavailableError):
        await retried(gone, 3)
    assert len(attempts) == 1  # a dead sandbox is never retried


class _Ref:
    """A Ray object reference as :func:`settle` uses one: awaitable under asyncio, a
    ``concurrent.futures.Future`` (waited on in a worker thread) under any other loop."""

    def __init__(self, value: str) -> None:
        self.value = value
        self.ways: list[str] = []

    def __await__(self) -> Generator[None, None, str]:
        self.ways.append("awaited")
        return self._value().__await__()

    async def _value(self) -> str:
        return self.value

    def future(self) -> concurrent.futures.Future[str]:
        self.ways.append("future")
        done: concurrent.futures.Future[str] = concurrent.futures.Future()
        done.set_result(self.value)
        return done


async def test_a_call_is_awaited_on_asyncio_and_through_a_thread_on_any_other_loop(
    anyio_backend: str,
) -> None:
    ref = _Ref("answer")
    assert await settle(ref, "probing") == "answer"
    assert ref.ways == (["awaited"] if anyio_backend == "asyncio" else ["future"])
