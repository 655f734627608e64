"""Fork placement: judges placed ``"fork"`` run in fresh sandboxes started from one snapshot of
the rollout's sandbox, taken after the policy ended and before any judge ran. They see the world
the policy left, nothing the policy left running, and not each other; the live sandbox is not
touched by them. On subprocess and Docker, against scripted models."""

from __future__ import annotations

from typing import Any

import pytest

from harnesses.base import Trace
from harnesses.scripted import ScriptItem, bash_call, reply
from placement import errors as PE
from placement.run import run_judges
from placement.specs import JudgeSpec
from runtimes import open_runtime
from runtimes.registry import load_runtime_class

from .conftest import TASK, ModelsFactory
from .test_judges import SCHEMA, WRITE_PASS, bash_judge

pytestmark = pytest.mark.anyio

MARKER = "vf-fork-leftover-5e1c"


def fork_check(me: str, other: str, docker: bool) -> list[ScriptItem]:
    """The bash a fork judge runs: the policy's world is there as the policy left it, its own
    write is private (the other fork's file never shows up, though both run at once), and on
    Docker nothing the policy left running is alive in the fork. Two commands: the check
    changes the world (``{me}.txt``, ``{me}.ok``), which a command that writes the verdict
    does not (it runs as the judges' account where there is one)."""
    no_leftover = (
        f"! ps -eo args | grep -v grep | grep -q {MARKER} && " if docker else ""
    )  # subprocess sandboxes share the host's process table: nothing to look for there
    check = (
        f'test "$(cat world.txt)" = policy && {no_leftover}'
        f"echo {me} > {me}.txt && sleep 2 && test ! -e {other}.txt && test -e {me}.txt && "
        f"touch {me}.ok"
    )
    return [bash_call(check), bash_call(f"test -e {me}.ok && " + WRITE_PASS)]


async def test_fork_judges_see_the_policys_world_and_nothing_else(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    docker = backend["type"] == "docker"
    models = scripted_models(
        {
            "f1": [*fork_check("f1", "f2", docker), reply("done")],
            "f2": [*fork_check("f2", "f1", docker), reply("done")],
            # the rollout judge changes the live world; the forks were taken before it ran
            # (in a command of its own: a command that writes the verdict runs as the
            # judges' account, which reads the world but does not change it)
            "r": [bash_call("echo judged > world.txt"), bash_call(WRITE_PASS), reply("done")],
        }
    )
    judges = [bash_judge("r"), bash_judge("f1", placement="fork"), bash_judge("f2", "fork")]
    backend_cls = load_runtime_class(backend["type"])
    async with open_runtime(backend) as rt:
        await rt.write("world.txt", b"policy\n")
        await rt.exec(["sh", "-c", f"nohup sh -c 'sleep 600; : {MARKER}' >/dev/null 2>&1 &"])
        before = {s.id for s in await backend_cls.list_snapshots()}
        runs = await run_judges(judges, task=TASK, trace=policy_trace, models=models, runtime=rt)
        by = {r.name: r for r in runs}
        assert all(r.ok for r in runs), [(r.name, r.error) for r in runs]
        assert by["f1"].placement == by["f2"].placement == "fork"
        assert await rt.read("world.txt") == b"judged\n"  # the rollout judge's change stands
        assert not await rt.exists("f1.txt") and not await rt.exists("f2.txt")
        after = {s.id for s in await backend_cls.list_snapshots()}
        assert after <= before, "the judges' snapshot outlived the judging"


async def test_fork_placement_needs_a_rollout_runtime(
    scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    models = scripted_models({"f": [reply("unused")]})
    with pytest.raises(PE.PlacementConfigError, match="fork"):
        await run_judges(
            [bash_judge("f", placement="fork")], task=TASK, trace=policy_trace, models=models
        )


def test_fork_is_a_placement_of_its_own() -> None:
    spec = JudgeSpec(
        name="j", harness="bash", model="j", prompt="p", verdict_schema=SCHEMA, placement="fork"
    )
    assert spec.is_fork() and spec.runtime_config() is None
    with pytest.raises(ValueError):
        JudgeSpec(
            name="j", harness="bash", model="j", prompt="p", verdict_schema=SCHEMA, placement="x"
        )
