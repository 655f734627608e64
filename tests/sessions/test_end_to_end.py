"""Gated sessions end to end with the bash harness, on subprocess and Docker.

A scripted trainer answers every model call; the checks compare what it was handed with
what the harness really sent (its own trace), what it delivered with what the harness
received and did (files in the sandbox), and the rollout record with both. The reward
comes from a bash judge placed in the rollout's sandbox, whose command really checks the
file the policy wrote.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from harnesses.bash import BASH_TOOL
from harnesses.errors import SessionSandboxLost
from harnesses.llm import ModelTable
from harnesses.scripted import ScriptedEndpoint, bash_call, reply
from harnesses.session import AgentSessionFactory, Completion, RolloutRecord
from placement.specs import JudgeSpec
from placement.verifier import JudgeVerifier
from runtimes import SandboxUnavailableError

from .conftest import ScriptedTrainer, bash, containers_of, kill_sandbox, no_leaks

CHECK_FILE = (
    'if [ "$(cat hello.txt)" = hello ]; then s=1; else s=0; fi; '
    'printf \'{"score": %s}\' "$s" > "$VF_AGENT_VERDICT"'
)
TASK = {"id": "hello-1", "prompt": "Write 'hello' into hello.txt, then say done."}


@pytest.fixture
def grader() -> Iterator[ScriptedEndpoint]:
    """The judge's model: it runs the check, writes the verdict, and says so."""
    with ScriptedEndpoint([bash_call(CHECK_FILE), reply("verdict written")]) as server:
        yield server
    assert server.failures == []


def file_judge() -> JudgeSpec:
    return JudgeSpec(
        name="file-check",
        harness={"id": "bash"},
        model="grader",
        budget={"max_turns": 4, "max_seconds": 120},
        prompt="Check that hello.txt holds 'hello'; score 1 if so, else 0.",
        verdict_schema={"score": {"type": "number", "minimum": 0, "maximum": 1}},
    )


def verifier(grader: ScriptedEndpoint) -> JudgeVerifier:
    return JudgeVerifier([file_judge()], models=ModelTable(models={"grader": grader.endpoint()}))


def assert_record_matches_trace(record: RolloutRecord, trainer: ScriptedTrainer) -> None:
    trace = record.trace
    assert trace is not None and trace.ok, trace and trace.error
    last = trace.turns[-1]
    assert last.reply is not None
    assert record.messages == [*last.request_messages, last.reply.assistant_message()]
    assert len(record.turns) == len(trace.turns) == len(trainer.delivered)
    assert record.linear
    for turn, harness_turn, delivered in zip(
        record.turns, trace.turns, trainer.delivered, strict=True
    ):
        assert turn.completion == delivered
        assert turn.message_index == len(harness_turn.request_messages)
        assert record.messages[turn.message_index] == delivered.assistant_message()
    mask = record.delivered_mask()
    assert [record.messages[i]["role"] for i, m in enumerate(mask) if m] == ["assistant"] * len(
        trainer.delivered
    )
    dumped = record.model_dump_json()
    assert RolloutRecord.model_validate_json(dumped).model_dump_json() == dumped


@pytest.mark.anyio
async def test_bash_session_end_to_end(
    backend: dict[str, Any], grader: ScriptedEndpoint, unique: Any
) -> None:
    trainer = ScriptedTrainer(
        [
            bash("printf hello > hello.txt && echo written"),
            bash("cat hello.txt", usage={"prompt_tokens": 50, "completion_tokens": 7}),
            Completion(content="done", metadata={"token_ids": [1, 2, 3], "logprobs": [-0.5]}),
        ]
    )
    rollout_id = unique("e2e")
    async with (
        no_leaks(),
        AgentSessionFactory(
            backend, {"id": "bash"}, verify=verifier(grader), request_timeout=60
        ) as factory,
    ):
        session = await factory.create(task=TASK, rollout_id=rollout_id)
        await trainer.drive(session)
        assert await session.runtime.read("hello.txt") == b"hello"
        verification = await session.verify()
        record = session.record()
        await session.close()
        await session.close()  # idempotent
    assert containers_of(rollout_id) == []

    trace = session.trace
    assert trace is not None and trace.output == "done"
    # every intercepted request is the harness's real request
    assert [r.messages for r in trainer.requests] == [t.request_messages for t in trace.turns]
    assert all(r.tools == [BASH_TOOL] for r in trainer.requests)
    assert trainer.requests[0].messages[-1] == {"role": "user", "content": TASK["prompt"]}
    assert [r.turn for r in trainer.requests] == [0, 1, 2]
    # every delivered completion is what the harness received, and the tool really ran
    for harness_turn, delivered in zip(trace.turns, trainer.delivered, strict=True):
        assert harness_turn.reply is not None
        assert harness_turn.reply.content == delivered.content
        assert harness_turn.reply.tool_calls == delivered.tool_calls
    first, second = trace.turns[0].tool_results[0], trace.turns[1].tool_results[0]
    assert first.exit_code == 0 and "written" in first.output
    assert second.exit_code == 0 and "stdout:\nhello" in second.output
    assert trainer.requests[2].messages[-1] == {
        "role": "tool",
        "tool_call_id": trainer.delivered[1].tool_calls[0].id,
        "content": second.output,
    }
    # usage: as given where the trainer gave it, estimated otherwise
    assert trace.turns[1].usage.total_tokens == 57
    assert [t.usage_estimated for t in record.turns] == [True, False, True]
    assert all(t.usage.total_tokens > 0 for t in record.turns)
    # the gated proxy recorded the same turns
    assert [t.request_messages for t in session.gate_trace.turns] == [
        t.request_messages for t in trace.turns
    ]
    assert [t.status_code for t in session.gate_trace.turns] == [200, 200, 200]
    # the record: same conversation and turns as the trace, reward from the judge
    assert_record_matches_trace(record, trainer)
    assert record.status == "completed" and record.stop_reason == "completed"
    assert record.turns[2].completion.metadata == {"token_ids": [1, 2, 3], "logprobs": [-0.5]}
    assert verification.reward == 1.0
    assert record.reward == 1.0
    assert record.verification is not None
    assert record.verification["verdicts"] == {"file-check": {"score": 1.0}}
    assert record.rollout_id == rollout_id and record.task == TASK
    json.loads(record.model_dump_json())
    # what the trainer was handed is its own copy: changing it changes no record
    trainer.requests[-1].messages.clear()
    assert session.record().messages == record.messages


