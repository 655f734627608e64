"""Traces from the shapes trainers hand around, and ``trace.json`` read strictly.

Judges read the policy's run as a :class:`~harnesses.base.Trace` (its turns: the messages of
each model call, the reply, the tool results). Trainers keep conversations as chat messages
instead; :func:`trace_from_messages` is the one converter from those (OpenAI-style
``system`` / ``developer`` / ``user`` / ``assistant`` / ``tool`` messages, which is also the
shape of an OpenEnv transcript and of TRL's conversational ``prompt`` + ``completion``) to a
``Trace``, and :func:`load_trace` reads a ``trace.json`` in any of these shapes.

Where each message goes (nothing is dropped: what has no place is an error):

- each ``assistant`` message is one turn: its request is every message before it, its
  reply is the message's ``content`` (a string, or a list of ``text`` parts) and
  ``tool_calls`` (OpenAI's ``{"id", "function": {"name", "arguments"}}``, or a flat
  ``{"name", "arguments"}``; arguments as JSON text or a JSON value);
- the ``tool`` messages right after it are that turn's tool results (matched to its calls
  by ``tool_call_id``); a ``tool`` message anywhere else is refused;
- messages after the last assistant message (or all of them, when there is none) form a
  last turn with no reply;
- an assistant message's ``reasoning_content`` (or ``reasoning``) is its reply's
  ``reasoning``, shown to judges beside the content;
- any other field of an assistant or tool message that holds a value (``refusal``,
  ``audio``, ...) is refused: a ``Trace`` has no place for it, and judges would
  not see it. Fields that are ``null`` or empty (as the OpenAI SDK writes them) are fine.

Everything here may come from the policy, so it is bounded: the bytes of a document
(:data:`MAX_TRACE_BYTES`), its JSON nesting and containers, the number of messages
(:data:`MAX_MESSAGES`) and the history the turns repeat (:data:`MAX_HISTORY_BYTES`). Every
refusal is :class:`~placement.errors.RecordInvalid`, naming where (``message 3``,
``turns[2].reply``), never echoing content.
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from harnesses.base import ToolResult, Trace, Turn, utc_now
from harnesses.llm import ChatReply, Message, ToolCall
from harnesses.proxy_requests import ProxyRequestError, parse_json_bounded

from .errors import RecordInvalid
from .transcript import RecordedMessage, validation_summary

__all__ = [
    "MAX_HISTORY_BYTES",
    "MAX_MESSAGES",
    "MAX_TRACE_BYTES",
    "MESSAGES_KEYS",
    "PROMPT_COMPLETION_KEYS",
    "load_trace",
    "trace_from_messages",
]

MAX_TRACE_BYTES = 128 * 2**20
"""The largest ``trace.json`` :func:`load_trace` reads (128 MiB)."""
MAX_TRACE_CONTAINERS = 4_000_000
"""JSON objects plus arrays one trace document may hold."""
MAX_TRACE_DEPTH = 64
"""How deep a trace document's objects and arrays may nest."""
MAX_MESSAGES = 2_000
"""The most messages :func:`trace_from_messages` converts."""
MAX_HISTORY_BYTES = 256 * 2**20
"""The most bytes of messages the converted turns may repeat between them (each turn's
request is the whole history before it, so a long conversation costs its square)."""

MESSAGES_KEYS = frozenset({"messages", "harness", "model", "metadata"})
"""The keys of a ``{"messages": [...]}`` trace document."""
PROMPT_COMPLETION_KEYS = frozenset({"prompt", "completion", "harness", "model", "metadata"})
"""The keys of a TRL-style ``{"prompt": ..., "completion": ...}`` trace document."""

_REASONING_FIELDS = ("reasoning_content", "reasoning")
"""Where endpoints put a reasoning model's thinking; kept as the reply's ``reasoning``."""
_REPLY_FIELDS = frozenset({"role", "content", "tool_calls", *_REASONING_FIELDS})
_TOOL_FIELDS = frozenset({"role", "content", "tool_call_id", "name"})
_CALL_FIELDS = frozenset({"id", "type", "index", "function", "name", "arguments"})
_FUNCTION_FIELDS = frozenset({"name", "arguments"})


