"""An OpenEnv loop-owning session, end to end, with no GPU: the "trainer" is a scripted generator.

``HarnessSessionFactory`` (``placement/trainers/openenv_harness.py``) is OpenEnv's
``ResourceSessionFactory`` for harnesses that own their agent loop. Here the bash harness runs
in a Docker sandbox; every model call it makes is parked by the gated proxy and answered by
``generate`` below, with canned completions (a bash tool call that writes a file, then a final
answer) carrying made-up token ids and logprobs that chain the way a real sampler's do. The
session is what OpenEnv's trainers consume: ``wait_for_completion()``, then
``fetch_training_trace()`` (an OpenEnv ``TrainingTrace``, validated by OpenEnv's own model), and
``verify()``, here a bash judge placed in the rollout's sandbox after the agent exited: its
(scripted) model runs a command that checks the file and writes ``verdict.json``; the verdict's
score is the reward. The training trace and the verify result are printed as JSON on stdout.

    make images                                    # builds vf-sandbox/python:latest (once)
    .venv/bin/python examples/openenv_session.py   # Docker
    .venv/bin/python examples/openenv_session.py subprocess   # no Docker: a local sandbox

Needs the ``[openenv]`` extra (``make test`` installs it).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from openenv.core.harness import LoopOwningSession, TrainableSession
from pydantic import BaseModel, Field

from harnesses.base import Budget
from harnesses.llm import Message, ModelTable
from harnesses.scripted import ScriptedEndpoint, bash_call, reply
from harnesses.session import Completion, call
from placement.specs import JudgeSpec
from placement.trainers.openenv_harness import HarnessSessionFactory
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
PROMPT_IDS = [1, 2, 3]


async def generate(
    rollout_id: str, turn: int, messages: list[Message], tools: Any, sampling: dict[str, Any]
) -> Completion:
    """Stand-in for the trainer's policy: canned completions, with fake token ids that chain
    (turn 1's prompt is turn 0's prompt, its reply, then the tool output's tokens)."""
    if turn == 0:
        command = "printf hello > hello.txt && cat hello.txt"
        return Completion(
            tool_calls=[call("bash", {"command": command})],
            metadata={
                "prompt_token_ids": PROMPT_IDS,
                "token_ids": [101, 102, 103],
                "logprobs": [-0.11, -0.05, -0.30],
            },
        )
    return Completion(
        content="done: hello.txt holds 'hello'.",
        metadata={
            "prompt_token_ids": [*PROMPT_IDS, 101, 102, 103, 7, 8],
            "token_ids": [104, 105],
            "logprobs": [-0.02, -0.01],
        },
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


def main(runtime: dict[str, Any]) -> None:
    with ScriptedEndpoint([bash_call(CHECK), reply("verdict written")]) as grader:
        verify = JudgeVerifier([judge()], models=ModelTable(models={"grader": grader.endpoint()}))
        with HarnessSessionFactory(
            runtime, {"id": "bash"}, generate=generate, verify=verify
        ) as factory:
            session = factory.create(TASK, episode_id="example-0")
            assert isinstance(session, TrainableSession) and isinstance(session, LoopOwningSession)
            try:
                exit_code = session.wait_for_completion(timeout_s=120)
                trace = session.fetch_training_trace()
                result = session.verify()
            finally:
                session.close()
    print(
        f"exit code {exit_code}, reward {result.env_reward}, {len(trace.turns)} turns",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "training_trace": trace.model_dump(mode="json"),
                "env_reward": result.env_reward,
                "metrics": result.metrics,
            },
            indent=2,
            default=str,
        )
    )


if __name__ == "__main__":
    choice = sys.argv[1] if len(sys.argv) > 1 else "docker"
    if choice not in RUNTIMES:
        sys.exit(f"usage: {sys.argv[0]} [{'|'.join(RUNTIMES)}]")
    main(RUNTIMES[choice])
