"""An installed agent (the tiny test agent, in the sandbox) gated through the same proxy path.

The agent runs INSIDE the sandbox and calls its harness's own proxy, which forwards to the
session's gated proxy on the host: the trainer still answers every call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harnesses.errors import SessionAgentFailed
from harnesses.session import AgentSessionFactory, Completion
from tests.harnesses.test_installed import TinyConfig, TinyHarness, build_tiny_wheel

from .conftest import ScriptedTrainer, bash, containers_of, no_leaks


def tiny_harness(tmp_path: Path, backend: dict[str, Any]) -> TinyHarness:
    wheelhouse = tmp_path / "wheelhouse"
    build_tiny_wheel(wheelhouse)
    fields: dict[str, Any] = {"wheelhouse": str(wheelhouse)}
    if backend["type"] == "subprocess":
        fields["install_root"] = str(tmp_path / "agents")  # the host's filesystem
    return TinyHarness(TinyConfig(**fields))


@pytest.mark.anyio
async def test_installed_agent_is_gated(
    backend: dict[str, Any], tmp_path: Path, unique: Any
) -> None:
    trainer = ScriptedTrainer([bash("echo made-by-agent > made.txt"), "finished"])
    rollout_id = unique("tiny")
    factory = AgentSessionFactory(backend, tiny_harness(tmp_path, backend))
    async with no_leaks(), factory:
        session = await factory.create(task="make a file", rollout_id=rollout_id)
        await trainer.drive(session)
        assert await session.runtime.read("made.txt") == b"made-by-agent\n"
        record = session.record()
        await session.close()
    assert containers_of(rollout_id) == []
    trace = session.trace  # recorded by the harness's own proxy, inside the run
    assert trace is not None and trace.ok, trace and trace.error
    assert trace.output == "finished"
    assert [r.messages for r in trainer.requests] == [t.request_messages for t in trace.turns]
    assert trainer.requests[0].messages == [{"role": "user", "content": "make a file"}]
    assert trainer.requests[1].messages[-1]["content"] == "exit 0\n"
    assert record.linear and len(record.turns) == 2
    assert record.messages[-1] == {"role": "assistant", "content": "finished"}
    assert record.messages[1] == trainer.delivered[0].assistant_message()


@pytest.mark.anyio
async def test_agent_crash_is_an_agent_failure(tmp_path: Path, unique: Any) -> None:
    """The tiny agent cannot parse tool arguments that are not JSON and exits with an error."""
    backend = {"type": "subprocess"}
    broken = Completion(tool_calls=[{"name": "bash", "arguments": "{not json"}])
    factory = AgentSessionFactory(backend, tiny_harness(tmp_path, backend))
    async with no_leaks(), factory:
        session = await factory.create(task="make a file", rollout_id=unique("crash"))
        request = await session.next_request(timeout=60)
        assert request is not None
        await session.deliver(request, broken)
        with pytest.raises(SessionAgentFailed, match="agent_error") as caught:
            await session.next_request(timeout=60)
        assert "JSONDecodeError" in str(caught.value)
        assert session.record().status == "failed"
        await session.close()