def trace_from_messages(
    messages: Sequence[Message], *, harness: str = "messages", model: str | None = None
) -> Trace:
    """A :class:`~harnesses.base.Trace` of a chat conversation (see the module docstring
    for where each message goes): what judges read as they read a harness's trace.

    Args:
        messages: OpenAI-style chat messages, in order (an OpenEnv transcript, TRL's
            ``prompt + completion``, a ``{"messages": [...]}`` record's list).
        harness: the trace's ``harness`` (who ran the conversation).
        model: the trace's ``model``, if known.

    Returns:
        A finished trace; its ``output`` is the last non-empty assistant text.

    Raises:
        RecordInvalid: ``messages`` is not a list of chat messages (a message that is not a
            mapping, without a string ``role``, with mistyped fields), holds more than
            :data:`MAX_MESSAGES` or more history than :data:`MAX_HISTORY_BYTES`, a ``tool``
            message does not follow an assistant message, or a message has a field a trace
            has no place for. The message names the message's index and the field.
    """
    given: object = messages  # from a file or a trainer: checked, whatever its annotation
    if isinstance(given, str | bytes) or not isinstance(given, Sequence):
        raise RecordInvalid(f"messages is a {type(given).__name__}, not a list of messages")
    if len(messages) > MAX_MESSAGES:
        raise RecordInvalid(f"{len(messages)} messages: at most {MAX_MESSAGES} are converted")
    history: list[Message] = []
    sizes: list[int] = []
    replies: dict[int, ChatReply] = {}
    for index, message in enumerate(messages):
        canonical, reply = _canonical(index, message)
        history.append(canonical)
        sizes.append(_size(index, canonical))
        if reply is not None:
            replies[index] = reply
    now = utc_now()
    trace = Trace(harness=harness, model=model, started_at=now)
    repeated = prefix = 0
    turn: Turn | None = None
    placed = 0  # messages before this index are a turn's request, reply or tool results
    for index, message in enumerate(history):
        role = message["role"]
        if index in replies:
            repeated += prefix
            if repeated > MAX_HISTORY_BYTES:
                raise RecordInvalid(
                    f"message {index}: the turns would repeat over {MAX_HISTORY_BYTES} bytes "
                    "of history (each turn's request is every message before it)"
                )
            reply = replies[index]
            turn = Turn(
                index=len(trace.turns), started_at=now, request_messages=history[:index],
                reply=reply,
            )  # fmt: skip
            trace.turns.append(turn)
            if reply.content:
                trace.output = reply.content
            placed = index + 1
        elif role == "tool":
            if turn is None or turn.reply is None or placed != index:
                raise RecordInvalid(
                    f"message {index} is a tool message that does not follow an assistant "
                    "message: a trace holds tool output only as the results of the tool "
                    "calls just before it"
                )
            turn.tool_results.append(_tool_result(index, message, turn))
            placed = index + 1
        prefix += sizes[index]
    if placed < len(history):  # messages no reply followed: a last turn without one
        trace.turns.append(
            Turn(index=len(trace.turns), started_at=now, request_messages=list(history))
        )
    trace.finished_at = now
    return trace


def load_trace(document: bytes | str | Any) -> Trace:
    """The trace a ``trace.json`` holds, in any of the shapes trainers hand around.

    ``document`` is the file's bytes (or text), or its parsed JSON value:

    - a ``Trace`` as ``trace.model_dump_json()`` writes it (``{"harness", "turns", ...}``);
      every object in it must have only the fields its model has (computed fields such as
      ``usage`` are accepted and recomputed);
    - ``{"messages": [...], "harness"?, "model"?, "metadata"?}`` (OpenAI-style messages);
    - ``{"prompt": ..., "completion": ..., "harness"?, "model"?, "metadata"?}`` (TRL's
      conversational or standard format: a string prompt is a user message, a string
      completion an assistant message);
    - a bare list of messages (an OpenEnv transcript).

    Messages are converted by :func:`trace_from_messages`; ``harness`` defaults to
    ``"messages"``.

    Raises:
        RecordInvalid: over :data:`MAX_TRACE_BYTES` or the JSON bounds, not UTF-8 JSON, an
            unknown key anywhere a model has fixed fields (named with its path), a document
            that mixes shapes (``messages`` beside ``turns``), or a malformed trace or
            message (see :func:`trace_from_messages`).
    """
    if isinstance(document, str):
        document = document.encode("utf-8", "surrogatepass")
    if isinstance(document, bytes | bytearray):
        if len(document) > MAX_TRACE_BYTES:
            raise RecordInvalid(f"the trace is {len(document)} bytes, over {MAX_TRACE_BYTES}")
        try:
            document = parse_json_bounded(
                bytes(document), max_containers=MAX_TRACE_CONTAINERS, max_depth=MAX_TRACE_DEPTH
            )
        except ProxyRequestError as exc:
            raise RecordInvalid(f"the trace {str(exc).removeprefix('request body ')}") from None
    if isinstance(document, list):
        return trace_from_messages(document)
    if not isinstance(document, Mapping):
        raise RecordInvalid(f"the trace is a {type(document).__name__}, not an object or list")
    if "messages" in document:
        return _from_shape(document, MESSAGES_KEYS, "messages", document["messages"])
    if "prompt" in document or "completion" in document:
        messages = [
            *_as_messages(document.get("prompt"), "user", "prompt"),
            *_as_messages(document.get("completion"), "assistant", "completion"),
        ]
        return _from_shape(document, PROMPT_COMPLETION_KEYS, "prompt/completion", messages)
    _check_fields(Trace, document, "the trace")
    try:
        return Trace.model_validate(document)
    except RecursionError:
        raise RecordInvalid("the trace is nested too deeply") from None
    except ValidationError as exc:
        raise RecordInvalid(f"the trace is malformed: {validation_summary(exc)}") from None


