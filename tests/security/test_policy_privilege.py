"""Attack class 19: the policy acts with more privilege than meant.

Where the backend separates users (Docker and Modal by default, SSH with ``policy_user``), every
path through which a policy acts runs as the policy account unless the caller asks for more: the
inspect provider (the ``exec`` inspect's ``bash()``/``python()`` tools call, its ``read_file``
and ``write_file``), the gated session and the trainer's rollouts, a harness placed as the
policy, the persistent shell session a policy's harness opens. Played from the policy's side:
each path reports the policy's uid, and its attempt to write a root-owned system path (directly,
or by a symlink the host's write or read would follow) fails. Plain ``Runtime.exec`` is the
caller's own set-up API and stays the sandbox's default user, as docs/security.md says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from inspect_ai.util import ExecResult

from harnesses.base import Budget, Harness, Trace, for_policy
from harnesses.errors import HarnessConfigError
from harnesses.llm import Message, ModelEndpoint
from harnesses.registry import open_harness
from harnesses.scripted import bash_call, reply
from harnesses.session import AgentSessionFactory, Completion, VerifyContext, call
from harnesses.trainer import run_rollouts
from placement.run import run_agent
from placement.specs import AgentSpec
from runtimes import Runtime, open_runtime
from runtimes.inspect_sandbox import VfSandboxEnvironment, load_config
from tests.placement.conftest import ModelsFactory
from tests.placement.conftest import scripted_models as scripted_models

from .conftest import Hostile

pytestmark = pytest.mark.anyio

SEPARATED = ["docker-user", "ssh-user", "modal-user"]


def planting(marker: str) -> str:
    """The policy's program: report who it is, then try to plant a file in /etc."""
    return f"id -u; echo pwned > /etc/{marker} 2>/dev/null && echo PLANTED; true"


async def policy_uid(rt: Runtime) -> str:
    return (await rt.exec(["id", "-u"], user=rt.policy_user)).stdout.strip()


async def assert_not_planted(rt: Runtime, marker: str) -> None:
    assert not await rt.exists(f"/etc/{marker}"), f"the policy wrote /etc/{marker}"


# ---------------------------------------------------------------------- the inspect provider


async def inspect_bash(env: VfSandboxEnvironment, command: str) -> ExecResult[str]:
    """What inspect's ``bash()`` tool runs (``inspect_ai/tool/_tools/_execute.py``): no user."""
    return await env.exec(["bash", "--login", "-c", command], timeout=60)


@pytest.mark.attack(19)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_the_inspect_providers_tools_act_as_the_policy(hostile: Hostile) -> None:
    config = load_config(hostile.config)
    envs = await VfSandboxEnvironment.sample_init("privilege", config, {})
    env = envs["default"].as_type(VfSandboxEnvironment)
    rt = env.runtime
    try:
        uid = await policy_uid(rt)
        assert uid != "0"
        ran = await inspect_bash(env, planting("vf-inspect"))
        assert ran.stdout.split() == [uid], ran
        await assert_not_planted(rt, "vf-inspect")
        # inspect's python() tool and its read_file tool go through the same exec
        python = await env.exec(["python3", "-c", "import os; print(os.getuid())"])
        assert python.stdout.strip() == uid, python
        # set-up asks for more, explicitly
        assert (await env.exec(["id", "-u"], user="root")).stdout.strip() == "0"
    finally:
        await VfSandboxEnvironment.sample_cleanup("privilege", config, envs, False)


@pytest.mark.attack(19)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_inspect_file_operations_follow_no_planted_link_with_root(hostile: Hostile) -> None:
    """The scorer's ``read_file("answer.txt")`` must not read the root-only reference answer
    the policy linked there, and a solver's ``write_file("out.sh")`` must not replace the
    system binary the policy linked there: both act with the policy's access only."""
    config = load_config(hostile.config)
    envs = await VfSandboxEnvironment.sample_init("privilege", config, {})
    env = envs["default"].as_type(VfSandboxEnvironment)
    rt = env.runtime
    try:
        secret = "umask 077; mkdir -p /opt/grader && echo the-reference > /opt/grader/answer"
        assert (await rt.exec(["sh", "-c", secret])).exit_code == 0  # the task's root set-up
        await policy_uid(rt)  # the policy has acted: the workdir is its own from now on
        await env.write_file("notes.txt", "mine")
        owner = await inspect_bash(env, "stat -c %u notes.txt; id -u")
        theirs, mine = owner.stdout.split()
        assert theirs == mine != "0", "write_file's file is not the policy's"
        links = "ln -s /opt/grader/answer answer.txt && ln -s /usr/bin/vf-tool out.sh"
        assert (await inspect_bash(env, links)).success
        with pytest.raises(PermissionError):
            await env.read_file("answer.txt")
        with pytest.raises(PermissionError):
            await env.write_file("out.sh", "#!/bin/sh\necho forged\n")
        assert not await rt.exists("/usr/bin/vf-tool")
        with pytest.raises(PermissionError):
            await env.write_file("/etc/vf-inspect-write", "pwned")
        await assert_not_planted(rt, "vf-inspect-write")
        assert await env.read_file("notes.txt") == "mine"
    finally:
        await VfSandboxEnvironment.sample_cleanup("privilege", config, envs, False)


