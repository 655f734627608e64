"""Rollouts on ray sandboxes on a remote node: the harness-rollout contract (a gated rollout:
the trainer answers each model request) with a judge placed in the rollout's live sandbox, or
in a clean room on another node, whose model is reached from that node through the driver's
relay (runtimes/ray/routes.py).
The same fixture and rollout body as tests/sessions/test_contract.py; only the config differs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from harnesses.base import Budget
from harnesses.llm import ModelTable
from harnesses.scripted import ScriptedEndpoint
from harnesses.session import AgentSessionFactory
from placement.specs import JudgeSpec
from placement.verifier import JudgeVerifier
from runtimes.ray import RayRuntime
from tests.ray.cluster import LocalCluster
from tests.sessions.conftest import no_leaks
from tests.sessions.test_contract import ANSWER, grader, rollout

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.slow]

PYTHON_IMAGE = "vf-sandbox/python:latest"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=["rollout", "clean-room"])
async def remote_factory(
    ray_cluster: LocalCluster, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[Any, str]]:
    """A factory whose rollouts run on a Docker sandbox on node 3, judged in that live sandbox
    or in a clean room: a subprocess ray sandbox on node 1."""
    node = ray_cluster.nodes[2]
    placement: Any = "rollout"
    if request.param == "clean-room":
        clean = ray_cluster.nodes[0].address
        placement = {"type": "ray", "runtime": {"type": "subprocess"}, "node": clean}
    backend = {
        "type": "ray",
        "runtime": {"type": "docker", "image": PYTHON_IMAGE},
        "node": node.address,
    }
    judge = JudgeSpec(
        name="answer-check",
        harness={"id": "bash"},
        budget=Budget(max_turns=4, max_seconds=120),
        prompt=f"Score 1 if the policy answered {ANSWER}, else 0.",
        verdict_schema={"score": "number"},
        placement=placement,
    )
    with ScriptedEndpoint(respond=grader) as grading:
        verify = JudgeVerifier([judge], models=ModelTable(models={"grader": grading.endpoint()}))
        async with AgentSessionFactory(backend, {"id": "bash"}, verify=verify) as made:
            yield made, node.address
        assert grading.failures == []
        assert grading.requests, "the judge in the remote sandbox never reached its model"


async def test_a_gated_rollout_and_its_judge_on_a_remote_node(
    remote_factory: tuple[Any, str],
) -> None:
    factory, address = remote_factory
    task = "What is the answer? Reply with it."
    session = await factory.create(task=task, rollout_id="ray-probe")
    try:
        assert isinstance(session.runtime, RayRuntime)
        assert session.runtime.node_address == address
    finally:
        await session.close()
    async with no_leaks():
        reward, seen = await rollout(factory, task, "ray-right", ANSWER)
    assert reward == 1.0
    assert len(seen) == 1 and seen[0]["messages"][-1] == {"role": "user", "content": task}
    wrong, _ = await rollout(factory, task, "ray-wrong", "no idea")
    assert wrong == 0.0  # the judge on the remote node really read what was delivered
