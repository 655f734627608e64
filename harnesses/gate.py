"""The gate of the interception proxy's gated mode: model calls parked for a caller to answer.

In gated mode (:meth:`~harnesses.proxy.ModelProxy.open_gated_run`) the proxy does not
forward a harness's chat-completion request upstream. It parks it in a
:class:`RequestGate`, which hands it to the caller as an :class:`InterceptedRequest`; the
caller (an RL trainer generating with its own model) answers with a :class:`Completion`
and the proxy replies to the harness with an OpenAI-shaped chat completion built from it.

Threads: the proxy runs each request's handler on a worker thread, so :meth:`RequestGate.park`
blocks that thread until the completion arrives, the delivery timeout passes or the gate is
closed. The gate is created inside an event loop (asyncio or trio, through anyio) and
calls its :class:`GateListener` back in that loop's thread; :meth:`RequestGate.deliver`
and :meth:`RequestGate.close` are called from that loop and never block.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import anyio
import anyio.from_thread
import anyio.lowlevel
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ._http import HTTPResponse, error_response, json_response
from .errors import SessionDeliveryTimeout, SessionProtocolError
from .llm import ChatReply, Message, ToolCall, Usage

__all__ = [
    "REQUEST_KEYS",
    "Completion",
    "GateListener",
    "GateOutcome",
    "InterceptedRequest",
    "RequestGate",
    "call",
    "estimate_usage",
]

_REQUEST_FIELDS = frozenset({"model", "messages", "tools", "stream"})

RequestState = Literal["parked", "delivered", "expired", "closed"]


REQUEST_KEYS = ("request_id", "turn", "model", "messages", "tools", "params")
"""The keys of an :class:`InterceptedRequest` read as a mapping (``req["messages"]``)."""


class InterceptedRequest(BaseModel, Mapping[str, Any]):
    """One model call of the harness, as it sent it, parked until the caller answers.

    ``messages`` and ``tools`` are the request's own (a copy: changing them changes nothing
    the harness or the trace holds); ``params`` is what else of the request the proxy lets
    a harness ask for in a gated run (:data:`~harnesses.proxy_requests.GATED_PARAMS`:
    ``tool_choice``, ``parallel_tool_calls``, ``stop``). The sampling is the trainer's: the
    request's ``temperature``, ``max_tokens``, ``n``, ``seed``, ``logit_bias``, engine flags
    ... never get here (the proxy drops them and names them on the turn).

    It is also a read-only mapping, for code written against the dict-shaped contract
    (``next_request() -> dict``): ``req["messages"]``, ``req["tools"]``,
    ``req["request_id"]``, ``"messages" in req``, ``req.get(...)``, ``dict(req)`` over
    :data:`REQUEST_KEYS` (JSON-ready: ``received_at`` is an attribute only).
    """

    model_config = ConfigDict(frozen=True)

    request_id: str
    turn: int
    model: str | None = None
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    received_at: _dt.datetime

    def __getitem__(self, key: str) -> Any:
        if key not in REQUEST_KEYS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]
        """The mapping's keys (a pydantic model would yield ``(field, value)`` pairs)."""
        return iter(REQUEST_KEYS)

    def __len__(self) -> int:
        return len(REQUEST_KEYS)


