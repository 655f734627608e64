"""Bad verdicts and hostile rollouts: every one fails its judge with a typed JudgeError,
fast, and never a crash, a hang or a silent pass.

Verdicts from a reply (``null`` harness) and from ``verdict.json`` (``bash`` harness):
malformed, oversized, fenced, wrong schema, nested past the parser, not a regular file.
Rollouts whose policy planted things under ``/tmp/vf-agent`` or left a racer behind that
detached itself every way it could.
"""

from __future__ import annotations

import secrets
from typing import Any

import anyio
import pytest

from harnesses.base import Trace
from harnesses.scripted import bash_call, reply
from placement import errors as PE
from placement.inputs import INPUTS_ROOT
from placement.run import run_judges
from placement.specs import JudgeSpec
from runtimes import open_runtime
from tests.placement.conftest import TASK, ModelsFactory, scripted_models  # noqa: F401

from .conftest import TALLY

pytestmark = pytest.mark.anyio

SCHEMA = {"passed": "boolean"}
BOUND = 60.0
NESTED = "[" * 100_000 + "]" * 100_000
"""Valid JSON that Python's parser cannot descend (RecursionError), well under 1 MiB."""


def null_judge(name: str) -> JudgeSpec:
    return JudgeSpec(name=name, harness="null", model=name, prompt="p", verdict_schema=SCHEMA)


def bash_judge(name: str, **kw: Any) -> JudgeSpec:
    return JudgeSpec(
        name=name,
        harness={"id": "bash", "per_call_timeout": 30},
        model=name,
        prompt="p",
        verdict_schema=SCHEMA,
        verdict_max_bytes=4096,
        **kw,
    )


async def _judge(
    judge: JudgeSpec, models: Any, runtime: Any = None, bound: float = BOUND
) -> PE.JudgeError:
    trace = Trace(harness="bash").finish("done")
    with anyio.fail_after(bound), pytest.raises(PE.JudgingFailed) as info:
        await run_judges([judge], task=TASK, trace=trace, models=models, runtime=runtime)
    [error] = info.value.exceptions
    assert info.value.runs[0].error_type == type(error).__name__
    assert info.value.runs[0].verdict is None, "a failed judge has no verdict"
    return error


@pytest.mark.parametrize(
    "content",
    [
        "not json at all",
        "",
        'Here is my verdict:\n```json\n{"passed": true}\n```',
        '```json\n{"passed": true}\n```\n```json\n{"passed": false}\n```',
        '```\n{"passed": true}\n```',
        '{"passed": "maybe"}',
        '{"passed": true, "extra": 1}',
        '{"verdict": {"passed": true}}',
        "[true]",
        NESTED,
        '{"passed":' + " " * (1 << 20) + "true}",  # valid, and over the 1 MiB cap
    ],
    ids=[
        "prose",
        "empty",
        "prose-and-fence",
        "two-fences",
        "untagged-fence",
        "wrong-type",
        "extra-field",
        "wrapped",
        "not-object",
        "nested",
        "oversized",
    ],
)
async def test_bad_reply_verdict(scripted_models: ModelsFactory, content: str) -> None:  # noqa: F811
    models = scripted_models({"n": [reply(content)]})
    error = await _judge(null_judge("n"), models)
    assert type(error) is PE.VerdictInvalid, repr(error)
    TALLY.add("bad input: verdicts")


async def test_fenced_reply_verdict_is_accepted(scripted_models: ModelsFactory) -> None:  # noqa: F811
    models = scripted_models({"n": [reply('\n```json\n{"passed": true}\n```\n')]})
    trace = Trace(harness="bash").finish("done")
    [run] = await run_judges([null_judge("n")], task=TASK, trace=trace, models=models)
    assert run.verdict == {"passed": True}


FILE_CASES = {
    "not-json": "printf 'nope' > \"$VF_AGENT_VERDICT\"",
    "invalid-utf8": "printf '\\377\\376{}' > \"$VF_AGENT_VERDICT\"",
    "wrong-schema": 'printf \'{"passed": 3}\' > "$VF_AGENT_VERDICT"',
    "oversized": "head -c 5000 /dev/zero | tr '\\0' ' ' > \"$VF_AGENT_VERDICT\"",
    "nested": "head -c 100000 /dev/zero | tr '\\0' '[' > \"$VF_AGENT_VERDICT\"",
    "directory": 'mkdir "$VF_AGENT_VERDICT"',
    "symlink-to-zero": 'ln -s /dev/zero "$VF_AGENT_VERDICT"',
    "symlink-outside": 'ln -s /etc/hostname "$VF_AGENT_VERDICT"',
    "dangling-symlink": 'ln -s /nowhere "$VF_AGENT_VERDICT"',
    "fifo": 'mkfifo "$VF_AGENT_VERDICT"',
}
EXPECTED = {"dangling-symlink": PE.VerdictMissing}