# ---------------------------------------------------------------------- messages


def _canonical(index: int, message: Any) -> tuple[Message, ChatReply | None]:
    """``message`` as the trace records it (an assistant message rewritten from its reply,
    so its tool calls are in OpenAI's form), and its reply when it is an assistant's."""
    if not isinstance(message, Mapping):
        raise RecordInvalid(f"message {index} is a {type(message).__name__}, not a mapping")
    role = message.get("role")
    if not isinstance(role, str):
        raise RecordInvalid(f"message {index} has no string 'role'")
    if role == "assistant":
        _only(
            index, message, _REPLY_FIELDS, "an assistant message (content, tool_calls, reasoning)"
        )
        content = _text(index, message.get("content"))
        reply = ChatReply(
            content=content,
            tool_calls=_tool_calls(index, message),
            reasoning=_reasoning(index, message),
        )
        return reply.assistant_message(), reply
    if role == "tool":
        _only(index, message, _TOOL_FIELDS, "a tool message (content, tool_call_id, name)")
    copy = dict(message)
    try:
        RecordedMessage.model_validate(copy)
    except ValidationError as exc:
        raise RecordInvalid(f"message {index} is malformed: {validation_summary(exc)}") from None
    return copy, None


def _reasoning(index: int, message: Mapping[str, Any]) -> str | None:
    """The reasoning text of an assistant message (both fields, when both hold text)."""
    parts = []
    for key in _REASONING_FIELDS:
        value = message.get(key)
        if value in (None, ""):
            continue
        text = _text(index, value)
        if text and text not in parts:
            parts.append(text)
    return "\n\n".join(parts) or None


def _only(index: int, message: Mapping[str, Any], known: frozenset[str], what: str) -> None:
    """Refuse a field outside ``known`` that holds a value (``null`` / empty is nothing)."""
    for key, value in message.items():
        if key not in known and value not in (None, "", [], {}):
            raise RecordInvalid(
                f"message {index} ({message.get('role')}): field {_key(key)} has no place in "
                f"a trace, which records {what}: remove it, or fold it into content"
            )


