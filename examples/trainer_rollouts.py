"""The trainer side, end to end and offline: 8 gated rollouts at once, turned into samples.

A stand-in for a vLLM server (the scripted endpoint, which returns token ids and logprobs
the way vLLM does when asked) plays the policy. :func:`harnesses.trainer.run_rollouts`
runs 8 bash-harness rollouts, at most 4 sandboxes alive at a time; every model call of
every harness is answered by :class:`harnesses.trainer.OpenAIGenerator`, which calls that
server over HTTP. A bash judge scores each rollout in its sandbox (its scripted model
checks that ``out.txt`` holds the task's word; the policy gets rollout ``r3`` wrong). Each
record becomes a :class:`harnesses.trainer.TrainingSample`: token ids, logprobs, and the
loss mask (1 on the completions the trainer delivered, 0 on prompts and tool output).
The samples are printed as a JSON list on stdout, a summary on stderr.

    make images                                       # vf-sandbox/python:latest (once)
    .venv/bin/python examples/trainer_rollouts.py     # Docker
    .venv/bin/python examples/trainer_rollouts.py subprocess   # no Docker
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import anyio

from harnesses.base import Budget
from harnesses.llm import ModelTable
from harnesses.scripted import ScriptedEndpoint, ScriptItem, bash_call, reply
from harnesses.session import AgentSessionFactory
from harnesses.trainer import OpenAIGenerator, build_sample, run_rollouts
from placement.specs import JudgeSpec
from placement.verifier import JudgeVerifier

RUNTIMES: dict[str, dict[str, Any]] = {
    "docker": {"type": "docker", "image": "vf-sandbox/python:latest", "network": "bridge"},
    "subprocess": {"type": "subprocess"},
}
TASKS = [
    (f"r{i}", {"prompt": f"Write the word w{i}x to out.txt.", "word": f"w{i}x"}) for i in range(8)
]
CHECK = (
    'w=$(sed -n \'s/.*"word": "\\(.*\\)".*/\\1/p\' "$VF_AGENT_INPUTS/task.json"); '
    'if [ "$(cat out.txt 2>/dev/null)" = "$w" ]; then s=1; else s=0; fi; '
    'printf \'{"score": %s}\' "$s" > "$VF_AGENT_VERDICT"'
)


def policy(body: dict[str, Any]) -> ScriptItem:
    """The "vLLM" policy: write the task's word (rollout r3's wrongly), then say done."""
    messages = body["messages"]
    if messages[-1]["role"] == "tool":
        return reply("done")
    match = re.search(r"the word (\w+)", str(messages[1]["content"]))
    word = match.group(1) if match else "?"
    return bash_call(f"printf {'oops' if word == 'w3x' else word} > out.txt")


def grader(body: dict[str, Any]) -> ScriptItem:
    """The judge's model: run the check that writes verdict.json, then stop."""
    return reply("verdict written") if body["messages"][-1]["role"] == "tool" else bash_call(CHECK)


JUDGE = JudgeSpec(
    name="word-check",
    harness={"id": "bash"},
    budget=Budget(max_turns=4, max_seconds=120),
    prompt="Check that out.txt holds the word of the task.",
    verdict_schema={"score": {"type": "number", "minimum": 0, "maximum": 1}},
)


async def main(runtime: dict[str, Any]) -> None:
    with ScriptedEndpoint(respond=policy) as vllm, ScriptedEndpoint(respond=grader) as grading:
        verify = JudgeVerifier([JUDGE], models=ModelTable(models={"grader": grading.endpoint()}))
        async with (
            AgentSessionFactory(runtime, {"id": "bash"}, verify=verify) as factory,
            OpenAIGenerator(vllm.endpoint()) as generate,
        ):
            results = await run_rollouts(factory, TASKS, generate, concurrency=4)
    failed = [(r.rollout_id, r.error) for r in results if not r.ok]
    if failed:
        sys.exit(f"rollouts failed: {failed}")
    samples = [build_sample(r.record) for r in results if r.record is not None]
    for sample in samples:
        trained = sum(sample.loss_mask or [])
        print(
            f"{sample.rollout_id}: reward {sample.reward}, {len(sample.token_ids or [])} tokens, "
            f"{trained} trained on",
            file=sys.stderr,
        )
    print(f"8 rollouts, {len(samples)} samples", file=sys.stderr)
    print(json.dumps([s.model_dump(mode="json") for s in samples]))


if __name__ == "__main__":
    choice = sys.argv[1] if len(sys.argv) > 1 else "docker"
    if choice not in RUNTIMES:
        sys.exit(f"usage: {sys.argv[0]} [{'|'.join(RUNTIMES)}]")
    anyio.run(main, RUNTIMES[choice])
