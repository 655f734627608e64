"""A policy must not observe or tamper with judge machinery.

The policy's leftovers are stopped before a judge is placed in its sandbox; inputs live
in a fresh, unguessable directory outside the workdir; planted files, directories and
symlinks are refused; ids that could escape /tmp/vf-agent are rejected.
"""

from __future__ import annotations

import secrets
from typing import Any

import anyio
import pytest

from harnesses.base import Trace
from harnesses.scripted import bash_call, reply
from placement import errors as PE
from placement.inputs import INPUTS_ROOT, JudgeInputs, materialise, validate_agent_id
from placement.run import run_judges
from placement.specs import JudgeSpec
from runtimes import open_runtime

from .conftest import TASK, ModelsFactory

pytestmark = pytest.mark.anyio

SCHEMA = {"passed": "boolean"}


# A policy that leaves a spy behind: it tries, over and over, to read the inputs of every
# judge of its test and to plant a passing verdict for each. (Only its test's: on the
# subprocess backend /tmp is the host's, where other tests' judges run side by side.)
def spy(names: str) -> tuple[str, str]:
    """The spy's ``sh -c`` script for judges named ``names...``, and the ``sleep`` it runs
    (its mark in ``ps``)."""
    nap = f"sleep 0.02{secrets.randbelow(10**6):06d}"
    script = (
        "nohup sh -c 'while :; do "
        f'for d in {INPUTS_ROOT}/{names}*/; do cat "$d"task.json >> stolen.txt 2>/dev/null; '
        'printf "{\\"passed\\": true}" > "$d"verdict.json 2>/dev/null; done; '
        f"{nap}; done' >/dev/null 2>&1 </dev/null &"
    )
    return script, nap


def prefix() -> str:
    return f"tp{secrets.token_hex(4)}"


def judge(name: str, **kw: Any) -> JudgeSpec:
    return JudgeSpec(name=name, harness="bash", model=name, prompt="p", verdict_schema=SCHEMA, **kw)


async def test_policy_leftovers_cannot_read_inputs_or_plant_a_verdict(
    backend: dict[str, Any], scripted_models: ModelsFactory
) -> None:
    trace = Trace(harness="bash").finish("done")
    task = {**TASK, "id": f"secret-{secrets.token_hex(8)}"}
    # The judge looks around for a while, then writes a FAILING verdict; the spy, if it
    # were alive, would read task.json and overwrite the verdict with a passing one.
    look = 'sleep 1; printf \'{"passed": false}\' > "$VF_AGENT_VERDICT"; sleep 1'
    name = f"{prefix()}j"
    script, nap = spy(name)
    models = scripted_models({name: [bash_call(look), reply("done")]})
    async with open_runtime(backend) as rt:
        await rt.exec(["sh", "-c", script])
        await rt.exec(["sleep", "0.2"])
        assert nap in (await rt.exec(["ps", "-eo", "args"])).stdout
        [run] = await run_judges([judge(name)], task=task, trace=trace, models=models, runtime=rt)
        listing = (await rt.exec(["ps", "-eo", "pid,stat,args"])).stdout
        assert run.verdict == {"passed": False}, f"the spy planted its verdict: {run!r}\n{listing}"
        stolen = await rt.read("stolen.txt") if await rt.exists("stolen.txt") else b""
        assert task["id"].encode() not in stolen, "the spy read the judge's inputs"
        assert nap not in listing, listing


async def test_a_verdict_without_the_spy_would_have_been_planted(
    backend: dict[str, Any], scripted_models: ModelsFactory
) -> None:
    """Control: the spy really plants verdicts when nobody stops it (the test above is live)."""
    trace = Trace(harness="bash").finish("done")
    models = scripted_models({"j": [bash_call("sleep 1.5"), reply("done")]})
    ours = prefix()
    script, _ = spy(ours)
    async with open_runtime(backend) as rt:
        await rt.exec(["sh", "-c", script])
        directory = f"{INPUTS_ROOT}/{ours}ctrl-{secrets.token_hex(8)}"
        await rt.write(f"{directory}/task.json", JudgeInputs.take(TASK, trace).task_json)
        # the spy rewrites the file every 20 ms (truncate, then write): a read can land
        # between the two, so look a few times
        planted = b""
        with anyio.move_on_after(10):
            while planted != b'{"passed": true}':
                await anyio.sleep(0.1)
                if await rt.exists(f"{directory}/verdict.json"):
                    planted = await rt.read(f"{directory}/verdict.json")
        assert planted == b'{"passed": true}'
        assert TASK["id"].encode() in await rt.read("stolen.txt")
        await rt.stop_processes()
        await rt.remove(directory)
    del models


@pytest.mark.parametrize(
    "bad", ["../etc", "a/b", "..", "x", "UPPER-case-id", "dots..x", "trailing-", "a--b-c", ""]
)
def test_agent_ids_that_could_escape_are_rejected(bad: str) -> None:
    with pytest.raises(PE.PlacementConfigError):
        validate_agent_id(bad)


async def test_planted_id_directory_is_refused(backend: dict[str, Any]) -> None:
    trace = Trace(harness="bash").finish("done")
    agent_id = f"planted-{secrets.token_hex(8)}"
    async with open_runtime(backend) as rt:
        await rt.exec(["mkdir", "-p", f"{INPUTS_ROOT}/{agent_id}"])
        await rt.write(f"{INPUTS_ROOT}/{agent_id}/verdict.json", b'{"passed": true}')
        try:
            with pytest.raises(PE.InputTamperError, match="already exists"):
                await materialise(rt, agent_id, JudgeInputs.take(TASK, trace))
        finally:
            await rt.remove(f"{INPUTS_ROOT}/{agent_id}")


@pytest.mark.docker
async def test_symlinked_inputs_root_is_refused_and_fails_the_judge(
    scripted_models: ModelsFactory,
) -> None:
    """A policy that replaces /tmp/vf-agent with a symlink into its workdir (inside a
    container, where /tmp is the sandbox's own) gets the judge refused, typed."""
    trace = Trace(harness="bash").finish("done")
    models = scripted_models({"j": []})
    async with open_runtime({"type": "docker", "image": "vf-sandbox/base:bookworm"}) as rt:
        await rt.exec(
            ["sh", "-c", f'rm -rf {INPUTS_ROOT}; mkdir -p loot; ln -s "$PWD/loot" {INPUTS_ROOT}']
        )
        with pytest.raises(PE.JudgingFailed) as info:
            await run_judges([judge("j")], task=TASK, trace=trace, models=models, runtime=rt)
        [error] = info.value.exceptions
        assert type(error) is PE.JudgeInputsTampered and "symlink" in str(error)
        assert (await rt.exec(["ls", "-A", "loot"])).stdout == ""