class Completion(BaseModel):
    """What the caller answers a model call with: text and/or tool calls.

    ``tool_calls`` items may be :class:`~harnesses.llm.ToolCall`s, ``{"name",
    "arguments", "id"?}`` dicts or OpenAI's ``{"id", "type": "function", "function":
    {"name", "arguments"}}``; ``arguments`` may be a dict (serialised) or the raw text the
    model produced (passed through as is, even when it is not valid JSON: the harness
    answers that as a tool error, which is what a policy should learn from). A missing
    id is generated. ``usage`` is the real token counts if the caller has them (otherwise
    they are estimated); ``metadata`` (token ids, logprobs, ...) is carried opaquely into
    the rollout record and never sent to the harness.
    """

    model_config = ConfigDict(extra="forbid")

    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    usage: Usage | None = None
    finish_reason: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _normalise_calls(cls, value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return [_tool_call(item) for item in value]

    @model_validator(mode="after")
    def _needs_something(self) -> Completion:
        if self.content is None and not self.tool_calls:
            raise ValueError("a completion needs content or tool calls")
        return self

    @classmethod
    def coerce(cls, value: Completion | str | Mapping[str, Any]) -> Completion:
        """A completion from itself, a text, or a dict of its fields.

        Raises:
            SessionProtocolError: the value is not a valid completion (the message says why).
        """
        if isinstance(value, Completion):
            return value
        if isinstance(value, str):
            return cls(content=value)
        try:
            return cls.model_validate(value)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(completion)'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )
            raise SessionProtocolError(f"invalid completion: {problems}") from None

    def assistant_message(self) -> Message:
        """The assistant message the harness appends to its conversation for this
        completion (the same shape as :meth:`~harnesses.llm.ChatReply.assistant_message`)."""
        return ChatReply(content=self.content, tool_calls=self.tool_calls).assistant_message()

    def resolved_finish_reason(self) -> str:
        return self.finish_reason or ("tool_calls" if self.tool_calls else "stop")


def call(name: str, arguments: Mapping[str, Any] | str, *, call_id: str | None = None) -> ToolCall:
    """A tool call for a :class:`Completion`: ``call("bash", {"command": "ls"})``.

    ``arguments`` is serialised when it is a mapping, kept as is when it is text (even
    text that is not valid JSON); ``call_id`` is generated when not given.
    """
    text = json.dumps(dict(arguments)) if isinstance(arguments, Mapping) else arguments
    return ToolCall(id=call_id or f"call_{secrets.token_hex(8)}", name=name, arguments=text)


def _tool_call(item: Any) -> Any:
    if isinstance(item, ToolCall) or not isinstance(item, Mapping):
        return item
    function = item.get("function")
    source = function if isinstance(function, Mapping) else item
    arguments = source.get("arguments", "{}")
    if isinstance(arguments, Mapping):
        arguments = json.dumps(arguments)
    return {
        "id": item.get("id") or f"call_{secrets.token_hex(8)}",
        "name": source.get("name"),
        "arguments": arguments,
    }


def estimate_usage(messages: list[Message], completion: Completion) -> Usage:
    """Token counts at four characters per token: a stand-in when the caller gives none."""
    prompt = max(1, len(json.dumps(messages)) // 4)
    calls = [c.model_dump() for c in completion.tool_calls]
    completion_chars = len(completion.content or "") + (len(json.dumps(calls)) if calls else 0)
    generated = max(1, completion_chars // 4)
    return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


def resolved_usage(request: InterceptedRequest, completion: Completion) -> tuple[Usage, bool]:
    """The usage to report for ``completion``, and whether it was estimated."""
    if completion.usage is None:
        return estimate_usage(request.messages, completion), True
    usage = completion.usage.model_copy()
    if not usage.total_tokens:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return usage, False


class GateListener(Protocol):
    """Who the gate hands requests to. Both methods run in the gate's event-loop thread and
    must not block."""

    def request_parked(self, request: InterceptedRequest) -> None:
        """A model call arrived and waits for :meth:`RequestGate.deliver`."""

    def request_expired(self, request: InterceptedRequest, timeout: float) -> None:
        """A parked call got no completion within ``timeout`` seconds; the harness is being
        answered with an error."""


@dataclass
class GateOutcome:
    """How one parked request ended, for the proxy to record on its trace and send."""

    response: HTTPResponse
    state: RequestState
    latency: float
    reply: ChatReply | None = None
    error: str | None = None


@dataclass
class _Parked:
    request: InterceptedRequest
    state: RequestState = "parked"
    completion: Completion | None = None
    done: threading.Event = field(default_factory=threading.Event)


class RequestGate:
    """Parks model calls until the caller delivers completions. See the module doc.

    Create it inside the event loop the caller runs (it captures that loop);
    ``delivery_timeout`` is how long a parked call waits for its completion.
    """

    def __init__(self, listener: GateListener, *, delivery_timeout: float):
        """Capture the running event loop.

        Raises:
            ValueError: ``delivery_timeout`` is not positive.
            RuntimeError: no event loop runs in this thread.
        """
        if delivery_timeout <= 0:
            raise ValueError("delivery_timeout must be > 0")
        self.delivery_timeout = delivery_timeout
        self._listener = listener
        self._token = anyio.lowlevel.current_token()
        self._lock = threading.Lock()
        self._parked: dict[str, _Parked] = {}
        self._states: dict[str, RequestState] = {}
        self._closed: str | None = None

    @property
    def closed(self) -> bool:
        return self._closed is not None

    def pending(self) -> list[InterceptedRequest]:
        """The requests parked right now, oldest first."""
        with self._lock:
            return [p.request for p in self._parked.values()]

    # ------------------------------------------------------------------ proxy threads

    def park(self, body: dict[str, Any], turn: int) -> GateOutcome:
        """Park one chat-completion request (called on a proxy thread; blocks it).

        Returns the HTTP answer for the harness: the delivered completion (200), a 504 when
        the delivery timeout passed, a 503 when the gate is closed or nobody listens.
        """
        started = time.monotonic()
        parked = _Parked(_intercepted(body, turn))
        request_id = parked.request.request_id
        with self._lock:
            if self._closed is not None:
                return _refusal(started, "closed", 503, f"the session is over: {self._closed}")
            self._parked[request_id] = parked
            self._states[request_id] = "parked"
        if not self._notify(self._listener.request_parked, parked.request):
            self._finish(parked, "closed")
            return _refusal(started, "closed", 503, "the session no longer listens")
        parked.done.wait(self.delivery_timeout)
        with self._lock:
            if parked.state == "parked":
                self._finish_locked(parked, "expired")
        if parked.state == "delivered":
            assert parked.completion is not None
            return _delivered(parked.request, parked.completion, started)
        if parked.state == "expired":
            self._notify(self._listener.request_expired, parked.request, self.delivery_timeout)
            message = (
                f"no completion was delivered within {self.delivery_timeout}s "
                f"for request {request_id}"
            )
            return _refusal(started, "expired", 504, message, kind="gate_timeout")
        return _refusal(started, "closed", 503, f"the session is over: {self._closed}")

    def _notify(self, callback: Any, *args: Any) -> bool:
        """Run a listener callback in the gate's event loop; whether it ran."""
        try:
            anyio.from_thread.run_sync(callback, *args, token=self._token)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, RuntimeError):
            # The loop is gone or the session stopped listening: the caller answers 503.
            return False
        return True

    # ------------------------------------------------------------------ the event loop

    def deliver(self, request_id: str, completion: Completion) -> InterceptedRequest:
        """Answer a parked request; the harness gets the completion. Never blocks.

        Raises:
            SessionDeliveryTimeout: the request waited longer than the delivery timeout
                and was already answered with an error.
            SessionProtocolError: no such request, or it was already answered (delivered,
                or refused because the gate closed).
        """
        with self._lock:
            parked = self._parked.get(request_id)
            if parked is None:
                raise self._undeliverable(request_id)
            parked.completion = completion
            self._finish_locked(parked, "delivered")
        return parked.request

    def _undeliverable(self, request_id: str) -> Exception:
        state = self._states.get(request_id)
        if state == "expired":
            return SessionDeliveryTimeout(
                f"request {request_id} was not answered within {self.delivery_timeout}s; "
                f"the agent got an error instead"
            )
        if state is None:
            return SessionProtocolError(f"no request {request_id} was intercepted here")
        return SessionProtocolError(f"request {request_id} was already answered ({state})")

    def close(self, reason: str = "closed") -> None:
        """Refuse new requests and answer every parked one with a 503. Idempotent."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            for parked in list(self._parked.values()):
                self._finish_locked(parked, "closed")

    def _finish(self, parked: _Parked, state: RequestState) -> None:
        with self._lock:
            self._finish_locked(parked, state)

    def _finish_locked(self, parked: _Parked, state: RequestState) -> None:
        parked.state = state
        self._states[parked.request.request_id] = state
        self._parked.pop(parked.request.request_id, None)
        parked.done.set()


def _intercepted(body: dict[str, Any], turn: int) -> InterceptedRequest:
    model = body.get("model")
    tools = body.get("tools")
    return InterceptedRequest(
        request_id=f"req-{secrets.token_hex(8)}",
        turn=turn,
        model=model if isinstance(model, str) else None,
        messages=copy.deepcopy(body["messages"]),
        tools=copy.deepcopy(tools) if isinstance(tools, list) else None,
        params={k: copy.deepcopy(v) for k, v in body.items() if k not in _REQUEST_FIELDS},
        received_at=_dt.datetime.now(_dt.UTC),
    )


def _delivered(request: InterceptedRequest, completion: Completion, started: float) -> GateOutcome:
    latency = time.monotonic() - started
    usage, _ = resolved_usage(request, completion)
    message = completion.assistant_message()
    model = request.model or "gated"
    payload = {
        "id": f"chatcmpl-{request.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": completion.resolved_finish_reason()}
        ],
        "usage": usage.model_dump(),
    }
    reply = ChatReply(
        content=completion.content,
        tool_calls=completion.tool_calls,
        usage=usage,
        latency=latency,
        finish_reason=completion.resolved_finish_reason(),
        model=model,
    )
    return GateOutcome(json_response(200, payload), "delivered", latency, reply=reply)


def _refusal(
    started: float,
    state: RequestState,
    status: int,
    message: str,
    *,
    kind: str = "session_closed",
) -> GateOutcome:
    response = error_response(status, message, kind=kind, headers={"x-should-retry": "false"})
    return GateOutcome(response, state, time.monotonic() - started, error=message)
