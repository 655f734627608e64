"""Placement of judges on real sandboxes (subprocess and Docker), against scripted models.

Every JudgeError subclass is produced by its real cause; rollout judges run one after
another and clean-room judges concurrently (measured); all judges read one snapshot.
"""

from __future__ import annotations

import hashlib
import shutil
from typing import Any

import anyio
import pytest

from harnesses.base import Budget, Trace
from harnesses.scripted import bash_call, http_error, reply
from placement import errors as PE
from placement.inputs import JudgeInputs
from placement.run import run_agent, run_judges
from placement.specs import JudgeSpec
from runtimes import open_runtime

from .conftest import TASK, ModelsFactory

pytestmark = pytest.mark.anyio

SCHEMA = {"passed": "boolean", "score": {"type": "number", "minimum": 0, "maximum": 1}}
WRITE_PASS = 'printf \'{"passed": true, "score": 1}\' > "$VF_AGENT_VERDICT"'


def bash_judge(name: str, placement: Any = "rollout", **kw: Any) -> JudgeSpec:
    return JudgeSpec(
        name=name,
        harness={"id": "bash", "per_call_timeout": 30},
        model=name,
        placement=placement,
        prompt="Judge the work.",
        verdict_schema=SCHEMA,
        **kw,
    )


def null_judge(name: str) -> JudgeSpec:
    return JudgeSpec(
        name=name, harness="null", model=name, prompt="Judge it.", verdict_schema=SCHEMA
    )


async def judge_one(backend: dict[str, Any], spec: JudgeSpec, models: Any, trace: Trace) -> Any:
    async with open_runtime(backend) as rt:
        await rt.write("hello.txt", b"hello\n")
        return await run_judges([spec], task=TASK, trace=trace, models=models, runtime=rt)


