"""Each way a gated session fails gives its typed error, and leaves nothing running.

A harness that never calls (the request timeout), a trainer that never delivers (the
delivery timeout: the agent gets an error reply), a sandbox that dies mid-session, a
sandbox or harness that cannot start, and closing a session whose agent is busy. After
each: no agent process in the sandbox, no container, no thread, task or open runtime.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from harnesses.base import Budget
from harnesses.errors import (
    SessionClosedError,
    SessionDeliveryTimeout,
    SessionProtocolError,
    SessionRequestTimeout,
    SessionSandboxLost,
    SessionStartError,
    SessionStateError,
)
from harnesses.session import AgentSession, AgentSessionFactory
from runtimes import ProvisioningError, SandboxUnavailableError

from .conftest import (
    DOCKER,
    bash,
    containers_of,
    described,
    host_processes,
    kill_sandbox,
    no_leaks,
    sandbox_processes,
)


async def wait_for_process(session: AgentSession, marker: str) -> None:
    with anyio.fail_after(20):
        while not await sandbox_processes(session, marker):  # noqa: ASYNC110 - polling ps
            await anyio.sleep(0.1)


async def start_command(session: AgentSession, command: str) -> None:
    request = await session.next_request(timeout=60)
    assert request is not None
    await session.deliver(request, bash(command))


@pytest.mark.anyio
async def test_agent_that_never_calls_times_out(backend: dict[str, Any], unique: Any) -> None:
    rollout_id = unique("silent")
    async with no_leaks(), AgentSessionFactory(backend, {"id": "bash"}) as factory:
        session = await factory.create(task="wait", rollout_id=rollout_id)
        await start_command(session, "sleep 31337")
        await wait_for_process(session, "sleep 31337")
        started = anyio.current_time()
        with pytest.raises(SessionRequestTimeout) as caught:
            await session.next_request(timeout=1)
        assert 1 <= anyio.current_time() - started < 15
        assert caught.value.rollout_id == rollout_id
        # when the error surfaced, the agent's command was already killed (checked
        # before yielding to the event loop; a container's processes show on the host)
        assert host_processes("sleep 31337") == [], described("sleep 31337")
        assert await sandbox_processes(session, "sleep 31337") == []
        assert session.status == "failed"
        with pytest.raises(SessionRequestTimeout):
            await session.next_request()
        with pytest.raises(SessionRequestTimeout):
            await session.verify()
        record = session.record()
        assert record.status == "failed" and record.error_type == "SessionRequestTimeout"
        assert len(record.turns) == 1
        await session.close()
        with pytest.raises(SessionClosedError):
            await session.next_request()
    assert containers_of(rollout_id) == []


@pytest.mark.anyio
async def test_trainer_that_never_delivers_fails_the_session(
    backend: dict[str, Any], unique: Any
) -> None:
    rollout_id = unique("late")
    async with (
        no_leaks(),
        AgentSessionFactory(
            backend, {"id": "bash"}, delivery_timeout=1.0, stop_grace=10
        ) as factory,
    ):
        session = await factory.create(task="touch a file", rollout_id=rollout_id)
        request = await session.next_request(timeout=60)
        assert request is not None
        await anyio.sleep(1.5)
        with pytest.raises(SessionDeliveryTimeout) as caught:
            await session.deliver(request, bash("touch never.txt"))
        assert caught.value.rollout_id == rollout_id
        # the harness got an error reply (not a cancellation) and ended its run
        trace = session.trace
        assert trace is not None and trace.error is not None
        assert trace.error.kind == "model_error" and trace.error.status_code == 504
        assert session.gate_trace.turns[0].status_code == 504
        assert "no completion was delivered within 1.0s" in (
            session.gate_trace.turns[0].error or ""
        )
        assert not await session.runtime.exists("never.txt")
        with pytest.raises(SessionDeliveryTimeout):
            await session.next_request()
        assert session.record().error_type == "SessionDeliveryTimeout"
        await session.close()
    assert containers_of(rollout_id) == []


@pytest.mark.anyio
async def test_waiting_trainer_learns_of_a_missed_delivery(unique: Any) -> None:
    """A request the trainer took but never answered fails a concurrent next_request too."""
    async with (
        no_leaks(),
        AgentSessionFactory(
            "subprocess", {"id": "bash"}, delivery_timeout=0.5, stop_grace=10
        ) as factory,
    ):
        session = await factory.create(task="anything", rollout_id=unique("late2"))
        assert await session.next_request(timeout=60) is not None
        with pytest.raises(SessionDeliveryTimeout):
            await session.next_request(timeout=30)
        await session.close()


@pytest.mark.anyio
@pytest.mark.docker
async def test_container_killed_mid_session(unique: Any) -> None:
    rollout_id = unique("killed")
    async with no_leaks(), AgentSessionFactory(DOCKER, {"id": "bash"}) as factory:
        session = await factory.create(task="wait", rollout_id=rollout_id)
        await start_command(session, "sleep 31338")
        await wait_for_process(session, "sleep 31338")
        await kill_sandbox(session)
        with pytest.raises(SessionSandboxLost) as caught:
            await session.next_request(timeout=30)
        assert isinstance(caught.value.__cause__, SandboxUnavailableError)
        trace = session.trace
        assert trace is not None and trace.error is not None
        assert trace.error.kind == "sandbox_error"
        await session.close()
    assert containers_of(rollout_id) == []


@pytest.mark.anyio
async def test_subprocess_sandbox_closed_under_the_session(unique: Any) -> None:
    async with no_leaks(), AgentSessionFactory("subprocess", {"id": "bash"}) as factory:
        session = await factory.create(task="wait", rollout_id=unique("gone"))
        await start_command(session, "sleep 31339")
        await wait_for_process(session, "sleep 31339")
        await session.runtime.close()  # the sandbox goes away under the agent
        assert host_processes("sleep 31339") == []
        request = await session.next_request(timeout=30)  # the agent sees the kill ...
        assert request is not None and "exit_code: 137" in request.messages[-1]["content"]
        await session.deliver(request, bash("echo still there?"))
        with pytest.raises(SessionSandboxLost):  # ... and its next command finds no sandbox
            await session.next_request(timeout=30)
        await session.close()


@pytest.mark.anyio
async def test_close_stops_a_busy_agent(backend: dict[str, Any], unique: Any) -> None:
    rollout_id = unique("busy")
    async with no_leaks(), AgentSessionFactory(backend, {"id": "bash"}) as factory:
        session = await factory.create(task="wait", rollout_id=rollout_id)
        await start_command(session, "sleep 31340")
        await wait_for_process(session, "sleep 31340")
        with anyio.fail_after(30):
            await session.close()
        assert host_processes("sleep 31340") == []
        assert session.status == "stopped"
        record = session.record()
        assert record.status == "stopped" and record.stop_reason == "closed"
        assert record.error is None and len(record.turns) == 1
    assert containers_of(rollout_id) == []


@pytest.mark.anyio
@pytest.mark.docker
async def test_missing_image_is_a_start_error(unique: Any) -> None:
    rollout_id = unique("noimage")
    config = {**DOCKER, "image": "vf-sandbox/does-not-exist:latest"}
    async with no_leaks(), AgentSessionFactory(config, {"id": "bash"}) as factory:
        with pytest.raises(SessionStartError) as caught:
            await factory.create(task="t", rollout_id=rollout_id)
        assert isinstance(caught.value.__cause__, ProvisioningError)
        assert factory.sessions() == []
    assert containers_of(rollout_id) == []


@pytest.mark.anyio
async def test_failing_prepare_is_a_start_error(unique: Any) -> None:
    async def prepare(runtime: Any, task: dict[str, Any]) -> None:
        raise FileNotFoundError("no fixture for this task")

    factory = AgentSessionFactory("subprocess", "bash", prepare=prepare)
    async with no_leaks(), factory:
        with pytest.raises(SessionStartError, match="no fixture"):
            await factory.create(task="t", rollout_id=unique("prep"))


@pytest.mark.anyio
async def test_budget_end_is_a_truncation_not_a_failure(unique: Any) -> None:
    async def reward(context: Any) -> float:
        return 0.5

    async with (
        no_leaks(),
        AgentSessionFactory(
            "subprocess", {"id": "bash"}, budget=Budget(max_turns=1), verify=reward
        ) as factory,
    ):
        session = await factory.create(task="loop", rollout_id=unique("budget"))
        await start_command(session, "true")
        assert await session.next_request() is None
        assert (await session.verify()).reward == 0.5
        record = session.record()
        assert record.status == "truncated" and record.stop_reason == "budget_turns"
        assert record.reward == 0.5 and record.error is None
        await session.close()


@pytest.mark.anyio
async def test_misuse_is_refused_with_typed_errors(unique: Any) -> None:
    with pytest.raises(SessionProtocolError, match="delivery_timeout"):
        AgentSessionFactory("subprocess", "bash", delivery_timeout=0)
    factory = AgentSessionFactory("subprocess", {"id": "bash"})
    with pytest.raises(SessionClosedError):
        await factory.create(task="t", rollout_id="early")
    async with no_leaks(), factory:
        with pytest.raises(SessionProtocolError):
            await factory.create(task="t", rollout_id="bad id with spaces")
        with pytest.raises(SessionProtocolError):
            await factory.create(task={"no": "prompt"}, rollout_id=unique("noprompt"))
        with pytest.raises(SessionProtocolError):
            await factory.create(task={"prompt": ["not a message"]}, rollout_id=unique("bad"))
        rollout_id = unique("misuse")
        chat = [{"role": "user", "content": "as messages"}]
        session = await factory.create(task={"prompt": chat, "id": 3}, rollout_id=rollout_id)
        with pytest.raises(SessionProtocolError, match="already used"):
            await factory.create(task="t", rollout_id=rollout_id)
        with pytest.raises(SessionProtocolError, match="timeout must be > 0"):
            await session.next_request(timeout=0)
        request = await session.next_request()
        assert request is not None and request.messages[-1] == chat[0]
        with pytest.raises(SessionStateError, match="still running"):
            await session.verify()
        with pytest.raises(SessionProtocolError, match="content or tool calls"):
            await session.deliver(request, {})
        with pytest.raises(SessionProtocolError, match="no request"):
            await session.deliver("req-unknown", "hi")
        await session.deliver(request, "done")
        with pytest.raises(SessionProtocolError, match="already answered"):
            await session.deliver(request, "again")
        assert await session.next_request() is None
        with pytest.raises(SessionStateError, match="no verify function"):
            await session.verify()
        await session.close()
        with pytest.raises(SessionClosedError):
            await session.deliver(request, "late")
        with pytest.raises(SessionClosedError):
            _ = session.runtime
    with pytest.raises(SessionClosedError):
        await factory.create(task="t", rollout_id=unique("after"))


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_factory_block_errors_come_out_unwrapped(unique: Any) -> None:
    """An error raised in the ``async with`` block is the caller's own error (not an
    ExceptionGroup), and cancelling the block closes its sessions."""

    async def prepare(runtime: Any, task: dict[str, Any]) -> None:
        raise FileNotFoundError("no fixture")

    async with no_leaks():
        with pytest.raises(SessionStartError):
            async with AgentSessionFactory("subprocess", "bash", prepare=prepare) as factory:
                await factory.create(task="t", rollout_id=unique("unwrapped"))
        with pytest.raises(KeyError):
            async with AgentSessionFactory("subprocess", "bash") as factory:
                session = await factory.create(task="t", rollout_id=unique("body"))
                raise KeyError("the trainer's own bug")
        assert session.closed
        with anyio.CancelScope() as scope:
            async with AgentSessionFactory("subprocess", "bash") as factory:
                session = await factory.create(task="t", rollout_id=unique("cancel"))
                await start_command(session, "sleep 31342")
                await wait_for_process(session, "sleep 31342")  # cancelled while it runs
                scope.cancel()
                await anyio.sleep(30)
        assert scope.cancelled_caught and session.closed
        assert host_processes("sleep 31342") == []
