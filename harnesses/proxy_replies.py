"""What the model proxy sends back: a whole chat completion re-cut as server-sent events
(:func:`sse_body`), a completion cut at the token budget (:func:`cut_at_budget`), and its
own answers: an unauthenticated call (:func:`unauthenticated`), a call refused because the
run may make no more (:func:`refused`), its model list (:func:`model_card`)."""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ._http import HTTPResponse, error_response

__all__ = [
    "BUDGET_EXCEEDED_STATUS",
    "CHARS_PER_TOKEN",
    "SSE_PIECE",
    "cut_at_budget",
    "model_card",
    "refused",
    "sse_body",
    "streamed",
    "unauthenticated",
]

BUDGET_EXCEEDED_STATUS = 429
"""The status of a call refused because the run's budget is spent or the run failed."""

CHARS_PER_TOKEN = 4
"""Characters per token where the proxy must guess (it has no tokenizer)."""


def cut_at_budget(completion: dict[str, Any], tokens: int) -> None:
    """Cut ``completion`` (a decoded chat completion, changed in place) to about ``tokens``
    tokens of content per choice (:data:`CHARS_PER_TOKEN` characters each); its tool calls,
    which a cut would leave malformed, are dropped, and ``finish_reason`` is ``length``."""
    for choice in completion.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        message = choice.get("message")
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, str):
                message["content"] = content[: max(0, tokens) * CHARS_PER_TOKEN]
            message.pop("tool_calls", None)
        choice["finish_reason"] = "length"


SSE_PIECE = 48
"""Characters of content (or of a tool call's arguments) per streamed chunk."""


def streamed(answer: HTTPResponse, *, include_usage: bool) -> HTTPResponse:
    """A successful chat completion re-cut as server-sent events; anything else (an error,
    a body that is not a completion) as it is."""
    if answer.status != 200:
        return answer
    try:
        completion = json.loads(answer.body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return answer
    if not isinstance(completion, dict) or not isinstance(completion.get("choices"), list):
        return answer
    return HTTPResponse(
        200,
        sse_body(completion, include_usage=include_usage),
        {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
    )


def sse_body(completion: dict[str, Any], *, include_usage: bool = False) -> bytes:
    """A whole chat completion as the ``chat.completion.chunk`` events a streaming provider
    would send: per choice the role, the content in pieces, each tool call (id, type and
    name first, then its arguments in pieces, by ``index``), the finish reason; then the
    usage (when asked for with ``stream_options.include_usage``) and ``[DONE]``."""
    head = {
        "id": completion.get("id") or f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion.chunk",
        "created": completion.get("created") or int(time.time()),
        "model": completion.get("model") or "",
    }
    events: list[dict[str, Any]] = []

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None) -> None:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        events.append({**head, "choices": [choice]})

    for position, choice in enumerate(completion["choices"]):
        if not isinstance(choice, dict):
            continue
        index = choice.get("index", position)
        message = choice.get("message") or {}
        chunk(index, {"role": message.get("role") or "assistant", "content": ""})
        content = message.get("content")
        if isinstance(content, str):
            for start in range(0, len(content), SSE_PIECE):
                chunk(index, {"content": content[start : start + SSE_PIECE]})
        for number, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") or {}
            opening = {
                "index": number,
                "id": call.get("id"),
                "type": call.get("type") or "function",
                "function": {"name": function.get("name"), "arguments": ""},
            }
            chunk(index, {"tool_calls": [opening]})
            arguments = function.get("arguments") or ""
            for start in range(0, len(arguments), SSE_PIECE):
                piece = {
                    "index": number,
                    "function": {"arguments": arguments[start : start + SSE_PIECE]},
                }
                chunk(index, {"tool_calls": [piece]})
        chunk(index, {}, choice.get("finish_reason") or "stop")
    if include_usage and completion.get("usage") is not None:
        events.append({**head, "choices": [], "usage": completion["usage"]})
    lines = [f"data: {json.dumps(event, separators=(',', ':'))}\n\n" for event in events]
    lines.append("data: [DONE]\n\n")
    return "".join(lines).encode("utf-8")


def unauthenticated() -> HTTPResponse:
    return error_response(
        401,
        "missing or invalid API key for the vf-sandbox model proxy",
        kind="authentication_error",
        code="invalid_api_key",
    )


def refused(reason: str, message: str) -> HTTPResponse:
    return error_response(
        BUDGET_EXCEEDED_STATUS,
        f"vf-sandbox: {message}; this run may make no more model calls",
        kind="budget_exceeded" if reason.startswith("budget_") else "run_failed",
        code=reason,
        headers={"x-should-retry": "false"},
    )


def model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "owned_by": "vf-sandbox-proxy"}
