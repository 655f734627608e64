"""Privilege separation: where the backend can, the policy runs as an account of its own.

On the separated targets (Docker and Modal by default, SSH with ``policy_user``) the policy's
commands run as an unprivileged account while the host's machinery (the channel agent, judge
inputs, harness installs) stays with the sandbox's default user. Played from the policy's
side: it owns its world (the workdir) and nothing else — it cannot signal, trace or open the
agent, cannot write where judges read their inputs, and cannot become root.
"""

from __future__ import annotations

import pytest

from harnesses.base import Trace
from harnesses.scripted import bash_call, reply
from placement.errors import JudgeInputsTampered, JudgingFailed
from placement.run import run_agent, run_judges
from placement.specs import AgentSpec, JudgeSpec
from runtimes import Runtime, SandboxInvalidArgumentError, open_runtime
from runtimes.docker import DockerConfig
from runtimes.modal import ModalConfig
from tests.placement.conftest import TASK, ModelsFactory
from tests.placement.conftest import scripted_models as scripted_models

from .conftest import Hostile

pytestmark = pytest.mark.anyio

SEPARATED = ["docker-user", "ssh-user", "modal-user"]
SCHEMA = {"passed": "boolean"}
WRITE_FALSE = 'printf \'{"passed": false}\' > "$VF_AGENT_VERDICT"'


async def agent_pid(rt: Runtime) -> int:
    pid = rt.channel_info.agent_pid  # type: ignore[attr-defined]
    assert pid, "the channel agent is not running"
    return int(pid)


@pytest.mark.attack(3, 4)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_the_policy_owns_its_world_and_nothing_of_the_machinery(hostile: Hostile) -> None:
    async with open_runtime(hostile.config) as rt:
        assert rt.policy_user == hostile.user
        # Its world: the workdir, with the files the host put there before it first ran.
        await rt.write("task/README", b"fix the bug")
        policy = (await rt.exec(["id", "-u"], user=rt.policy_user)).stdout.strip()
        machinery = (await rt.exec(["id", "-u"])).stdout.strip()
        assert policy != "0" and policy != machinery
        made = await rt.exec(
            ["sh", "-c", "echo fixed >> task/README && mkdir -p out && touch out/x"],
            user=rt.policy_user,
        )
        assert made.exit_code == 0, made
        # Not the agent: no signal, no /proc handles, no ptrace.
        pid = await agent_pid(rt)
        probe = (
            f"kill -0 {pid} 2>/dev/null && echo signal; "
            f"cat /proc/{pid}/environ >/dev/null 2>&1 && echo environ; "
            f"ls /proc/{pid}/fd >/dev/null 2>&1 && echo fd; "
            f"exec 3>/proc/{pid}/fd/0 2>/dev/null && echo stdin; true"
        )
        seen = await rt.exec(["sh", "-c", probe], user=rt.policy_user)
        assert seen.stdout == "", f"the policy reached the agent: {seen.stdout!r}"
        # Not root.
        sudo = await rt.exec(
            ["sh", "-c", "touch /etc/vf-owned 2>/dev/null && echo wrote; true"],
            user=rt.policy_user,
        )
        assert sudo.stdout == "" and not await rt.exists("/etc/vf-owned")


@pytest.mark.attack(2)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_the_policy_cannot_write_where_machinery_keeps_its_files(hostile: Hostile) -> None:
    async with open_runtime(hostile.config) as rt:
        await rt.exec(["sh", "-c", "mkdir -m 0700 -p /tmp/machinery && echo v > /tmp/machinery/f"])
        tried = await rt.exec(
            [
                "sh",
                "-c",
                "echo forged > /tmp/machinery/f || rm -rf /tmp/machinery; ls /tmp/machinery",
            ],
            user=rt.policy_user,
        )
        assert tried.exit_code != 0
        assert await rt.read("/tmp/machinery/f") == b"v\n"