def _text(index: int, content: Any) -> str | None:
    """A reply's or tool result's text: a string, or a list of ``text`` parts joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RecordInvalid(f"message {index}: content is a {type(content).__name__}")
    texts = []
    for number, part in enumerate(content):
        if not (isinstance(part, Mapping) and part.get("type") == "text"):
            raise RecordInvalid(
                f"message {index}: content part {number} is not a text part "
                "({'type': 'text', 'text': ...}); a reply or tool result holds text only"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise RecordInvalid(f"message {index}: content part {number} has no string 'text'")
        texts.append(text)
    return "".join(texts)


def _tool_calls(index: int, message: Mapping[str, Any]) -> list[ToolCall]:
    """The message's tool calls (OpenAI's ``{"id", "function": {...}}`` or a flat
    ``{"name", "arguments"}``; arguments as JSON text or a JSON value)."""
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise RecordInvalid(f"message {index}: tool_calls is a {type(raw_calls).__name__}")
    calls = []
    for number, raw in enumerate(raw_calls):
        where = f"message {index}, tool call {number}"
        if not isinstance(raw, Mapping):
            raise RecordInvalid(f"{where} is a {type(raw).__name__}, not a mapping")
        _fields(raw, _CALL_FIELDS, where)
        function = raw.get("function", raw)
        if not isinstance(function, Mapping):
            raise RecordInvalid(f"{where}: function is a {type(function).__name__}")
        if function is not raw:
            _fields(function, _FUNCTION_FIELDS, f"{where}, function")
        name = function.get("name")
        if not isinstance(name, str):
            raise RecordInvalid(f"{where} has no string function name")
        arguments = function.get("arguments", {})
        try:
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        except (TypeError, ValueError, RecursionError):
            raise RecordInvalid(f"{where}: its arguments are not JSON") from None
        call_id = raw.get("id")
        if call_id is not None and not isinstance(call_id, str | int):
            raise RecordInvalid(f"{where}: id is a {type(call_id).__name__}")
        calls.append(ToolCall(id=str(call_id or f"call_{number}"), name=name, arguments=text))
    return calls


def _fields(value: Mapping[str, Any], known: frozenset[str], where: str) -> None:
    for key, item in value.items():
        if key not in known and item not in (None, "", [], {}):
            raise RecordInvalid(f"{where}: field {_key(key)} has no place in a trace")


def _tool_result(index: int, message: Message, turn: Turn) -> ToolResult:
    """A tool message as the result of the turn's first call with its id not answered yet
    (the n-th message answering an id matches the n-th call with it)."""
    call_id = message.get("tool_call_id")
    calls = turn.reply.tool_calls if turn.reply is not None else []
    same = [call for call in calls if call.id == call_id]
    answered = sum(1 for result in turn.tool_results if result.call_id == call_id)
    match = same[answered] if answered < len(same) else None
    name = message.get("name")
    return ToolResult(
        call_id="" if call_id is None else str(call_id),
        name=match.name if match is not None else name if isinstance(name, str) else "",
        arguments=match.arguments if match is not None else "",
        output=_text(index, message.get("content")) or "",
    )


def _size(index: int, message: Message) -> int:
    try:
        return len(json.dumps(message, ensure_ascii=False, default=repr))
    except (ValueError, RecursionError):
        raise RecordInvalid(f"message {index} cannot be serialised as JSON") from None


def _key(key: Any) -> str:
    text = repr(key)
    return text if len(text) <= 40 else f"{text[:37]}..."


# ---------------------------------------------------------------------- documents


def _from_shape(
    document: Mapping[str, Any], keys: frozenset[str], shape: str, messages: Any
) -> Trace:
    unknown = sorted(str(k) for k in document if k not in keys)
    if unknown:
        turns = " (a trace document has either 'turns' or messages, not both)"
        raise RecordInvalid(
            f"the {shape} trace has unknown keys {', '.join(_key(k) for k in unknown[:5])}"
            f"{turns if 'turns' in unknown else ''}; its keys are {', '.join(sorted(keys))}"
        )
    harness = document.get("harness", "messages")
    model = document.get("model")
    if not isinstance(harness, str) or not (model is None or isinstance(model, str)):
        raise RecordInvalid(f"the {shape} trace's harness and model must be strings")
    metadata = document.get("metadata", {})
    if not isinstance(metadata, Mapping):
        raise RecordInvalid(f"the {shape} trace's metadata is a {type(metadata).__name__}")
    trace = trace_from_messages(messages, harness=harness, model=model)
    trace.metadata = dict(metadata)
    return trace


def _as_messages(value: Any, role: str, key: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise RecordInvalid(f"the trace's {key} is a {type(value).__name__}, not text or messages")


def _check_fields(model: type[BaseModel], value: Any, where: str) -> None:
    """Refuse a key of ``value`` that ``model`` has no field for (nor a computed one),
    throughout: a key pydantic would ignore is content no judge would see."""
    if not isinstance(value, Mapping):
        return  # a type error: pydantic reports it
    if model.model_config.get("extra") is None:
        known = set(model.model_fields) | set(model.model_computed_fields)
        known |= {f.alias for f in model.model_fields.values() if f.alias}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise RecordInvalid(
                f"{where}: unknown field {_key(unknown[0])}"
                f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; "
                f"known: {sorted(model.model_fields)}"
            )
    for name, field in model.model_fields.items():
        if name in value:
            _check_annotation(field.annotation, value[name], f"{where}.{name}")


def _check_annotation(annotation: Any, value: Any, where: str) -> None:
    origin = get_origin(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        _check_fields(annotation, value, where)
    elif origin is list and isinstance(value, list):
        (item,) = get_args(annotation)
        for index, element in enumerate(value):
            _check_annotation(item, element, f"{where}[{index}]")
    elif origin is dict and isinstance(value, Mapping):
        _, item = get_args(annotation)
        for key, element in value.items():
            _check_annotation(item, element, f"{where}[{_key(key)}]")
    elif origin in (Union, types.UnionType) and isinstance(value, Mapping):
        models = [
            a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if len(models) == 1:
            _check_fields(models[0], value, where)
