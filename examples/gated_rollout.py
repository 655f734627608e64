"""A gated rollout, end to end, with no GPU: the "trainer" is a tiny scripted generator.

The bash harness runs its agent loop against a Docker sandbox; every model call it makes
is parked by the gated proxy and handed to ``generate`` below, which answers with canned
completions (a bash tool call that writes a file, then a final answer) carrying made-up
token ids and logprobs, as a real trainer would. After the agent exits, a bash judge is
placed in the rollout's sandbox: its (scripted) model runs a command that checks the file
and writes ``verdict.json``; the verdict's score is the reward. The rollout record is
printed as JSON on stdout.

    make images                                  # builds vf-sandbox/python:latest (once)
    .venv/bin/python examples/gated_rollout.py   # Docker
    .venv/bin/python examples/gated_rollout.py subprocess   # no Docker: a local sandbox
"""

from __future__ import annotations

import sys
from typing import Any

import anyio
from pydantic import BaseModel, Field

from harnesses.base import Budget
from harnesses.llm import ModelTable
from harnesses.scripted import ScriptedEndpoint, bash_call, reply
from harnesses.session import (
    AgentSessionFactory,
    Completion,
    InterceptedRequest,
    RolloutRecord,
    call,
)
from placement.specs import JudgeSpec
from placement.verifier import JudgeVerifier

RUNTIMES: dict[str, dict[str, Any]] = {
    "docker": {"type": "docker", "image": "vf-sandbox/python:latest", "network": "bridge"},
    "subprocess": {"type": "subprocess"},
}

TASK = {"id": "hello-1", "prompt": "Create hello.txt containing the word hello, then say done."}

# The judge's model is scripted too: it runs this check in the sandbox and writes the verdict.
CHECK = (
    'if [ "$(cat hello.txt 2>/dev/null)" = hello ]; then s=1; else s=0; fi; '
    'printf \'{"score": %s}\' "$s" > "$VF_AGENT_VERDICT"'
)


def generate(request: InterceptedRequest) -> Completion:
    """Stand-in for the trainer's policy: canned completions, with fake token metadata."""
    if request.turn == 0:
        command = "printf hello > hello.txt && cat hello.txt"
        return Completion(
            tool_calls=[call("bash", {"command": command})],
            metadata={"token_ids": [101, 102, 103], "logprobs": [-0.11, -0.05, -0.30]},
        )
    return Completion(
        content="done: hello.txt holds 'hello'.",
        metadata={"token_ids": [104, 105], "logprobs": [-0.02, -0.01]},
    )


class Verdict(BaseModel):
    """What the judge must write to verdict.json."""

    score: float = Field(ge=0, le=1)


def judge() -> JudgeSpec:
    return JudgeSpec(
        name="file-check",
        harness={"id": "bash"},
        model="grader",
        budget=Budget(max_turns=4, max_seconds=120),
        prompt="Check that hello.txt holds exactly 'hello'. Score 1 if it does, else 0.",
        verdict_schema=Verdict,
    )


async def rollout(factory: AgentSessionFactory, rollout_id: str) -> RolloutRecord:
    """One rollout, the way a trainer drives it: answer every call, then score and record."""
    async with await factory.create(task=TASK, rollout_id=rollout_id) as session:
        while (request := await session.next_request(timeout=60)) is not None:
            print(f"turn {request.turn}: {len(request.messages)} messages", file=sys.stderr)
            await session.deliver(request, generate(request))
        await session.verify()
        return session.record()


async def main(runtime: dict[str, Any]) -> None:
    with ScriptedEndpoint([bash_call(CHECK), reply("verdict written")]) as grader:
        verify = JudgeVerifier([judge()], models=ModelTable(models={"grader": grader.endpoint()}))
        async with AgentSessionFactory(runtime, {"id": "bash"}, verify=verify) as factory:
            record = await rollout(factory, "example-0")
    print(f"reward {record.reward} ({record.status})", file=sys.stderr)
    print(record.model_dump_json(indent=2))


if __name__ == "__main__":
    choice = sys.argv[1] if len(sys.argv) > 1 else "docker"
    if choice not in RUNTIMES:
        sys.exit(f"usage: {sys.argv[0]} [{'|'.join(RUNTIMES)}]")
    anyio.run(main, RUNTIMES[choice])
