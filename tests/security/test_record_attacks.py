"""Attack class 18: a malformed record or verdict crashes judging.

What the policy controls ends up in the record judging reads: through the model proxy,
the whole history of an installed agent's request (its ``tool_calls``, its messages'
``content`` and ``role``); through a judge that ran its program, the verdict's bytes. A
crash there (a bare ``AttributeError`` out of ``run_judges`` or ``vf-sandbox judge``) loses
the run's record and leaves the trainer an untyped exception instead of a failed rollout.

The safe outcome: a record that is not a chat transcript is refused at the judging
boundary (:func:`placement.transcript.validate_record`) as
:class:`~placement.errors.JudgeRecordInvalid` on every judge, each run recorded (on the
:class:`~placement.errors.JudgingFailed` group and on ``trace.agents``), no judge model
called; a verdict that is not strict JSON matching its schema (a 5000-digit integer,
``1e999``, a repeated key, a byte-order mark, UTF-16) is
:class:`~placement.errors.VerdictInvalid`, never ``JudgeAgentFailed`` or worse.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from harnesses.base import Trace, Turn, utc_now
from harnesses.scripted import bash_call, reply
from placement import errors as PE
from placement.run import run_judges
from placement.specs import JudgeSpec
from runtimes import open_runtime
from tests.placement import conftest as placement_fixtures
from tests.placement.conftest import TASK, ModelsFactory

from .conftest import Hostile

pytestmark = [pytest.mark.anyio, pytest.mark.attack(18)]

scripted_models = placement_fixtures.scripted_models

REPO = Path(__file__).resolve().parents[2]
SCHEMA = {"passed": "boolean", "score": "number"}
MARK = "SANDBOX-CONTENT-7f3a"

# Requests an installed agent can send the model proxy, recorded as its turn's messages.
MALFORMED: dict[str, list[Any]] = {
    "tool-calls-a-string": [{"role": "assistant", "tool_calls": f"call {MARK}"}],
    "tool-calls-a-number": [{"role": "assistant", "tool_calls": 5}],
    "tool-calls-a-dict": [{"role": "assistant", "tool_calls": {"0": {"function": {}}}}],
    "function-a-string": [{"role": "assistant", "tool_calls": [{"function": MARK}]}],
    "arguments-a-list": [
        {"role": "assistant", "tool_calls": [{"function": {"name": "x", "arguments": [MARK]}}]}
    ],
    "content-a-number": [{"role": "user", "content": 5}],
    "content-a-dict": [{"role": "user", "content": {"text": MARK}}],
    "role-missing": [{"content": MARK}],
    "role-a-list": [{"role": ["user"], "content": MARK}],
    "not-a-message": [MARK],
}


def proxied(messages: list[Any]) -> Trace:
    """A trace whose one turn the model proxy recorded from an agent's request."""
    turn = Turn(index=0, started_at=utc_now(), request_messages=[], recorded_by="proxy")
    turn.request_messages.extend(messages)  # as recorded: the body's messages, unvalidated
    return Trace(harness="mini-swe-agent", turns=[turn]).finish("done")


def null_judge(name: str) -> JudgeSpec:
    return JudgeSpec(name=name, harness="null", model=name, prompt="p", verdict_schema=SCHEMA)


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_a_malformed_record_fails_every_judge_typed_and_recorded(
    case: str, scripted_models: ModelsFactory
) -> None:
    models = scripted_models({"a": [reply('{"passed": true, "score": 1}')], "b": []})
    trace = proxied(MALFORMED[case])
    with pytest.raises(PE.JudgingFailed) as info:
        await run_judges([null_judge("a"), null_judge("b")], task=TASK, trace=trace, models=models)
    errors = info.value.exceptions
    assert [type(e) for e in errors] == [PE.JudgeRecordInvalid] * 2, errors
    assert isinstance(errors[0].__cause__, PE.RecordInvalid)
    assert re.search(r"turns?[ .]0.*request[ _]messages?[ .]0", str(errors[0])), errors[0]
    assert MARK not in str(errors[0]), "the error names where, never echoes the content"
    assert [r.error_type for r in info.value.runs] == ["JudgeRecordInvalid"] * 2
    assert [a.error_type for a in trace.agents] == ["JudgeRecordInvalid"] * 2
    assert all(r.verdict is None and r.finished is not None for r in info.value.runs)


async def test_an_unserialisable_record_is_record_invalid(scripted_models: ModelsFactory) -> None:
    models = scripted_models({"a": []})
    trace = Trace(harness="bash", metadata={"raw": b"\xff\xfe"}).finish("done")
    [run] = await run_judges([null_judge("a")], task=TASK, trace=trace, models=models, strict=False)
    assert run.error_type == "JudgeRecordInvalid" and "cannot be serialised" in (run.error or "")


