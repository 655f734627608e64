"""The trainer side (``harnesses.trainer``): the concurrent driver, the HTTP generator and the
record -> training-sample builder, against the scripted endpoint standing in for vLLM."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harnesses.base import Budget
from harnesses.errors import SampleError
from harnesses.llm import ModelTable
from harnesses.scripted import (
    ScriptedEndpoint,
    ScriptItem,
    bash_call,
    byte_tokens,
    render_chat,
    reply,
)
from harnesses.session import AgentSessionFactory, Completion
from harnesses.trainer import (
    OpenAIGenerator,
    RolloutResult,
    TrainingSample,
    build_sample,
    run_rollouts,
)
from placement.specs import JudgeSpec
from placement.verifier import JudgeVerifier

from .conftest import SUBPROCESS, no_leaks

pytestmark = pytest.mark.anyio

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "trainer_rollouts.py"
WORD = re.compile(r"the word (\w+)")
WRONG = "w3x"  # the policy gets this rollout wrong: its reward must be 0
CHECK = (
    'w=$(sed -n \'s/.*"word": "\\(.*\\)".*/\\1/p\' "$VF_AGENT_INPUTS/task.json"); '
    'if [ "$(cat out.txt 2>/dev/null)" = "$w" ]; then s=1; else s=0; fi; '
    'printf \'{"score": %s}\' "$s" > "$VF_AGENT_VERDICT"'
)


def policy(body: dict[str, Any]) -> ScriptItem:
    """The policy model: writes its task's word to out.txt, then says done."""
    messages = body["messages"]
    if messages[-1]["role"] == "tool":
        return reply("done")
    match = WORD.search(str(messages[1]["content"]))
    assert match is not None, messages
    word = "wrong" if match.group(1) == WRONG else match.group(1)
    return bash_call(f"printf {word} > out.txt && cat out.txt")


def grader(body: dict[str, Any]) -> ScriptItem:
    """The judge's model: runs the check that writes the verdict, then stops."""
    if body["messages"][-1]["role"] == "tool":
        return reply("verdict written")
    return bash_call(CHECK)


def judge() -> JudgeSpec:
    return JudgeSpec(
        name="word-check",
        harness={"id": "bash"},
        budget=Budget(max_turns=4, max_seconds=120),
        prompt="Check that out.txt holds the task's word.",
        verdict_schema={"score": {"type": "number", "minimum": 0, "maximum": 1}},
    )


def tasks(count: int) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"r{i}", {"prompt": f"Write the word w{i}x to out.txt.", "word": f"w{i}x"})
        for i in range(count)
    ]


async def test_driver_runs_8_concurrent_rollouts_into_masked_samples(
    backend: dict[str, Any],
) -> None:
    peak: list[int] = []
    async with no_leaks():
        with (
            ScriptedEndpoint(respond=policy) as vllm,
            ScriptedEndpoint(respond=grader) as grading,
        ):
            verify = JudgeVerifier(
                [judge()], models=ModelTable(models={"grader": grading.endpoint()})
            )
            async with (
                AgentSessionFactory(backend, {"id": "bash"}, verify=verify) as factory,
                OpenAIGenerator(vllm.endpoint()) as http_generate,
            ):

                async def generate(*args: Any) -> Completion:
                    peak.append(len(factory.sessions()))
                    return await http_generate(*args)

                results = await run_rollouts(
                    factory, tasks(8), generate, concurrency=4, sampling={"temperature": 0.7}
                )
        assert vllm.failures == [] and grading.failures == []

    assert [r.rollout_id for r in results] == [f"r{i}" for i in range(8)]
    assert all(r.ok for r in results), [(r.rollout_id, r.error) for r in results]
    assert 1 < max(peak) <= 4  # really concurrent, and bounded
    rewards = {r.rollout_id: r.record.reward for r in results if r.record}
    assert rewards == {f"r{i}": (0.0 if f"w{i}x" == WRONG else 1.0) for i in range(8)}
    # the trainer's sampling reached the endpoint, with the vLLM flags
    sent = [r.body for r in vllm.requests]
    assert len(sent) == 16
    assert all(b["temperature"] == 0.7 and b["logprobs"] and b["return_token_ids"] for b in sent)
    for result in results:
        check_sample(result)