# ---------------------------------------------------------------------- sessions and the trainer


@pytest.mark.attack(19)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_the_trainers_rollouts_run_the_policys_tools_as_the_policy(hostile: Hostile) -> None:
    """``run_rollouts`` over an ``AgentSessionFactory``: the bash tool's commands run as the
    policy account; the caller's ``verify`` (its own code) sees nothing planted."""
    seen: dict[str, Any] = {}

    async def generate(
        rollout_id: str, turn: int, messages: list[Any], tools: Any, sampling: dict[str, Any]
    ) -> Completion | str:
        if turn == 0:
            return Completion(tool_calls=[call("bash", {"command": planting("vf-session")})])
        seen["tool"] = str(messages[-1]["content"])
        return "done"

    async def verify(ctx: VerifyContext) -> float:
        seen["uid"] = await policy_uid(ctx.runtime)
        seen["planted"] = await ctx.runtime.exists("/etc/vf-session")
        return 1.0

    async with AgentSessionFactory(hostile.config, {"id": "bash"}, verify=verify) as factory:
        (result,) = await run_rollouts(factory, [("r", "plant a file")], generate)
    assert result.ok, result.error
    assert seen["uid"] != "0"
    assert f"stdout:\n{seen['uid']}\n" in seen["tool"], seen["tool"]
    assert "PLANTED" not in seen["tool"] and seen["planted"] is False


# ---------------------------------------------------------------------- harnesses and shells


class NoUserSetting(Harness):
    """A plugin harness that runs commands but has no ``user`` setting to run them as."""

    id = "no-user-setting"

    async def run(
        self,
        task: str | Sequence[Message],
        *,
        runtime: Runtime | None,
        model: ModelEndpoint,
        budget: Budget | None = None,
    ) -> Trace:
        raise AssertionError("never run: for_policy refuses it")


@pytest.mark.attack(19)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_a_policys_persistent_shell_session_is_the_policys(
    hostile: Hostile, scripted_models: ModelsFactory
) -> None:
    """``run_agent(role="policy")`` with the bash harness's persistent shell: the shell
    session opened for the policy runs as the policy account."""
    models = scripted_models(
        {"actor": [bash_call(f"{{ {planting('vf-shell')}; }} > who"), reply("ok")]}
    )
    harness = {"id": "bash", "persistent_shell": True}
    async with open_runtime(hostile.config) as rt:
        spec = AgentSpec(name="actor", harness=harness, model="actor")
        ran = await run_agent(spec, "work", models=models, runtime=rt, role="policy")
        assert ran.ok, ran.error
        assert (await rt.read("who")).decode().split() == [await policy_uid(rt)]
        await assert_not_planted(rt, "vf-shell")


@pytest.mark.attack(19)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_every_harness_placed_as_the_policy_runs_as_the_policy(hostile: Hostile) -> None:
    """``for_policy`` gives every built-in harness that runs commands the policy account,
    and refuses one that cannot be told (it would run the policy's commands as root)."""
    async with open_runtime(hostile.config) as rt:
        for spec in ({"id": "bash"}, {"id": "mini-swe-agent"}):
            placed = for_policy(open_harness(spec), rt)
            assert getattr(placed.config, "user", None) == rt.policy_user, spec
        asked = for_policy(open_harness({"id": "bash", "user": "root"}), rt)
        assert getattr(asked.config, "user", None) == "root"  # the caller asked for more

        with pytest.raises(HarnessConfigError, match="policy account"):
            for_policy(NoUserSetting(), rt)
        assert for_policy(open_harness("null"), rt).config.id == "null"  # runs no command


# ---------------------------------------------------------------------- plain exec, as documented


@pytest.mark.attack(19)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_plain_exec_is_the_callers_set_up_and_policy_user_is_the_policy(
    hostile: Hostile,
) -> None:
    """docs/security.md: ``rt.exec`` without ``user=`` is the sandbox's default user (the
    caller's own set-up: root here); the policy's commands pass ``user=rt.policy_user``, and
    a shell session opened with it is the policy's too."""
    async with open_runtime(hostile.config) as rt:
        assert rt.policy_user == hostile.user
        assert (await rt.exec(["id", "-u"])).stdout.strip() == "0"
        uid = await policy_uid(rt)
        assert uid != "0"
        planted = await rt.exec(["sh", "-c", planting("vf-exec")], user=rt.policy_user)
        assert planted.stdout.split() == [uid]
        async with rt.shell(user=rt.policy_user) as sh:
            assert (await sh.run(planting("vf-exec"), timeout=60)).stdout.split() == [uid]
        await assert_not_planted(rt, "vf-exec")
