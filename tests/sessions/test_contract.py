"""The harness-rollout contract, used by its own names only.

The contract online-RL trainers are written against: ``AgentSessionFactory.create(*, task,
rollout_id)``; ``AgentSession.next_request() -> dict | None`` with ``messages``, ``tools``
and ``request_id``; ``deliver(intercept, completion_text)``; ``verify()`` returning an
object with ``.env_reward``; ``close()``. The rollout bodies below touch nothing else:
only the fixture that builds the factory knows this project (a bash harness, a bash judge
whose scripted model checks the transcript for the answer the trainer delivered).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from harnesses.base import Budget
from harnesses.llm import ModelTable
from harnesses.scripted import ScriptedEndpoint, ScriptItem, bash_call, reply
from harnesses.session import AgentSessionFactory
from placement.specs import JudgeSpec
from placement.verifier import JudgeVerifier

from .conftest import no_leaks

pytestmark = pytest.mark.anyio

ANSWER = "ANSWER-42"
CHECK = (
    f'if grep -q {ANSWER} "$VF_AGENT_INPUTS/transcript.md"; then s=1; else s=0; fi; '
    'printf \'{"score": %s}\' "$s" > "$VF_AGENT_VERDICT"'
)


def grader(body: dict[str, Any]) -> ScriptItem:
    return reply("verdict written") if body["messages"][-1]["role"] == "tool" else bash_call(CHECK)


@pytest.fixture
async def factory(backend: dict[str, Any]) -> AsyncIterator[Any]:
    judge = JudgeSpec(
        name="answer-check",
        harness={"id": "bash"},
        budget=Budget(max_turns=4, max_seconds=120),
        prompt=f"Score 1 if the policy answered {ANSWER}, else 0.",
        verdict_schema={"score": "number"},
    )
    with ScriptedEndpoint(respond=grader) as grading:
        verify = JudgeVerifier([judge], models=ModelTable(models={"grader": grading.endpoint()}))
        async with AgentSessionFactory(backend, {"id": "bash"}, verify=verify) as made:
            yield made
        assert grading.failures == []


async def rollout(
    factory: Any, task: str, rollout_id: str, answer: str, *, as_plain_dict: bool = False
) -> tuple[float, list[dict[str, Any]]]:
    """A trainer's rollout loop, written against the contract alone."""
    session = await factory.create(task=task, rollout_id=rollout_id)
    seen: list[dict[str, Any]] = []
    try:
        while (intercept := await session.next_request()) is not None:
            assert "messages" in intercept and "tools" in intercept and "request_id" in intercept
            assert intercept["messages"] and isinstance(intercept["request_id"], str)
            seen.append(dict(intercept))
            await session.deliver(dict(intercept) if as_plain_dict else intercept, answer)
        result = await session.verify()
        return result.env_reward, seen
    finally:
        await session.close()


async def test_a_gated_rollout_through_the_contract(factory: Any) -> None:
    task = "What is the answer? Reply with it."
    async with no_leaks():  # close() left no sandbox, thread or task behind
        reward, seen = await rollout(factory, task, "contract-right", ANSWER)
    assert reward == 1.0
    assert len(seen) == 1  # a text answer ends the bash agent's loop
    (request,) = seen
    json.dumps(request)  # a dict of plain data, as the contract has it
    assert request["messages"][-1] == {"role": "user", "content": task}
    assert [t["function"]["name"] for t in request["tools"]] == ["bash"]

    wrong, seen_wrong = await rollout(
        factory, task, "contract-wrong", "no idea", as_plain_dict=True
    )
    assert wrong == 0.0  # the judge really read what was delivered
    assert seen_wrong[0]["request_id"] != request["request_id"]
