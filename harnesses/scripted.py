"""A scripted, OpenAI-compatible chat-completions endpoint on a real local HTTP server.

Tests and the offline demo use it in place of a provider::

    script = [bash_call("echo hi > out.txt"), reply("done")]
    with ScriptedEndpoint(script) as server:
        endpoint = server.endpoint()          # a ModelEndpoint pointing at it
        ...
    assert server.failures == []

It serves ``POST /v1/chat/completions`` on 127.0.0.1 (a free port; on the server of
:mod:`harnesses._http`, with its limits; the API key, when given, checked before a body is
read; JSON parsed with the proxy's bounds), answers each request
with the next item of the script (a text reply, tool calls in OpenAI's ``tool_calls``
format with usage numbers, or a scripted HTTP error such as 429 or 500), and records
every request. Each request is checked to be well formed: ``model``, a ``messages`` list
with valid roles and tool-call links, a ``tools`` schema if present, and the API key if
the endpoint was given one. A malformed request gets a 400 with the reason and is
recorded in :attr:`ScriptedEndpoint.failures`; it does not consume a script item.

``respond=fn`` answers each request with ``fn(body)`` instead of the script (for
concurrent conversations, where a shared script's order would not be theirs). Like vLLM,
it returns token ids when the request sets ``return_token_ids`` (``prompt_token_ids`` at
the top level, ``token_ids`` in the choice) and per-token logprobs when it sets
``logprobs`` (``choices[0].logprobs.content``). Its tokenizer is a stand-in: the UTF-8
bytes of a fixed chat template (:func:`render_chat`), so a conversation's next prompt
extends the previous prompt plus completion, as a real template's does.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from runtimes.plugins import validation_lines

from ._http import HTTPRequest, HTTPResponse, LocalHTTPServer, error_response, json_response
from .errors import HarnessConfigError
from .llm import ModelEndpoint, Usage
from .proxy_requests import ProxyRequestError, parse_json_bounded

__all__ = [
    "RecordedRequest",
    "ScriptFile",
    "ScriptItem",
    "ScriptedEndpoint",
    "ScriptedError",
    "ScriptedReply",
    "ScriptedToolCall",
    "bash_call",
    "byte_tokens",
    "http_error",
    "load_script_file",
    "render_chat",
    "reply",
    "tool_calls",
    "validate_chat_request",
]

CHAT_PATH = "/v1/chat/completions"
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ScriptedToolCall(BaseModel):
    """One tool call of a scripted reply, answered in OpenAI's ``tool_calls`` format."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="the tool's name (e.g. 'bash')")
    arguments: dict[str, Any] | str = Field(
        default_factory=dict, description="a JSON object, or its JSON text"
    )
    id: str | None = Field(default=None, description="the call's id (default: generated)")


class ScriptedReply(BaseModel):
    """An assistant message: text, tool calls, or both. ``delay`` seconds before answering."""

    model_config = ConfigDict(extra="forbid")

    content: str | None = Field(default=None, description="the reply's text")
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    usage: Usage | None = Field(
        default=None, description="prompt_tokens, completion_tokens, total_tokens"
    )
    delay: float = Field(default=0.0, ge=0, description="seconds to wait before answering")
    finish_reason: str | None = Field(
        default=None, description="default: 'tool_calls' with tool calls, else 'stop'"
    )


class ScriptedError(BaseModel):
    """An HTTP error answer (e.g. 429 or 500) with an OpenAI-shaped error body."""

    model_config = ConfigDict(extra="forbid")

    status: int = Field(ge=400, le=599, description="the HTTP status (400-599)")
    message: str = Field(default="scripted error", description="the error body's message")
    headers: dict[str, str] = Field(default_factory=dict, description="response headers")


ScriptItem = ScriptedReply | ScriptedError


class ScriptFile(RootModel[dict[str, list[ScriptItem]]]):
    """A scripted-replies file (``vf-sandbox judge --scripted FILE``): a JSON object mapping
    each judge's name to the items its model answers with, in order. An item with a
    ``status`` is a :class:`ScriptedError`, any other a :class:`ScriptedReply`; unknown
    fields are refused. ``ScriptFile.model_json_schema()`` is its JSON schema."""


