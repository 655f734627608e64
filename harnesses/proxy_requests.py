"""What the model proxy accepts from a sandbox, and what it passes on.

Everything here runs on bytes an agent inside a sandbox sent, so nothing is trusted:

* :func:`parse_json_bounded` refuses a body whose JSON would allocate without bound (more
  than :data:`MAX_JSON_CONTAINERS` objects and arrays, or nesting deeper than
  :data:`MAX_JSON_DEPTH`) *before* parsing it, by scanning the bytes;
* :func:`validate_request` reads the parsed body into typed models (:class:`ChatRequest`:
  roles from a closed set, content a string or a list of parts, ``tool_calls`` a list of
  well-formed calls, tools of type ``function``); anything else is a
  :class:`ProxyRequestError` (a ``400``), never an error further on;
* :func:`select_params` applies the sampling allowlist of the run's mode
  (:data:`GATED_PARAMS`, :data:`FORWARDED_PARAMS`): the rest is dropped and named;
* :func:`recorded_messages` is the bounded copy of the messages a turn keeps on its trace.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import HarnessError
from .llm import Message

__all__ = [
    "FORWARDED_PARAMS",
    "GATED_PARAMS",
    "MAX_JSON_CONTAINERS",
    "MAX_JSON_DEPTH",
    "MAX_REJECTIONS_KEPT",
    "ROLES",
    "ChatMessage",
    "ChatRequest",
    "ProxyRequestError",
    "RejectedRequest",
    "parse_json_bounded",
    "recorded_messages",
    "select_params",
    "validate_request",
]

MAX_JSON_CONTAINERS = 100_000
"""Objects plus arrays one request body may hold (a long agent conversation has thousands)."""
MAX_JSON_DEPTH = 64
"""How deep a request body's objects and arrays may nest."""

ROLES = ("system", "developer", "user", "assistant", "tool")
Role = Literal["system", "developer", "user", "assistant", "tool"]

# Fields of the request the proxy itself handles; every other top-level field is a
# parameter, kept only when the mode's allowlist names it.
_OWN_FIELDS = frozenset({"model", "messages", "tools", "stream", "stream_options"})

GATED_PARAMS = frozenset({"tool_choice", "parallel_tool_calls", "stop"})
"""What a harness may ask for in a gated run: how its tools may be called and where a reply
stops. The trainer samples; temperature, lengths, penalties, seeds, ``n`` and every
engine-specific flag are its own, so a sandbox's are dropped."""

FORWARDED_PARAMS = frozenset(
    {
        "temperature",
        "top_p",
        "presence_penalty",
        "frequency_penalty",
        "stop",
        "max_tokens",
        "max_completion_tokens",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "reasoning_effort",
    }
)
"""What a harness may ask for in a forwarding run, under the model table's ``sampling``
(which wins where it sets the same field). ``max_tokens``/``max_completion_tokens`` are
clamped to what the budget has left; ``n`` and ``best_of`` are dropped (so 1); everything
else (``logit_bias``, ``seed``, ``logprobs``, ``ignore_eos``, ``guided_*``, ``store``,
``metadata``, ``user``, ...) is dropped."""

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


class ProxyRequestError(HarnessError):
    """A request the proxy refuses; ``status`` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str, *, code: str = "invalid_request"):
        super().__init__(message)
        self.status = status
        self.code = code


def parse_json_bounded(
    body: bytes, *, max_containers: int = MAX_JSON_CONTAINERS, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """``body`` decoded as JSON, refused first if it holds more than ``max_containers``
    objects/arrays or nests deeper than ``max_depth`` (a scan of the bytes, strings
    skipped, so the parse never builds what it would refuse).

    Raises:
        ProxyRequestError: (400) not UTF-8 JSON, or past a bound.
    """
    skeleton = _STRING.sub(b"", body)
    containers = skeleton.count(b"{") + skeleton.count(b"[")
    if containers > max_containers:
        raise ProxyRequestError(
            400, f"request body has over {max_containers} JSON objects/arrays", code="too_complex"
        )
    depth = 0
    for match in _BRACKETS.finditer(skeleton):
        depth += 1 if match.group() in (b"{", b"[") else -1
        if depth > max_depth:
            raise ProxyRequestError(
                400, f"request body nests deeper than {max_depth}", code="too_complex"
            )
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: JSON syntax, or an integer past Python's digit limit.
        raise ProxyRequestError(400, f"request body is not JSON: {exc}") from None


# ---------------------------------------------------------------------- typed requests

_OPEN = ConfigDict(extra="allow", strict=True)


class ContentPart(BaseModel):
    """One part of a message's content (``{"type": "text", "text": ...}``, an image, ...)."""

    model_config = _OPEN
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _OPEN
    name: str
    arguments: str


