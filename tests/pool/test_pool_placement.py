"""Pools in placement and gated sessions: a clean-room judge, a recorded rollout's world and a
gated session whose config a pool serves take their sandbox from it (and close it); a config
no pool serves still gets a sandbox of its own. Subprocess backend, scripted models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harnesses.base import Trace
from harnesses.llm import ModelTable
from harnesses.scripted import ScriptedEndpoint, ScriptItem, bash_call, reply
from harnesses.session import AgentSessionFactory
from placement.rollout import Rollout, judge_rollout
from placement.run import run_judges
from placement.specs import JudgeSpec
from placement.verifier import JudgeVerifier
from runtimes import open_runtime
from runtimes.base import Runtime
from runtimes.pool import POOL, RuntimePool
from runtimes.subprocess import SubprocessRuntime

from .conftest import Starts

pytestmark = pytest.mark.anyio

POOLED = {"type": "subprocess", "labels": {"room": "clean"}}
TASK = {"id": "t-1", "prompt": "Write hello.txt containing 'hello'."}
WHERE = 'printf \'{"passed": true, "score": 1, "dir": "%s"}\' "$PWD" > "$VF_AGENT_VERDICT"'
SCHEMA = {"passed": "boolean", "score": "number", "dir": "string"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Starts:
    return Starts(monkeypatch, SubprocessRuntime)


def judging(body: dict[str, Any]) -> ScriptItem:
    """A judge's model: write the verdict (naming the judge's cwd), then stop."""
    return reply("done") if body["messages"][-1]["role"] == "tool" else bash_call(WHERE)


@pytest.fixture
def models() -> Iterator[ModelTable]:
    with ScriptedEndpoint(respond=judging) as server:
        yield ModelTable(models={"grader": server.endpoint()})
        assert server.failures == []


def judge(name: str, placement: Any) -> JudgeSpec:
    return JudgeSpec(
        name=name,
        harness={"id": "bash", "per_call_timeout": 30},
        placement=placement,
        prompt="Judge the work.",
        verdict_schema=SCHEMA,
    )


def made_at(starts: Starts, workdir: str) -> Runtime:
    return starts.by_workdir[workdir]


async def test_a_clean_room_judge_acquires_its_sandbox_from_the_pool_serving_its_config(
    starts: Starts, models: ModelTable
) -> None:
    trace = Trace(harness="bash", model="policy").finish("wrote hello.txt")
    async with RuntimePool(POOLED, size=1) as pool, open_runtime("subprocess") as rollout:
        await pool.wait_ready()
        runs = await run_judges(
            [judge("pooled", dict(POOLED)), judge("own", {"type": "subprocess"})],
            task=TASK,
            trace=trace,
            models=models,
            runtime=rollout,
            pools=[pool],
        )
        assert all(run.ok for run in runs), [run.error for run in runs]
        assert pool.handed_out == 1, "only the judge whose config the pool serves"
        by = {run.name: run for run in runs}
        assert by["pooled"].verdict is not None and by["own"].verdict is not None
        pooled = made_at(starts, by["pooled"].verdict["dir"])
        own = made_at(starts, by["own"].verdict["dir"])
        assert pooled.config.labels[POOL] == pool.id and pooled.closed
        assert POOL not in own.config.labels and own.closed
        await pool.wait_ready()  # refilled meanwhile, for the next rollout's judges


async def test_judge_rollout_takes_the_world_and_the_clean_room_judges_from_pools(
    starts: Starts, models: ModelTable, tmp_path: Path
) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "hello.txt").write_text("hello\n")
    rollout = Rollout(TASK, Trace(harness="bash", model="policy").finish("done"), files)
    world = {"type": "subprocess"}
    async with RuntimePool(world, size=1) as worlds, RuntimePool(POOLED, size=1) as rooms:
        runs = await judge_rollout(
            rollout,
            [judge("in-world", "rollout"), judge("clean", dict(POOLED))],
            models,
            world,
            pools=[worlds, rooms],
        )
        assert all(run.ok for run in runs), [run.error for run in runs]
        assert (worlds.handed_out, rooms.handed_out) == (1, 1)
        assert runs[0].verdict is not None
        in_world = made_at(starts, runs[0].verdict["dir"])
        assert in_world.config.labels[POOL] == worlds.id and in_world.closed


async def test_a_gated_session_and_its_verifier_judges_take_sandboxes_from_pools(
    starts: Starts, models: ModelTable
) -> None:
    config = {"type": "subprocess"}
    sessions, rooms = RuntimePool(config, size=1), RuntimePool(POOLED, size=1)
    verify = JudgeVerifier([judge("clean", dict(POOLED))], models=models, pools=[rooms])
    async with sessions, rooms:
        async with AgentSessionFactory(
            config, {"id": "bash"}, verify=verify, pools=[sessions, rooms]
        ) as factory:
            session = await factory.create(task="Say done.", rollout_id="pooled-1")
            runtime = session.runtime
            assert runtime.config.labels[POOL] == sessions.id
            while (request := await session.next_request(timeout=60)) is not None:
                await session.deliver(request, "done")
            result = await session.verify()
            await session.close()
        assert result.reward == 1.0
        assert runtime.closed, "the session closes the sandbox it took"
        assert (sessions.handed_out, rooms.handed_out) == (1, 1)
