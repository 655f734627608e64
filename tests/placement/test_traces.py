"""Traces in the shapes RL users have (``placement.traces``) and the ``--scripted`` file format:
converted or refused with where, never loaded with the policy's messages silently dropped."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from harnesses.base import ToolResult, Trace, TraceError, Turn, utc_now
from harnesses.llm import ChatReply, ToolCall, Usage
from harnesses.scripted import ScriptedError, ScriptedReply, ScriptFile, load_script_file
from placement.errors import PlacementConfigError, RecordInvalid
from placement.inputs import JudgeInputs
from placement.rollout import load_rollout, scripted_models
from placement.specs import JudgeSpec
from placement.traces import load_trace, trace_from_messages
from placement.trainers.grading import transcript_trace

from ..doc_examples import example, run_example

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "cli.md"
TASK = {"id": "fizz", "prompt": "Write fizzbuzz.py."}

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Write fizzbuzz.py."},
    {
        "role": "assistant",
        "content": "I will write it.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "cat > fizzbuzz.py"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "python3 fizzbuzz.py"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "WROTE-FILE"},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "1 2 FIZZ"}]},
    {"role": "user", "content": "Is it done?"},
    {
        "role": "assistant",
        "content": [{"type": "text", "text": "DONE-"}, {"type": "text", "text": "AND-TESTED"}],
    },
]


def _doc_section(heading: str) -> str:
    text = DOC.read_text()
    return text.split(f"### {heading}\n", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def _blocks(section: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```$", section, re.S | re.M)


# ---------------------------------------------------------------------- the docs


def test_the_traces_example_prints_what_the_docs_show(tmp_path: Path) -> None:
    code, shown = example("docs/cli.md", "### Traces from messages")
    assert run_example(code, tmp_path, timeout=60) == shown


def test_the_scripted_example_is_a_valid_script_file() -> None:
    [example] = [body for lang, body in _blocks(_doc_section("The `--scripted` replies file"))
                 if lang == "json"]  # fmt: skip
    scripts = load_script_file(example, "the docs' example")
    assert [type(i) for i in scripts["test-runner"]] == [
        ScriptedReply, ScriptedError, ScriptedReply
    ]  # fmt: skip
    fields = ScriptFile.model_json_schema()["$defs"]["ScriptedReply"]["properties"]
    documented = re.findall(r"^\| `(\w+)` \|", _doc_section("The `--scripted` replies file"), re.M)
    assert set(fields) | {"status", "message", "headers"} == set(documented)


# ---------------------------------------------------------------------- converting


def test_a_messages_rollout_gives_judges_the_policy_messages(tmp_path: Path) -> None:
    """The reported friction: ``{"harness", "messages"}`` loaded with no turns, and the
    judges' transcript held none of the policy's messages."""
    (tmp_path / "task.json").write_text(json.dumps(TASK))
    (tmp_path / "trace.json").write_text(json.dumps({"harness": "trl", "messages": CONVERSATION}))
    rollout = load_rollout(tmp_path)
    assert [len(t.request_messages) for t in rollout.trace.turns] == [2, 6]
    transcript = JudgeInputs.take(TASK, rollout.trace).transcript_md.decode()
    for seen in ("I will write it.", "cat > fizzbuzz.py", "WROTE-FILE", "1 2 FIZZ", "Is it done?",
                 "DONE-AND-TESTED"):  # fmt: skip
        assert seen in transcript, seen


def test_tool_messages_are_the_results_of_the_calls_before_them() -> None:
    trace = trace_from_messages(CONVERSATION, harness="trl", model="qwen")
    first, second = trace.turns
    assert first.reply is not None and [c.id for c in first.reply.tool_calls] == ["c1", "c2"]
    assert [(r.call_id, r.name, r.output) for r in first.tool_results] == [
        ("c1", "bash", "WROTE-FILE"), ("c2", "bash", "1 2 FIZZ")
    ]  # fmt: skip
    assert first.tool_results[1].arguments == '{"command": "python3 fizzbuzz.py"}'
    assert second.reply is not None and second.reply.content == "DONE-AND-TESTED"
    assert (trace.harness, trace.model, trace.output) == ("trl", "qwen", "DONE-AND-TESTED")


def test_openai_sdk_dumps_and_trl_tool_calls_convert() -> None:
    """``message.model_dump()`` of the OpenAI SDK writes empty fields; TRL's environment
    writes flat or dict arguments; duplicate ids are answered in order."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "refusal": None, "audio": None,
         "function_call": None, "annotations": [],
         "tool_calls": [{"id": "x", "function": {"name": "bash", "arguments": {"command": "a"}}},
                        {"id": "x", "name": "read_file", "arguments": {"path": "b"}}]},
        {"role": "tool", "tool_call_id": "x", "content": "A"},
        {"role": "tool", "tool_call_id": "x", "content": "B"},
        {"role": "tool", "tool_call_id": "unknown", "name": "bash", "content": "C"},
    ]  # fmt: skip
    [turn] = trace_from_messages(messages).turns
    assert turn.reply is not None
    assert [(c.name, json.loads(c.arguments)) for c in turn.reply.tool_calls] == [
        ("bash", {"command": "a"}), ("read_file", {"path": "b"})
    ]  # fmt: skip
    assert [(r.name, r.output) for r in turn.tool_results] == [
        ("bash", "A"), ("read_file", "B"), ("bash", "C")
    ]  # fmt: skip