class RequestToolCall(BaseModel):
    """A tool call in an assistant message of the request."""

    model_config = _OPEN
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message of a request: a role from :data:`ROLES`; content a string, a list of
    parts, or (an assistant's) nothing; ``tool_calls`` only on an assistant message; a
    tool message answers a ``tool_call_id``."""

    model_config = _OPEN
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[RequestToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"a {self.role} message cannot carry tool_calls")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs a tool_call_id")
        return self


class FunctionSpec(BaseModel):
    model_config = _OPEN
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = _OPEN
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(BaseModel):
    model_config = _OPEN
    include_usage: bool = False


class ChatRequest(BaseModel):
    """A chat-completions request as the proxy accepts it. Other top-level fields are kept
    as extras for :func:`select_params` to judge."""

    model_config = _OPEN
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def params(self) -> dict[str, Any]:
        """Every top-level field that is not the proxy's own (model, messages, tools,
        stream, stream_options)."""
        return {k: v for k, v in (self.model_extra or {}).items() if k not in _OWN_FIELDS}


def validate_request(data: Any) -> ChatRequest:
    """``data`` (a decoded body) as a :class:`ChatRequest`.

    Raises:
        ProxyRequestError: (400) the request is malformed; the message names each problem.
    """
    if not isinstance(data, dict):
        raise ProxyRequestError(400, "request body must be a JSON object")
    try:
        return ChatRequest.model_validate(data)
    except ValidationError as exc:
        raise ProxyRequestError(400, f"malformed request: {_problems(exc)}") from None


class _Stop(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    stop: str | list[str] | None = Field(default=None)

    @model_validator(mode="after")
    def _bounded(self) -> _Stop:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 8 or any(len(s) > 256 for s in stops):
            raise ValueError("stop: at most 8 sequences of at most 256 characters")
        return self


class _Params(_Stop):
    """The allowlisted parameters, typed (a wrong type is a malformed request)."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = Field(default=None, max_length=32)


def select_params(
    request: ChatRequest, mode: Literal["gated", "forwarding"]
) -> tuple[dict[str, Any], list[str]]:
    """The request's parameters the mode allows (typed), and the names of those dropped.

    Raises:
        ProxyRequestError: (400) an allowed parameter has a wrong type or value.
    """
    allowed = GATED_PARAMS if mode == "gated" else FORWARDED_PARAMS
    params = request.params()
    kept = {k: v for k, v in params.items() if k in allowed}
    dropped = sorted(k for k in params if k not in allowed)
    try:
        _Params.model_validate(kept)
    except ValidationError as exc:
        raise ProxyRequestError(400, f"malformed request: {_problems(exc)}") from None
    return {k: v for k, v in kept.items() if v is not None}, dropped


def _problems(exc: ValidationError) -> str:
    lines = [
        f"{'.'.join(str(p) for p in e['loc']) or '(body)'}: {e['msg']}"
        for e in exc.errors(include_url=False, include_input=False)[:10]
    ]
    return "; ".join(lines)


class RejectedRequest(BaseModel):
    """A request the proxy refused as malformed (a :class:`ProxyRequestError`), as kept on
    the run (:attr:`ProxyRun.rejections`) and on its trace (``metadata["proxy_rejected"]``)."""

    status: int
    code: str
    message: str
    error_type: str = "ProxyRequestError"
    at: _dt.datetime = Field(default_factory=lambda: _dt.datetime.now(_dt.UTC))


MAX_REJECTIONS_KEPT = 20
"""Malformed requests a run keeps in full (the rest are only counted)."""


# ---------------------------------------------------------------------- what a turn keeps


def recorded_messages(messages: list[Message], max_chars: int) -> tuple[list[Message], int]:
    """The copy of ``messages`` a turn keeps, at most about ``max_chars`` characters of
    JSON: the newest messages whole while they fit, older ones cut down (their content
    shortened to what is left, with a marker saying how much is not recorded; other
    fields dropped). Every message stays, so a message's index means the same. Returns the
    copy and how many characters were not recorded (0: it is whole)."""
    left = max_chars
    kept: list[Message] = []
    cut = 0
    for message in reversed(messages):
        size = len(json.dumps(message, ensure_ascii=False))
        if size <= left:
            kept.append(message)
            left -= size
            continue
        text = _text_of(message)
        room = max(0, left - 200)
        marker = f"[vf-sandbox: {len(text) - room} characters of this message not recorded]"
        shrunk: Message = {"role": message.get("role"), "content": text[:room] + marker}
        kept.append(shrunk)
        cut += size - room
        left = max(0, left - room - len(marker))
    kept.reverse()
    return kept, cut


def _text_of(message: Message) -> str:
    content = message.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    else:
        text = ""
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            text += f"\n[tool call {function.get('name')}] {function.get('arguments')}"
    return text
