"""Provenance wired through: judge runs on the rollout's trace (``trace.agents``), their
usage apart from the policy's (``trace.extra_usage["judges"]``), kept by a gated session's
record also when judging fails; ``trainable=True`` on a judge refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from harnesses.base import Budget, Trace
from harnesses.errors import SessionVerifyError
from harnesses.scripted import bash_call, reply
from harnesses.session import AgentSessionFactory
from placement.errors import PlacementConfigError
from placement.inputs import JudgeInputs
from placement.run import run_judges
from placement.specs import AgentSpec, JudgeSpec, load_judges
from placement.verifier import JudgeVerifier
from runtimes import open_runtime

from .conftest import TASK, ModelsFactory

pytestmark = pytest.mark.anyio

SCHEMA = {"score": {"type": "number", "minimum": 0, "maximum": 1}}
WRITE = 'printf \'{"score": 1}\' > "$VF_AGENT_VERDICT"'


def bash_judge(name: str) -> JudgeSpec:
    return JudgeSpec(
        name=name,
        harness={"id": "bash"},
        model=name,
        budget=Budget(max_turns=4, max_seconds=60),
        prompt="Judge the work.",
        verdict_schema=SCHEMA,
    )


def null_judge(name: str) -> JudgeSpec:
    return JudgeSpec(
        name=name, harness="null", model=name, prompt="Judge it.", verdict_schema=SCHEMA
    )


def policy_turn_trace() -> Trace:
    """A policy trace with one turn of known usage (the judges' must not be added to it)."""
    trace = Trace.model_validate(
        {
            "harness": "bash",
            "turns": [
                {
                    "index": 0,
                    "started_at": "2025-01-01T00:00:00Z",
                    "request_messages": [{"role": "user", "content": "hi"}],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10},
                }
            ],
        }
    )
    return trace.finish("done")


async def test_judge_runs_and_their_usage_land_on_the_rollout_trace(
    backend: dict[str, Any], scripted_models: ModelsFactory
) -> None:
    models = scripted_models(
        {
            "files": [bash_call(WRITE, usage=(100, 20)), reply("written", usage=(150, 5))],
            "replies": [reply('{"score": 0.5}', usage=(40, 2))],
        }
    )
    trace = policy_turn_trace()
    before = JudgeInputs.take(TASK, trace)
    async with open_runtime(backend) as runtime:
        runs = await run_judges(
            [bash_judge("files"), null_judge("replies")],
            task=TASK,
            trace=trace,
            models=models,
            runtime=runtime,
        )
    assert [a.name for a in trace.agents] == ["files", "replies"]
    assert [a.agent_id for a in trace.agents] == [r.agent_id for r in runs]
    assert [a.verdict for a in trace.agents] == [{"score": 1.0}, {"score": 0.5}]
    assert {a.role for a in trace.agents} == {"judge"} and not any(
        a.trainable for a in trace.agents
    )
    files, replies = trace.agents
    assert files.trace is not None and len(files.trace.turns) == 2  # the judge's own turns
    assert replies.trace is not None and replies.trace.output == '{"score": 0.5}'
    judges = trace.extra_usage["judges"]
    assert (judges.prompt_tokens, judges.completion_tokens, judges.total_tokens) == (290, 27, 317)
    assert trace.usage.total_tokens == 10  # the policy's own usage is untouched
    assert trace.total_usage.total_tokens == 327
    # A later judging's inputs show the policy's run, not these judges' runs and verdicts.
    assert JudgeInputs.take(TASK, trace) == before
    # It survives the trip through JSON (trace.json of a recorded rollout).
    again = Trace.model_validate_json(trace.model_dump_json())
    assert again.extra_usage == trace.extra_usage
    assert again.agents[0].trace is not None and len(again.agents[0].trace.turns) == 2
    assert again.model_dump() == trace.model_dump()


async def test_a_session_record_keeps_every_judge_trace_when_judging_fails(
    backend: dict[str, Any], scripted_models: ModelsFactory
) -> None:
    models = scripted_models(
        {
            "files": [bash_call(WRITE, usage=(100, 20)), reply("written", usage=(150, 5))],
            "replies": [reply("I think it is fine.", usage=(40, 2))],  # not a verdict
        }
    )
    verify = JudgeVerifier([bash_judge("files"), null_judge("replies")], models=models)
    async with AgentSessionFactory(backend, {"id": "bash"}, verify=verify) as factory:
        session = await factory.create(task=TASK, rollout_id="provenance-0")
        try:
            while (request := await session.next_request(timeout=60)) is not None:
                await session.deliver(request, "all done")
            with pytest.raises(SessionVerifyError, match="replies"):
                await session.verify()
        finally:
            await session.close()
    record = session.record()
    assert record.error_type == "SessionVerifyError" and record.reward is None
    assert record.trace is not None
    files, replies = record.trace.agents
    assert files.verdict == {"score": 1.0} and files.error is None
    assert files.trace is not None and len(files.trace.turns) == 2
    assert replies.error_type == "VerdictInvalid" and replies.verdict is None
    assert replies.trace is not None and replies.trace.output == "I think it is fine."
    assert record.trace.extra_usage["judges"].total_tokens == 317
    assert record.trace.usage == record.turns[0].usage  # the policy's own, judges apart


def test_a_trainable_judge_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="judges are not trainable"):
        JudgeSpec(name="j", prompt="Judge.", verdict_schema=SCHEMA, trainable=True)
    source = tmp_path / "judges.yaml"
    source.write_text(
        "judges:\n  - {name: j, prompt: Judge., verdict_schema: {score: number}, trainable: true}\n"
    )
    with pytest.raises(PlacementConfigError, match="not trainable"):
        load_judges(source)
    # agents other than judges may be trainable, and judges default to not
    assert AgentSpec(name="a", trainable=True).trainable
    assert JudgeSpec(name="j", prompt="Judge.", verdict_schema=SCHEMA).trainable is False