async def test_unpaired_surrogates_are_shown_not_fatal(scripted_models: ModelsFactory) -> None:
    """Tool output decoded with surrogateescape holds lone surrogates: judged, not refused."""
    models = scripted_models({"a": [reply('{"passed": false, "score": 0}')]})
    turn = Turn(
        index=0, started_at=utc_now(), request_messages=[{"role": "user", "content": "\udcff"}]
    )
    trace = Trace(harness="bash", turns=[turn]).finish("bytes \udcfe")
    [run] = await run_judges([null_judge("a")], task=TASK, trace=trace, models=models)
    assert run.verdict == {"passed": False, "score": 0}


def test_vf_sandbox_judge_on_a_malformed_record_fails_typed_not_with_a_traceback(
    tmp_path: Path,
) -> None:
    rollout = tmp_path / "rollout"
    rollout.mkdir()
    (rollout / "task.json").write_text(json.dumps(TASK))
    (rollout / "trace.json").write_text(proxied(MALFORMED["tool-calls-a-string"]).model_dump_json())
    judges = {"judges": [{"name": "g", "harness": "null", "model": "g", "prompt": "p",
                          "verdict_schema": SCHEMA}]}  # fmt: skip
    (tmp_path / "judges.yaml").write_text(yaml.safe_dump(judges))
    (tmp_path / "scripted.json").write_text(json.dumps({"g": [{"content": '{"passed": true}'}]}))
    out = tmp_path / "runs.json"
    result = subprocess.run(
        [sys.executable, "-m", "placement.cli", "judge", str(rollout),
         "--judges", str(tmp_path / "judges.yaml"), "--scripted", str(tmp_path / "scripted.json"),
         "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr and "AttributeError" not in result.stdout
    assert "JudgeRecordInvalid" in result.stdout
    [run] = json.loads(out.read_text())
    assert run["error_type"] == "JudgeRecordInvalid" and run["verdict"] is None


# ---------------------------------------------------------------------- verdicts

DIGITS = "9" * 5000
FILE_VERDICTS = {
    "5000-digit-integer": f'printf \'{{"passed": true, "score": {DIGITS}}}\'',
    "overflowing-float": 'printf \'{"passed": true, "score": 1e999}\'',
    "repeated-key": 'printf \'{"passed": false, "score": 0, "passed": true}\'',
    "byte-order-mark": 'printf \'\\357\\273\\277{"passed": true, "score": 1}\'',
    "utf-16": 'printf \'{"passed": true, "score": 1}\' | iconv -t UTF-16',
}


@pytest.mark.parametrize("hostile", ["subprocess", "docker-user"], indirect=True)
async def test_hostile_verdict_files_are_verdict_invalid(
    hostile: Hostile, scripted_models: ModelsFactory
) -> None:
    """The judge wrote what the policy's program printed into its verdict (as a test-runner
    judge that pipes output does): each is VerdictInvalid (the 5000-digit integer was
    JudgeAgentFailed, the repeated key and the BOM were accepted as passing)."""
    names = {case: f"v{index}" for index, case in enumerate(FILE_VERDICTS)}
    models = scripted_models(
        {
            names[case]: [bash_call(f'{write} > "$VF_AGENT_VERDICT"'), reply("done")]
            for case, write in FILE_VERDICTS.items()
        }
    )
    judges = [
        JudgeSpec(name=n, harness={"id": "bash", "per_call_timeout": 30}, model=n, prompt="p",
                  verdict_schema=SCHEMA)
        for n in names.values()
    ]  # fmt: skip
    async with open_runtime(hostile.config) as rt:
        with anyio.fail_after(120):
            runs = await run_judges(
                judges, task=TASK, trace=Trace(harness="bash").finish("done"), models=models,
                runtime=rt, strict=False,
            )  # fmt: skip
    outcome = {case: run.error_type for case, run in zip(FILE_VERDICTS, runs, strict=True)}
    assert outcome == {case: "VerdictInvalid" for case in FILE_VERDICTS}
    assert all(run.verdict is None for run in runs)


@pytest.mark.parametrize(
    "content",
    [
        f'{{"passed": true, "score": {DIGITS}}}',
        f'```json\n{{"passed": true, "score": {DIGITS}}}\n```',
        '{"passed": false, "score": 0, "passed": true}',
        '{"passed": true, "score": 1e999}',
        '{"passed": true, "score": -Infinity}',
        "[" * 100_000,
    ],
    ids=["5000-digits", "5000-digits-fenced", "repeated-key", "overflow", "infinity", "deep"],
)
async def test_hostile_reply_verdicts_are_verdict_invalid(
    content: str, scripted_models: ModelsFactory
) -> None:
    models = scripted_models({"a": [reply(content)]})
    trace = Trace(harness="bash").finish("done")
    with pytest.raises(PE.JudgingFailed) as info:
        await run_judges([null_judge("a")], task=TASK, trace=trace, models=models)
    assert [type(e) for e in info.value.exceptions] == [PE.VerdictInvalid]