async def test_bash_judge_inspects_the_world_and_writes_its_verdict(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    check = "grep -q hello hello.txt && " + WRITE_PASS
    models = scripted_models({"j": [bash_call(check), reply("done")]})
    [run] = await judge_one(backend, bash_judge("j"), models, policy_trace)
    assert run.verdict == {"passed": True, "score": 1.0}
    assert run.role == "judge" and run.trainable is False and run.placement == "rollout"
    assert run.trace is not None and len(run.trace.turns) == 2
    assert run.trace.turns[0].tool_results[0].exit_code == 0


async def test_null_judge_verdict_comes_from_its_reply(
    scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    models = scripted_models({"n": [reply('```json\n{"passed": false, "score": 0.25}\n```')]})
    [run] = await run_judges([null_judge("n")], task=TASK, trace=policy_trace, models=models)
    assert run.verdict == {"passed": False, "score": 0.25}
    assert run.placement == "host (no sandbox)"


async def test_verdict_missing_comes_from_the_typed_missing_file_error(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    models = scripted_models({"j": [bash_call("true"), reply("I forgot the verdict")]})
    with pytest.raises(PE.JudgingFailed) as info:
        await judge_one(backend, bash_judge("j"), models, policy_trace)
    [error] = info.value.exceptions
    assert type(error) is PE.VerdictMissing
    assert type(error.__cause__).__name__ == "SandboxFileNotFoundError"
    assert error.trace is not None and error.trace.metadata["failure"]["type"] == "VerdictMissing"
    assert info.value.runs[0].error_type == "VerdictMissing"


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("this is not json", "not JSON"),
        ('{"passed": "maybe", "score": 3}', "schema"),
        ('{"passed": true, "score": 1, "extra": 1}', "schema"),
    ],
)
async def test_invalid_verdict_files(
    backend: dict[str, Any],
    scripted_models: ModelsFactory,
    policy_trace: Trace,
    content: str,
    why: str,
) -> None:
    write = f"printf '%s' '{content}' > \"$VF_AGENT_VERDICT\""
    models = scripted_models({"j": [bash_call(write), reply("done")]})
    with pytest.raises(PE.JudgingFailed) as info:
        await judge_one(backend, bash_judge("j"), models, policy_trace)
    [error] = info.value.exceptions
    assert type(error) is PE.VerdictInvalid and why in str(error)


async def test_oversized_verdict_is_invalid_not_read(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    write = 'head -c 5000 /dev/zero | tr "\\0" " " > "$VF_AGENT_VERDICT"'
    models = scripted_models({"j": [bash_call(write), reply("done")]})
    spec = bash_judge("j", verdict_max_bytes=4096)
    with pytest.raises(PE.JudgingFailed) as info:
        await judge_one(backend, spec, models, policy_trace)
    [error] = info.value.exceptions
    assert type(error) is PE.VerdictInvalid and "larger than 4096" in str(error)


async def test_prose_reply_from_null_judge_is_invalid(
    scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    models = scripted_models({"n": [reply('I think {"passed": true, "score": 1}')]})
    with pytest.raises(PE.JudgingFailed) as info:
        await run_judges([null_judge("n")], task=TASK, trace=policy_trace, models=models)
    assert type(info.value.exceptions[0]) is PE.VerdictInvalid


async def test_budget_exceeded(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    models = scripted_models({"j": [bash_call("true")] * 5})
    spec = bash_judge("j", budget=Budget(max_turns=2))
    with pytest.raises(PE.JudgingFailed) as info:
        await judge_one(backend, spec, models, policy_trace)
    [error] = info.value.exceptions
    assert type(error) is PE.JudgeBudgetExceeded
    assert error.trace is not None and error.trace.error is not None
    assert error.trace.error.kind == "budget_turns" and len(error.trace.turns) == 2


async def test_model_failure(
    scripted_models: ModelsFactory, policy_trace: Trace, backend: dict[str, Any]
) -> None:
    models = scripted_models({"j": [http_error(500, "upstream exploded")]})
    with pytest.raises(PE.JudgingFailed) as info:
        await judge_one(backend, bash_judge("j"), models, policy_trace)
    [error] = info.value.exceptions
    assert type(error) is PE.JudgeModelFailed
    assert "500" in str(error) and "upstream exploded" in str(error)


async def test_sandbox_lost_while_judging(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    models = scripted_models(
        {"j": [bash_call("sleep 0.5; echo looked", delay=0.0), reply("done", delay=1.5)]}
    )
    async with open_runtime(backend) as rt:

        async def lose_the_sandbox() -> None:
            await anyio.sleep(1.0)  # after the judge's command, before its verdict is read
            await rt.close()

        async with anyio.create_task_group() as tg:
            tg.start_soon(lose_the_sandbox)
            with pytest.raises(PE.JudgingFailed) as info:
                await run_judges(
                    [bash_judge("j")], task=TASK, trace=policy_trace, models=models, runtime=rt
                )
    [error] = info.value.exceptions
    if backend["type"] == "subprocess":  # its /tmp is the host's: the closed sandbox cannot
        shutil.rmtree(f"/tmp/vf-agent/{info.value.runs[0].agent_id}", ignore_errors=True)
    assert type(error) is PE.JudgeSandboxLost
    from runtimes import SandboxUnavailableError

    lost_on_read = isinstance(error.__cause__, SandboxUnavailableError)
    lost_in_run = (
        error.trace is not None
        and error.trace.error is not None
        and (error.trace.error.kind == "sandbox_error")
    )
    assert lost_on_read or lost_in_run, (error, error.__cause__)


async def test_rollout_judges_run_sequentially_and_clean_room_concurrently(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    slow = [bash_call("sleep 1; " + WRITE_PASS), reply("done")]
    names = ["r1", "r2", "c1", "c2", "c3"]
    models = scripted_models({name: list(slow) for name in names})
    judges = [bash_judge("r1"), bash_judge("r2")] + [
        bash_judge(n, placement=dict(backend)) for n in ("c1", "c2", "c3")
    ]
    async with open_runtime(backend) as rt:
        runs = await run_judges(judges, task=TASK, trace=policy_trace, models=models, runtime=rt)
    by = {r.name: r for r in runs}
    assert [r.name for r in runs] == names and all(r.ok for r in runs)
    # rollout judges: one after the other in the live sandbox
    assert by["r2"].started >= by["r1"].finished
    # clean-room judges: each in a fresh sandbox of its own, overlapping in time
    clean = [by[n] for n in ("c1", "c2", "c3")]
    overlap = min(r.finished for r in clean) - max(r.started for r in clean)
    assert overlap > 0.5, f"clean-room judges did not overlap ({overlap:.2f}s)"
    assert all(r.placement.startswith("clean-room:") for r in clean)


async def test_all_judges_see_the_same_snapshot(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    digest = (
        'cd "$VF_AGENT_INPUTS"'
        " && h=$(cat task.json transcript.md trace.json | sha256sum | cut -c1-16)"
        ' && printf \'{"passed": true, "score": 1, "digest": "%s"}\' "$h"'
        ' > "$VF_AGENT_VERDICT"'
    )
    schema = {**SCHEMA, "digest": "string"}
    specs = [
        JudgeSpec(name="a", harness="bash", model="a", prompt="p", verdict_schema=schema),
        JudgeSpec(
            name="b",
            harness="bash",
            model="b",
            prompt="p",
            verdict_schema=schema,
            placement=dict(backend),
        ),
    ]
    models = scripted_models(
        {"a": [bash_call(digest), reply("ok")], "b": [bash_call(digest), reply("ok")]}
    )
    async with open_runtime(backend) as rt:
        runs = await run_judges(specs, task=TASK, trace=policy_trace, models=models, runtime=rt)
    snap = JudgeInputs.take(TASK, policy_trace)
    expected = hashlib.sha256(snap.task_json + snap.transcript_md + snap.trace_json).hexdigest()
    assert {r.verdict["digest"] for r in runs if r.verdict} == {expected[:16]}


async def test_inputs_are_outside_the_workdir_and_removed_afterwards(
    backend: dict[str, Any], scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    where = (
        'printf \'{"passed": true, "score": 1, "dir": "%s"}\' "$VF_AGENT_INPUTS"'
        ' > "$VF_AGENT_VERDICT"'
    )
    schema = {**SCHEMA, "dir": "string"}
    spec = JudgeSpec(name="w", harness="bash", model="w", prompt="p", verdict_schema=schema)
    models = scripted_models({"w": [bash_call(where), reply("ok")]})
    async with open_runtime(backend) as rt:
        [run] = await run_judges([spec], task=TASK, trace=policy_trace, models=models, runtime=rt)
        inputs = run.verdict["dir"] if run.verdict else ""
        assert inputs.startswith("/tmp/vf-agent/w-") and not inputs.startswith(rt.workdir)
        assert not await rt.exists(inputs)


async def test_run_agent_needs_a_runtime_for_rollout_placement(
    scripted_models: ModelsFactory, policy_trace: Trace
) -> None:
    models = scripted_models({"j": []})
    with pytest.raises(PE.PlacementConfigError, match="no rollout runtime"):
        await run_agent(
            bash_judge("j"), "", models=models, inputs=JudgeInputs.take(TASK, policy_trace)
        )