def test_messages_after_the_last_reply_are_a_last_turn_not_dropped() -> None:
    trace = trace_from_messages([*CONVERSATION, {"role": "user", "content": "LAST-WORD"}])
    last = trace.turns[-1]
    assert last.reply is None and last.request_messages[-1]["content"] == "LAST-WORD"
    assert "LAST-WORD" in JudgeInputs.take(TASK, trace).transcript_md.decode()
    only_prompt = trace_from_messages([{"role": "user", "content": "hi"}])
    assert [len(t.request_messages) for t in only_prompt.turns] == [1]
    assert trace_from_messages([]).turns == []


def test_every_shape_trainers_hand_around_loads() -> None:
    listed = load_trace(json.dumps(CONVERSATION).encode())  # an OpenEnv transcript
    assert len(listed.turns) == 2 and listed.harness == "messages"
    prompt_completion = load_trace(
        {"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:], "harness": "trl",
         "metadata": {"step": 3}}
    )  # fmt: skip
    assert len(prompt_completion.turns) == 2 and prompt_completion.metadata == {"step": 3}
    standard = load_trace({"prompt": "2+2?", "completion": "4"})
    assert standard.output == "4" and standard.turns[0].request_messages[0]["content"] == "2+2?"


def test_a_written_trace_round_trips_with_its_computed_fields() -> None:
    turn = Turn(
        index=0, started_at=utc_now(), request_messages=[{"role": "user", "content": "u"}],
        reply=ChatReply(content="r", tool_calls=[ToolCall(id="a", name="bash")],
                        usage=Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)),
        tool_results=[ToolResult(call_id="a", name="bash", arguments="{}", output="o")],
        usage=Usage(total_tokens=3),
    )  # fmt: skip
    trace = Trace(harness="bash", turns=[turn], error=TraceError(kind="budget_turns", message="m"))
    trace.extra_usage["judges"] = Usage(total_tokens=5)
    loaded = load_trace(trace.model_dump_json())
    assert loaded.model_dump() == trace.model_dump()