@pytest.mark.attack(6)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_the_sweep_reaches_every_process_of_the_policy(hostile: Hostile) -> None:
    """A daemon of the policy's that scrubbed its environment and left the workdir."""
    roam = (
        "cd / && env -i PATH=/usr/bin:/bin setsid sh -c "
        "'while :; do sleep 0.05; done' >/dev/null 2>&1 </dev/null &"
    )
    async with open_runtime(hostile.config) as rt:
        await rt.exec(["sh", "-c", roam], user=rt.policy_user)
        # Live processes of the account (a zombie is dead already, waiting for its reaper).
        count = ["sh", "-c", f"ps -o stat= -u {rt.policy_user} | grep -vc '^Z' || true"]
        assert int((await rt.exec(count)).stdout.strip() or 0) >= 1, "control"
        await rt.stop_processes()
        assert int((await rt.exec(count)).stdout.strip() or 0) == 0


@pytest.mark.attack(0)
def test_policy_user_is_a_plain_account_never_root() -> None:
    for model in (DockerConfig, ModalConfig):
        assert model().policy_user == "vf-policy"
        for bad in ("root", "1000:1000", "a b", ""):
            with pytest.raises(SandboxInvalidArgumentError):
                open_runtime({"type": model.model_fields["type"].default, "policy_user": bad})


@pytest.mark.attack(2, 3, 4)
@pytest.mark.parametrize("hostile", ["docker-user", "modal-user"], indirect=True)
async def test_a_rollouts_policy_runs_as_the_policy_account_and_its_judge_as_its_own(
    hostile: Hostile, scripted_models: ModelsFactory
) -> None:
    """A policy placed through ``run_agent(role="policy")`` (as ``AgentSession`` does)
    runs its commands as ``policy_user`` without being told; the judge after it runs its
    verdict-writing command as the judges' account and its other commands as the policy's,
    never as root (docs/security.md, "Judges' own account")."""
    spy = "id -un > who; nohup sh -c 'while :; do sleep 1; done' >/dev/null 2>&1 &"
    verdict_who = f"id -un > /tmp/judge-who-verdict; {WRITE_FALSE}"
    models = scripted_models(
        {
            "actor": [bash_call(spy), reply("done")],
            "j": [bash_call("id -un > /tmp/judge-who"), bash_call(verdict_who), reply("ok")],
        }
    )
    async with open_runtime(hostile.config) as rt:
        policy = AgentSpec(name="actor", harness="bash", model="actor")
        ran = await run_agent(policy, "work", models=models, runtime=rt, role="policy")
        assert ran.ok, ran.error
        assert (await rt.read("who")).decode().strip() == rt.policy_user
        trace = Trace(harness="bash").finish("done")
        [judged] = await run_judges(
            [JudgeSpec(name="j", harness="bash", model="j", prompt="p", verdict_schema=SCHEMA)],
            task=TASK,
            trace=trace,
            models=models,
            runtime=rt,
        )
        assert judged.verdict == {"passed": False}
        assert (await rt.read("/tmp/judge-who")).decode().strip() == rt.policy_user
        assert (await rt.read("/tmp/judge-who-verdict")).decode().strip() == rt.judge_user
        assert rt.judge_user not in (None, "root", rt.policy_user)


@pytest.mark.attack(2)
@pytest.mark.parametrize("hostile", SEPARATED, indirect=True)
async def test_an_inputs_root_made_by_the_policy_is_refused(
    hostile: Hostile, scripted_models: ModelsFactory
) -> None:
    """/tmp is everyone's: the policy's account makes /tmp/vf-agent first, to own the place
    where judges' inputs and verdicts will live. The judge is refused, typed."""
    models = scripted_models({"j": [bash_call(WRITE_FALSE), reply("ok")]})
    async with open_runtime(hostile.config) as rt:
        made = await rt.exec(
            ["sh", "-c", "mkdir -m 0777 /tmp/vf-agent && stat -c %U /tmp/vf-agent"],
            user=rt.policy_user,
        )
        assert made.stdout.strip() == rt.policy_user, "control: the policy owns it"
        with pytest.raises(JudgingFailed) as failed:
            try:
                await run_judges(
                    [
                        JudgeSpec(
                            name="j", harness="bash", model="j", prompt="p", verdict_schema=SCHEMA
                        )
                    ],
                    task=TASK,
                    trace=Trace(harness="bash").finish("done"),
                    models=models,
                    runtime=rt,
                )
            finally:  # the SSH host outlives the sandbox
                await rt.remove("/tmp/vf-agent")
        [error] = failed.value.exceptions
        assert isinstance(error, JudgeInputsTampered) and "belongs to uid" in str(error)