def check_sample(result: RolloutResult) -> None:
    record = result.record
    assert record is not None and record.linear and len(record.turns) == 2
    sample = build_sample(record)
    assert sample.reward == record.reward and sample.messages == record.messages
    assert sample.message_mask == [0, 0, 1, 0, 1]
    assert sample.token_ids is not None and sample.loss_mask is not None
    assert sample.logprobs is not None
    assert len(sample.token_ids) == len(sample.loss_mask) == len(sample.logprobs)
    # The tokens are the whole conversation, exactly; the mask covers what was delivered.
    text = bytes(sample.token_ids).decode()
    assert text == render_chat(record.messages, generation_prompt=False)
    learned = bytes(t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m)
    delivered = [t.completion for t in record.turns]
    assert learned == b"".join(bytes(c.metadata["token_ids"]) for c in delivered)
    assert learned.decode().count("<|end|>") == 2  # two assistant turns ...
    assert "<|tool|>" not in learned.decode() and "<|user|>" not in learned.decode()  # only
    prompt_ids = delivered[1].metadata["prompt_token_ids"]
    assert sum(1 for m in sample.loss_mask if m == 0) == len(prompt_ids) - len(
        delivered[0].metadata["token_ids"]
    )
    # logprobs: the endpoint's on delivered tokens, 0.0 on prompt tokens
    kept = [lp for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if m]
    assert kept == [*delivered[0].metadata["logprobs"], *delivered[1].metadata["logprobs"]]
    assert all(lp < 0 for lp in kept)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask, strict=True) if not m)
    # the judge's run is on the record's trace, its usage kept apart
    assert record.trace is not None
    assert [a.name for a in record.trace.agents] == ["word-check"]
    assert record.trace.extra_usage["judges"].total_tokens > 0
    json.loads(sample.model_dump_json())


async def test_a_plain_string_generate_and_a_failing_one() -> None:
    """``generate`` may return just the text; a generate that raises fails its rollout only,
    typed, and the others finish."""
    seen: list[tuple[str, int, int, dict[str, Any]]] = []

    async def generate(
        rollout_id: str, turn: int, messages: list[Any], tools: Any, sampling: dict[str, Any]
    ) -> str:
        seen.append((rollout_id, turn, len(messages), sampling))
        if rollout_id == "bad":
            raise ConnectionError("the inference server went away")
        return f"finished {rollout_id}"

    async with no_leaks(), AgentSessionFactory(SUBPROCESS, {"id": "bash"}) as factory:
        results = await run_rollouts(
            factory, [("a", "say hi"), ("bad", "say hi"), ("b", "say hi")], generate
        )
    ok, bad, other = results
    assert ok.ok and other.ok and not bad.ok
    assert bad.error_type == "SessionGenerateError" and "went away" in (bad.error or "")
    assert bad.record is not None and bad.record.turns == []
    assert ok.record is not None and ok.record.messages[-1] == {
        "role": "assistant",
        "content": "finished a",
    }
    sample = build_sample(ok.record)
    assert sample.message_mask == [0, 0, 1] and sample.token_ids is None  # no token ids given
    assert {(rid, turn) for rid, turn, _, _ in seen} == {("a", 0), ("bad", 0), ("b", 0)}


async def test_a_prompt_that_does_not_extend_is_refused() -> None:
    """Token ids that do not chain (a re-tokenised history) never become one silent sample."""
    with ScriptedEndpoint(respond=policy) as vllm:
        async with (
            AgentSessionFactory(SUBPROCESS, {"id": "bash"}) as factory,
            OpenAIGenerator(vllm.endpoint()) as generate,
        ):
            (result,) = await run_rollouts(factory, tasks(1), generate)
    assert result.record is not None
    record = result.record
    assert build_sample(record).token_ids is not None
    broken = record.model_copy(deep=True)
    broken.turns[1].completion.metadata["prompt_token_ids"] = byte_tokens("another template")
    with pytest.raises(SampleError, match="turn 1"):
        build_sample(broken)


def test_the_example_runs_and_prints_masked_samples() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "subprocess"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    samples = [TrainingSample.model_validate(s) for s in json.loads(done.stdout)]
    assert len(samples) == 8
    assert sorted(s.reward for s in samples if s.reward is not None) == [0.0] + [1.0] * 7
    for sample in samples:
        assert sample.token_ids and sample.loss_mask and sample.logprobs
        assert 0 < sum(sample.loss_mask) < len(sample.loss_mask)
    assert "8 rollouts" in done.stderr