@pytest.mark.anyio
async def test_reward_follows_what_the_policy_did(grader: ScriptedEndpoint, unique: Any) -> None:
    """The judge really checks the file: a policy that writes the wrong text gets 0."""
    trainer = ScriptedTrainer([bash("printf goodbye > hello.txt"), "done"])
    async with (
        AgentSessionFactory("subprocess", {"id": "bash"}, verify=verifier(grader)) as factory,
        await factory.create(task=TASK, rollout_id=unique("wrong")) as session,
    ):
        await trainer.drive(session)
        assert (await session.verify()).reward == 0.0
        assert session.record().reward == 0.0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_session_under_trio(unique: Any) -> None:
    async def reward(context: Any) -> float:
        return float(await context.runtime.read("n.txt") == b"7\n")

    trainer = ScriptedTrainer([bash("echo 7 > n.txt"), "ok"])
    async with no_leaks(), AgentSessionFactory("subprocess", "bash", verify=reward) as factory:
        session = await factory.create(task="write 7 to n.txt", rollout_id=unique("trio"))
        await trainer.drive(session)
        assert (await session.verify()).reward == 1.0
        assert_record_matches_trace(session.record(), trainer)
        await session.close()


@pytest.mark.anyio
async def test_interleaved_sessions_stay_apart(unique: Any) -> None:
    """A trainer batching several rollouts: requests answered out of order, each session
    sees only its own calls and its own sandbox."""
    async with no_leaks():
        async with AgentSessionFactory("subprocess", {"id": "bash"}) as factory:
            sessions = [
                await factory.create(task=f"write {n} to n.txt", rollout_id=unique(f"batch{n}"))
                for n in range(3)
            ]
            first = [await s.next_request() for s in sessions]
            for n, (session, request) in reversed(
                list(enumerate(zip(sessions, first, strict=True)))
            ):
                assert request is not None
                assert request.messages[-1]["content"] == f"write {n} to n.txt"
                await session.deliver(request, bash(f"echo {n} > n.txt"))
            for n, session in enumerate(sessions):
                request = await session.next_request()
                assert request is not None and "exit_code: 0" in request.messages[-1]["content"]
                await session.deliver(request.request_id, f"wrote {n}")
                assert await session.next_request() is None
                assert await session.runtime.read("n.txt") == f"{n}\n".encode()
            assert len(factory.sessions()) == 3
        # leaving the factory closed every session
        assert all(s.closed for s in sessions)
        assert factory.sessions() == []


@pytest.mark.anyio
async def test_sandbox_lost_before_judging_is_typed(
    backend: dict[str, Any], grader: ScriptedEndpoint, unique: Any
) -> None:
    """The rollout finished, then its sandbox died: verify raises SessionSandboxLost, never
    a reward."""
    trainer = ScriptedTrainer([bash("printf hello > hello.txt"), "done"])
    rollout_id = unique("lostjudge")
    async with (
        no_leaks(),
        AgentSessionFactory(backend, {"id": "bash"}, verify=verifier(grader)) as factory,
    ):
        session = await factory.create(task=TASK, rollout_id=rollout_id)
        await trainer.drive(session)
        await kill_sandbox(session)
        with pytest.raises(SessionSandboxLost) as caught:
            await session.verify()
        assert isinstance(caught.value.__cause__, SandboxUnavailableError)
        record = session.record()
        assert record.reward is None and record.error_type == "SessionSandboxLost"
        assert record.status == "completed"  # the agent's own run was fine
        await session.close()
    assert containers_of(rollout_id) == []
    grader.stop()
    assert grader.requests == []  # no judge was ever asked
