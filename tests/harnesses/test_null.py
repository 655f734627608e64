"""The null harness (one call, no tools, no sandbox) and verdict JSON parsing."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harnesses.base import Budget, Trace
from harnesses.errors import HarnessConfigError, ModelHTTPError, ReplyParseError
from harnesses.null import NullConfig, NullHarness, parse_reply_json
from harnesses.scripted import http_error, reply

from .conftest import ScriptedFactory


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_one_call_reply_is_the_output(scripted: ScriptedFactory) -> None:
    verdict = '```json\n{"score": 0.5, "reason": "half right"}\n```'
    server = scripted([reply(verdict, usage=(40, 9))])
    harness = NullHarness(NullConfig(system_prompt="You are a strict grader."))
    trace = await harness.run("Grade this answer.", runtime=None, model=server.endpoint())
    assert trace.ok and trace.error is None
    assert trace.output == verdict
    assert parse_reply_json(trace.output) == {"score": 0.5, "reason": "half right"}
    [turn] = trace.turns
    assert turn.usage.total_tokens == 49 and trace.usage.total_tokens == 49
    assert turn.reply is not None and turn.reply.tool_calls == []
    sent = server.requests[0].body
    assert sent["messages"] == [
        {"role": "system", "content": "You are a strict grader."},
        {"role": "user", "content": "Grade this answer."},
    ]
    assert "tools" not in sent
    assert trace.finished_at is not None and trace.duration > 0
    # JSON round trip: what placement stores as trace.json
    restored = Trace.model_validate_json(trace.model_dump_json())
    assert restored.output == verdict and restored.usage.total_tokens == 49
    assert json.loads(trace.model_dump_json())["usage"]["total_tokens"] == 49


@pytest.mark.anyio
async def test_messages_task_is_sent_as_is(scripted: ScriptedFactory) -> None:
    server = scripted([reply("ok")])
    task = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    task.append({"role": "user", "content": "c"})
    trace = await NullHarness().run(task, runtime=None, model=server.endpoint())
    assert trace.output == "ok"
    assert server.requests[0].body["messages"] == task


@pytest.mark.anyio
async def test_model_http_error_is_on_the_trace(scripted: ScriptedFactory) -> None:
    server = scripted([http_error(503, "overloaded")])
    trace = await NullHarness().run("hi", runtime=None, model=server.endpoint())
    assert trace.error is not None
    assert trace.error.kind == "model_error"
    assert trace.error.status_code == 503
    assert trace.error.exception_type == "ModelHTTPError"
    assert trace.output is None
    assert trace.turns[0].status_code == 503
    with pytest.raises(ModelHTTPError) as info:
        trace.raise_for_error()
    assert info.value.status_code == 503


@pytest.mark.anyio
async def test_zero_turn_budget_makes_no_call(scripted: ScriptedFactory) -> None:
    server = scripted([reply("never")])
    trace = await NullHarness().run(
        "hi", runtime=None, model=server.endpoint(), budget=Budget(max_turns=0)
    )
    assert trace.error is not None and trace.error.kind == "budget_turns"
    assert server.requests == [] and trace.turns == []


@pytest.mark.anyio
async def test_time_budget_cancels_the_call(scripted: ScriptedFactory) -> None:
    server = scripted([reply("too late", delay=6)])
    trace = await NullHarness().run(
        "hi", runtime=None, model=server.endpoint(), budget=Budget(max_seconds=0.3)
    )
    assert trace.error is not None and trace.error.kind == "budget_time"
    assert trace.duration < 5, "the call was not cut at the budget (slack for a busy machine)"
    assert trace.turns[0].error == "cancelled by the time budget"


@pytest.mark.anyio
async def test_empty_task_is_refused(scripted: ScriptedFactory) -> None:
    server = scripted([])
    with pytest.raises(HarnessConfigError):
        await NullHarness().run("  ", runtime=None, model=server.endpoint())


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"score": 1}', {"score": 1}),
        ('  \n{"score": 1}\n', {"score": 1}),
        ("[1, 2]", [1, 2]),
        ('```json\n{"score": 1}\n```', {"score": 1}),
        ('\n```JSON\n{\n  "a": [1, 2]\n}\n```\n', {"a": [1, 2]}),
    ],
)
def test_bare_and_fenced_json_are_accepted(text: str, expected: Any) -> None:
    assert parse_reply_json(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        'The verdict is {"score": 1}',
        '{"score": 1} -- hope this helps',
        'Here it is:\n```json\n{"score": 1}\n```',
        '```json\n{"score": 1}\n```\nThanks!',
        '```\n{"score": 1}\n```',
        '```json\n{"score": 1}\n```\n```json\n{"score": 2}\n```',
        "```json\n{not json}\n```",
        "{'score': 1}",
    ],
)
def test_anything_else_is_a_parse_error(text: str | None) -> None:
    with pytest.raises(ReplyParseError):
        parse_reply_json(text)