def load_script_file(data: bytes | str, source: str = "the script") -> dict[str, list[ScriptItem]]:
    """The scripts of a scripted-replies file (:class:`ScriptFile`), checked entry by entry.

    Args:
        data: the file's bytes or text.
        source: how errors name the file.

    Raises:
        HarnessConfigError: not JSON, not an object of lists, or an entry that is not a
            reply or an error; the message names the script and the item (``'grader'[1]``)
            and the field, with a did-you-mean for a misspelt one.
    """
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # ValueError: JSON syntax, UTF-8
        raise HarnessConfigError(f"{source} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise HarnessConfigError(
            f"{source} must be a JSON object mapping each judge's name to a list of replies, "
            f"not a {type(raw).__name__}"
        )
    scripts: dict[str, list[ScriptItem]] = {}
    for name, items in raw.items():
        if not isinstance(items, list):
            raise HarnessConfigError(
                f"{source}: the script {name!r} is a {type(items).__name__}, not a list of replies"
            )
        scripts[name] = [
            _script_item(item, f"{source}: {name!r}[{i}]") for i, item in enumerate(items)
        ]
    return scripts


def _script_item(item: Any, where: str) -> ScriptItem:
    if not isinstance(item, dict):
        raise HarnessConfigError(f"{where} is a {type(item).__name__}, not an object")
    model: type[ScriptedReply | ScriptedError] = (
        ScriptedError if "status" in item else ScriptedReply
    )
    try:
        return model.model_validate(item)
    except ValidationError as exc:
        kind = "an error (it has a status)" if model is ScriptedError else "a reply"
        problems = "; ".join(validation_lines(exc, model))
        raise HarnessConfigError(f"{where} is not {kind}: {problems}") from None


def reply(
    content: str, *, usage: tuple[int, int] | None = None, delay: float = 0.0
) -> ScriptedReply:
    """A plain text reply; ``usage`` is ``(prompt_tokens, completion_tokens)``."""
    return ScriptedReply(content=content, usage=_usage(usage), delay=delay)


def tool_calls(
    *calls: tuple[str, Mapping[str, Any]],
    content: str | None = None,
    usage: tuple[int, int] | None = None,
    delay: float = 0.0,
) -> ScriptedReply:
    """A reply calling tools: each call is ``(name, arguments)``."""
    return ScriptedReply(
        content=content,
        tool_calls=[ScriptedToolCall(name=name, arguments=dict(args)) for name, args in calls],
        usage=_usage(usage),
        delay=delay,
    )


def bash_call(
    command: str, *, usage: tuple[int, int] | None = None, delay: float = 0.0
) -> ScriptedReply:
    """A reply calling the ``bash`` tool with ``{"command": command}``."""
    return tool_calls(("bash", {"command": command}), usage=usage, delay=delay)


def http_error(status: int, message: str = "scripted error", **headers: str) -> ScriptedError:
    """An HTTP error answer."""
    return ScriptedError(status=status, message=message, headers=headers)


def _usage(pair: tuple[int, int] | None) -> Usage | None:
    if pair is None:
        return None
    prompt, completion = pair
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )


GENERATION_PROMPT = "<|assistant|>"
_END = "<|end|>"


def _message_body(message: Mapping[str, Any]) -> str:
    return json.dumps(
        {k: v for k, v in message.items() if k != "role"}, sort_keys=True, ensure_ascii=False
    )


def render_chat(messages: Sequence[Mapping[str, Any]], *, generation_prompt: bool = True) -> str:
    """The stand-in chat template: ``<|role|>{fields as JSON}<|end|>`` per message, then
    ``<|assistant|>`` when ``generation_prompt``."""
    text = "".join(f"<|{m.get('role')}|>{_message_body(m)}{_END}" for m in messages)
    return text + (GENERATION_PROMPT if generation_prompt else "")


