"""The scripted endpoint checks requests, records them and replays its script."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from harnesses.scripted import bash_call, reply

from .conftest import ScriptedFactory

USER = {"role": "user", "content": "hi"}
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
}


def post(url: str, body: Any, **headers: str) -> httpx.Response:
    return httpx.post(f"{url}/chat/completions", json=body, headers=headers, timeout=10)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"messages": [USER]}, "'model'"),
        ({"model": "other", "messages": [USER]}, "serves 'scripted-model'"),
        ({"model": "scripted-model", "messages": []}, "non-empty list"),
        ({"model": "scripted-model", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "scripted-model", "messages": [{"role": "user"}]}, "content"),
        (
            {"model": "scripted-model", "messages": [USER, {"role": "tool", "content": "x"}]},
            "tool_call_id",
        ),
        ({"model": "scripted-model", "messages": [USER], "tools": [{"type": "x"}]}, "tools[0]"),
        (
            {
                "model": "scripted-model",
                "messages": [USER],
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
            },
            "tool name",
        ),
        ({"model": "scripted-model", "messages": [USER], "stream": True}, "stream"),
    ],
)
def test_malformed_requests_get_400_and_are_recorded(
    scripted: ScriptedFactory, body: dict[str, Any], reason: str
) -> None:
    server = scripted([reply("unused")])
    response = post(server.base_url, body)
    assert response.status_code == 400
    assert reason in response.json()["error"]["message"]
    assert len(server.failures) == 1 and reason in server.failures[0]
    assert server.remaining == 1  # a rejected request consumes nothing


def test_well_formed_tool_conversation_is_accepted(scripted: ScriptedFactory) -> None:
    server = scripted([bash_call("true"), reply("done")])
    first = post(
        server.base_url, {"model": "scripted-model", "messages": [USER], "tools": [BASH_TOOL]}
    )
    assert first.status_code == 200
    message = first.json()["choices"][0]["message"]
    call_id = message["tool_calls"][0]["id"]
    follow_up = [
        USER,
        message,
        {"role": "tool", "tool_call_id": call_id, "content": "exit_code: 0"},
    ]
    second = post(
        server.base_url, {"model": "scripted-model", "messages": follow_up, "tools": [BASH_TOOL]}
    )
    assert second.status_code == 200
    assert second.json()["choices"][0]["message"]["content"] == "done"
    assert second.json()["usage"]["total_tokens"] > 0
    assert server.failures == []
    assert [r.status for r in server.requests] == [200, 200]
    assert server.requests[1].messages[-1]["tool_call_id"] == call_id


def test_exhausted_script_is_a_500_and_a_failure(scripted: ScriptedFactory) -> None:
    server = scripted([])
    response = post(server.base_url, {"model": "scripted-model", "messages": [USER]})
    assert response.status_code == 500
    assert "exhausted" in server.failures[0]


def test_api_key_is_enforced_when_given(scripted: ScriptedFactory) -> None:
    server = scripted([reply("ok")], api_key="k-123")
    body = {"model": "scripted-model", "messages": [USER]}
    assert post(server.base_url, body).status_code == 401
    assert post(server.base_url, body, Authorization="Bearer wrong").status_code == 401
    assert post(server.base_url, body, Authorization="Bearer k-123").status_code == 200
    assert len(server.failures) == 2


def test_unknown_route_is_404(scripted: ScriptedFactory) -> None:
    server = scripted([])
    assert httpx.get(server.base_url + "/models", timeout=10).status_code == 404