@pytest.mark.parametrize("case", list(FILE_CASES))
@pytest.mark.parametrize(
    "backend",
    [
        {"type": "subprocess"},
        pytest.param({"type": "docker"}, marks=pytest.mark.docker, id="docker"),
    ],
    ids=["subprocess", "docker"],
)
async def test_bad_verdict_file(
    backend: dict[str, Any],
    case: str,
    scripted_models: ModelsFactory,  # noqa: F811
    request: pytest.FixtureRequest,
) -> None:
    models = scripted_models({"j": [bash_call(FILE_CASES[case]), reply("done")]})
    async with open_runtime(backend) as rt:
        error = await _judge(bash_judge("j"), models, rt, bound=15 if case == "fifo" else BOUND)
        assert (await rt.exec(["echo", "usable"])).stdout == "usable\n"
    assert type(error) is EXPECTED.get(case, PE.VerdictInvalid), repr(error)
    TALLY.add("bad input: verdicts")


# ---------------------------------------------------------------------- a hostile policy

# A leftover that detaches itself every way a shell can (new session, double fork,
# scrubbed environment) and then races every judge: it plants passing verdicts as files
# and as symlinks, and copies whatever inputs it can read.
RACER = r"""
while :; do
  for d in /tmp/vf-agent/*/; do
    cat "${d}task.json" >> /work/stolen.txt 2>/dev/null
    printf '{"passed": true}' > /work/pass.json
    ln -sf /work/pass.json "${d}verdict.json" 2>/dev/null
  done
done
"""
DETACH = "setsid sh -c 'env -i /bin/sh /work/racer.sh </dev/null >/dev/null 2>&1 &' &"


@pytest.mark.docker
async def test_detached_racer_cannot_touch_the_judge(scripted_models: ModelsFactory) -> None:  # noqa: F811
    task = {**TASK, "id": f"secret-{secrets.token_hex(8)}"}
    look = 'sleep 1; printf \'{"passed": false}\' > "$VF_AGENT_VERDICT"; sleep 0.5'
    models = scripted_models({"j": [bash_call(look), reply("done")]})
    trace = Trace(harness="bash").finish("done")
    async with open_runtime({"type": "docker"}) as rt:
        await rt.write("/work/racer.sh", RACER)
        await rt.exec(["sh", "-c", DETACH])
        await anyio.sleep(0.3)
        racing = await rt.exec(["sh", "-c", "ps -eo args | grep -c '[r]acer.sh'"])
        assert int(racing.stdout) >= 1, "the racer should be running before the judge"
        with anyio.fail_after(BOUND):
            [run] = await run_judges(
                [bash_judge("j")], task=task, trace=trace, models=models, runtime=rt
            )
        assert run.verdict == {"passed": False}, "the racer planted its verdict"
        stolen = await rt.read("stolen.txt") if await rt.exists("stolen.txt") else b""
        assert task["id"].encode() not in stolen, "the racer read the judge's inputs"
    TALLY.add("bad input: hostile policies")


@pytest.mark.docker
@pytest.mark.parametrize(
    "plant",
    [
        f"rm -rf {INPUTS_ROOT}; printf x > {INPUTS_ROOT}",
        f"rm -rf {INPUTS_ROOT}; ln -s /nowhere {INPUTS_ROOT}",
        f"rm -rf {INPUTS_ROOT}; mkdir -p /work/loot; ln -s /work/loot {INPUTS_ROOT}",
        f"rm -rf {INPUTS_ROOT}; mkfifo {INPUTS_ROOT}",
    ],
    ids=["file", "dangling-symlink", "symlink-to-loot", "fifo"],
)
async def test_planted_inputs_root_is_refused(plant: str, scripted_models: ModelsFactory) -> None:  # noqa: F811
    models = scripted_models({"j": []})
    async with open_runtime({"type": "docker"}) as rt:
        await rt.exec(["sh", "-c", plant])
        error = await _judge(bash_judge("j"), models, rt)
        assert type(error) is PE.JudgeInputsTampered, repr(error)
        if await rt.exists("/work/loot"):
            assert (await rt.exec(["ls", "-A", "/work/loot"])).stdout == "", "inputs leaked"
    TALLY.add("bad input: hostile policies")