def byte_tokens(text: str) -> list[int]:
    """The stand-in tokenizer: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def _token_logprob(token: int, position: int) -> float:
    """A deterministic, plausible logprob for a generated token."""
    return -round(((token * 31 + position * 7) % 97) / 100 + 0.01, 4)


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the endpoint saw it, and how it answered."""

    path: str
    body: Any
    api_key: str | None
    status: int
    problem: str | None = None

    @property
    def messages(self) -> list[dict[str, Any]]:
        if isinstance(self.body, dict) and isinstance(self.body.get("messages"), list):
            return list(self.body["messages"])
        return []


def validate_chat_request(body: Any, *, model: str | None = None) -> str | None:
    """Why ``body`` is not a well-formed chat-completions request, or ``None`` if it is."""
    if not isinstance(body, dict):
        return "request body must be a JSON object"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "'model' must be a non-empty string"
    if model is not None and body["model"] != model:
        return f"'model' is {body['model']!r}, this endpoint serves {model!r}"
    if body.get("stream"):
        return "'stream': true is not supported by this endpoint"
    problem = _check_messages(body.get("messages"))
    if problem is None and "tools" in body:
        problem = _check_tools(body["tools"])
    return problem


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list"
    open_calls: set[str] = set()
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            return f"{where} must be an object"
        role = message.get("role")
        if role not in _ROLES:
            return f"{where}.role {role!r} is not one of {sorted(_ROLES)}"
        content = message.get("content")
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            problem = _check_assistant_calls(calls, where)
            if problem:
                return problem
            open_calls.update(call["id"] for call in calls)
        elif not isinstance(content, str | list):
            return f"{where}.content must be a string or a list of parts"
        if role == "tool":
            call_id = message.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in open_calls:
                return f"{where}.tool_call_id {call_id!r} answers no earlier assistant tool call"
    return None


def _check_assistant_calls(calls: Any, where: str) -> str | None:
    if not isinstance(calls, list):
        return f"{where}.tool_calls must be a list"
    for index, call in enumerate(calls):
        spot = f"{where}.tool_calls[{index}]"
        if not isinstance(call, dict) or not isinstance(call.get("id"), str):
            return f"{spot} needs an 'id'"
        function = call.get("function")
        if call.get("type") != "function" or not isinstance(function, dict):
            return f"{spot} must be {{'type': 'function', 'function': {{...}}}}"
        if not isinstance(function.get("name"), str) or not isinstance(
            function.get("arguments"), str
        ):
            return f"{spot}.function needs a string 'name' and string 'arguments'"
    return None


def _check_tools(tools: Any) -> str | None:
    if not isinstance(tools, list):
        return "'tools' must be a list"
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            return f"{where} must have type 'function'"
        function = tool.get("function")
        if not isinstance(function, dict):
            return f"{where}.function must be an object"
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            return f"{where}.function.name {name!r} is not a valid tool name"
        params = function.get("parameters", {"type": "object"})
        if not isinstance(params, dict) or params.get("type") != "object":
            return f"{where}.function.parameters must be a JSON schema of type 'object'"
    return None