def test_grading_converts_with_the_same_converter() -> None:
    trace = transcript_trace(CONVERSATION)
    assert trace.harness == "trainer" and len(trace.turns[0].tool_results) == 2
    with pytest.raises(RecordInvalid, match="message 0 is a tool message"):
        transcript_trace([{"role": "tool", "tool_call_id": "c", "content": "x"}])


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        (["hello"], r"message 0 is a str, not a mapping"),
        ([{"content": "x"}], r"message 0 has no string 'role'"),
        ([{"role": "user", "content": 5}], r"message 0 is malformed: content"),
        ([{"role": "user", "content": "u"}, {"role": "tool", "content": "x"}],
         r"message 1 is a tool message that does not follow an assistant"),
        ([{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"},
          {"role": "tool", "content": "x"}], r"message 2 is a tool message"),
        ([{"role": "assistant", "content": "a", "refusal": "r"}],
         r"message 0 \(assistant\): field 'refusal' has no place"),
        ([{"role": "assistant", "content": [{"type": "image_url", "image_url": {}}]}],
         r"message 0: content part 0 is not a text part"),
        ([{"role": "assistant", "tool_calls": "bash"}], r"message 0: tool_calls is a str"),
        ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
         r"message 0, tool call 0 has no string function name"),
        ([{"role": "assistant", "content": "a"},
          {"role": "tool", "tool_call_id": "c", "content": "o", "exit": 3}],
         r"message 1 \(tool\): field 'exit' has no place"),
    ],
    ids=["not-a-mapping", "no-role", "content-a-number", "tool-after-user",
         "tool-after-a-later-user", "refusal", "image-reply", "tool-calls-a-string",
         "no-function-name", "tool-extra-field"],
)  # fmt: skip
def test_malformed_messages_are_refused_naming_where(messages: list[Any], where: str) -> None:
    with pytest.raises(RecordInvalid, match=where):
        trace_from_messages(messages)


@pytest.mark.parametrize(
    ("document", "where"),
    [
        ({"harness": "h", "messages": [], "reward": 1}, r"unknown keys 'reward'"),
        ({"harness": "h", "messages": [], "turns": []}, r"unknown keys 'turns' \(a trace "),
        ({"harness": "h", "steps": []}, r"the trace: unknown field 'steps'"),
        ({"harness": "h", "turns": [{"index": 0, "started_at": "2026-01-01T00:00:00Z",
                                     "request_messages": [], "messages": []}]},
         r"the trace.turns\[0\]: unknown field 'messages'"),
        ({"harness": "h", "messages": "hi"}, r"messages is a str"),
        ({"prompt": 5}, r"prompt is a int"),
        ("nope", r"the trace is a str"),
    ],
    ids=["messages-and-reward", "messages-and-turns", "trace-typo", "turn-messages",
         "messages-a-string", "prompt-a-number", "a-string"],
)  # fmt: skip
def test_trace_documents_with_unplaced_keys_are_refused(document: Any, where: str) -> None:
    with pytest.raises(RecordInvalid, match=where):
        load_trace(json.dumps(document))


def test_load_rollout_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "task.json").write_text(json.dumps(TASK))
    (tmp_path / "trace.json").write_text(json.dumps({"messages": [], "score": 1}))
    with pytest.raises(PlacementConfigError, match=r"trace\.json: the messages trace has unknown"):
        load_rollout(tmp_path)


# ---------------------------------------------------------------------- --scripted


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ({"g": [{"contnet": "x"}]}, r"'g'\[0\] is not a reply: contnet: .*did you mean content"),
        ({"g": [{"content": "x"}, {"status": 200}]}, r"'g'\[1\] is not an error .*status"),
        ({"g": [{"tool_calls": [{"nme": "bash"}]}]}, r"'g'\[0\] is not a reply: tool_calls\.0"),
        ({"g": {"content": "x"}}, r"the script 'g' is a dict, not a list"),
        ({"g": ["done"]}, r"'g'\[0\] is a str, not an object"),
        ([{"content": "x"}], r"must be a JSON object mapping each judge's name"),
    ],
    ids=["typo", "status-200", "tool-call-typo", "not-a-list", "item-a-string", "a-list"],
)
def test_a_malformed_script_file_names_the_bad_entry(
    tmp_path: Path, script: Any, message: str
) -> None:
    """Before, an unknown field was ignored: ``{"contnet": ...}`` was an empty reply."""
    path = tmp_path / "s.json"
    path.write_text(json.dumps(script))
    judge = JudgeSpec.model_validate(
        {"name": "g", "harness": "null", "model": "g", "prompt": "p",
         "verdict_schema": {"passed": "boolean"}}
    )  # fmt: skip
    with pytest.raises(PlacementConfigError, match=message) as info, scripted_models([judge], path):
        pass
    assert str(path) in str(info.value)