class ScriptedEndpoint:
    """A local chat-completions server replaying ``script``. See the module doc."""

    def __init__(
        self,
        script: Iterable[ScriptItem] = (),
        *,
        model: str = "scripted-model",
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        respond: Callable[[dict[str, Any]], ScriptItem] | None = None,
    ):
        self.model = model
        self._api_key = api_key
        self._respond = respond
        self._script = list(script)
        self._position = 0
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.requests: list[RecordedRequest] = []
        self.failures: list[str] = []
        self._server = LocalHTTPServer(
            self._handle, host=host, port=port, admit=self._admit if api_key is not None else None
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Start serving. Raises ``OSError`` if the address cannot be bound."""
        self._server.start()
        return self

    def stop(self) -> None:
        """Stop serving. Idempotent."""
        self._server.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://{self._server.host}:{self._server.port}/v1"

    @property
    def port(self) -> int:
        return self._server.port

    def endpoint(self, **overrides: Any) -> ModelEndpoint:
        """A :class:`ModelEndpoint` for this server (no retries unless overridden)."""
        fields: dict[str, Any] = {
            "base_url": self.base_url,
            "model": self.model,
            "max_retries": 0,
            "timeout": 30.0,
        }
        fields.update(overrides)
        return ModelEndpoint(**fields)

    def extend(self, items: Sequence[ScriptItem]) -> None:
        """Append items to the script."""
        with self._lock:
            self._script.extend(items)

    @property
    def remaining(self) -> int:
        with self._lock:
            return len(self._script) - self._position

    # ------------------------------------------------------------------ serving

    def _admit(self, head: HTTPRequest) -> HTTPResponse | None:
        """With an API key: a request without it is refused before its body is read."""
        token = head.bearer_token()
        if token == self._api_key:
            return None
        return self._reject(head, None, token, 401, "missing or wrong API key")

    def _handle(self, request: HTTPRequest) -> HTTPResponse:
        token = request.bearer_token()
        if request.method != "POST" or request.path.rstrip("/") != CHAT_PATH:
            return self._reject(
                request, None, token, 404, f"no route {request.method} {request.path}"
            )
        try:
            body = parse_json_bounded(request.body)
        except ProxyRequestError as exc:
            return self._reject(request, None, token, exc.status, str(exc))
        problem = validate_chat_request(body, model=self.model)
        if problem is not None:
            return self._reject(request, body, token, 400, problem)
        try:
            item = self._respond(body) if self._respond is not None else self._next_item()
        except Exception as exc:  # noqa: BLE001 - a broken responder is a failure, answered 500
            return self._reject(request, body, token, 500, f"respond() raised {exc!r}")
        if item is None:
            return self._reject(
                request, body, token, 500, f"script exhausted after {len(self._script)} replies"
            )
        if isinstance(item, ScriptedError):
            self._record(request, body, token, item.status)
            return error_response(
                item.status, item.message, kind="scripted_error", headers=item.headers
            )
        if item.delay:
            time.sleep(item.delay)
        self._record(request, body, token, 200)
        return json_response(200, self._completion(item, body))

    def _next_item(self) -> ScriptItem | None:
        with self._lock:
            if self._position >= len(self._script):
                return None
            item = self._script[self._position]
            self._position += 1
            return item

    def _reject(
        self, request: HTTPRequest, body: Any, token: str | None, status: int, reason: str
    ) -> HTTPResponse:
        with self._lock:
            self.failures.append(reason)
        self._record(request, body, token, status, reason)
        return error_response(status, reason)

    def _record(
        self,
        request: HTTPRequest,
        body: Any,
        token: str | None,
        status: int,
        problem: str | None = None,
    ) -> None:
        with self._lock:
            self.requests.append(RecordedRequest(request.path, body, token, status, problem))

    def _completion(self, item: ScriptedReply, body: dict[str, Any]) -> dict[str, Any]:
        number = next(self._ids)
        calls = [
            {
                "id": call.id or f"call_{number}_{index}",
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.arguments
                    if isinstance(call.arguments, str)
                    else json.dumps(call.arguments),
                },
            }
            for index, call in enumerate(item.tool_calls)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": item.content}
        if calls:
            message["tool_calls"] = calls
        usage = item.usage or _estimated_usage(body["messages"], item.content, calls)
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": item.finish_reason or ("tool_calls" if calls else "stop"),
        }
        answer: dict[str, Any] = {
            "id": f"chatcmpl-scripted-{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": usage.model_dump(),
        }
        generated = byte_tokens(_message_body(message) + _END)
        if body.get("return_token_ids"):
            answer["prompt_token_ids"] = byte_tokens(render_chat(body["messages"]))
            choice["token_ids"] = generated
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": f"token_id:{token}",
                        "logprob": _token_logprob(token, position),
                        "bytes": [token],
                        "top_logprobs": [],
                    }
                    for position, token in enumerate(generated)
                ]
            }
        return answer


def _estimated_usage(messages: list[Any], content: str | None, calls: list[Any]) -> Usage:
    """A deterministic stand-in for token counts: four characters per token."""
    prompt = max(1, len(json.dumps(messages)) // 4)
    completion = max(1, (len(content or "") + len(json.dumps(calls) if calls else "")) // 4)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
    )
