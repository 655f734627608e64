"""Model table and chat client, against the scripted endpoint (a real local HTTP server)."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest

from harnesses._http import HTTPRequest, HTTPResponse, LocalHTTPServer
from harnesses.errors import (
    ModelConfigError,
    ModelConnectionError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    UnknownModelError,
)
from harnesses.llm import ChatClient, ModelEndpoint, ModelTable
from harnesses.scripted import bash_call, http_error, reply

from .conftest import ScriptedFactory

GRADER = {
    "base_url": "https://example.invalid/v1/",
    "api_key_env": "GRADER_KEY",
    "model": "judge-1",
    "sampling": {"temperature": 0, "max_tokens": 256},
}


def test_table_loads_from_yaml_json_and_dict(tmp_path: Path) -> None:
    yaml_file = tmp_path / "models.yaml"
    yaml_file.write_text(
        "models:\n"
        "  grader:\n"
        "    base_url: https://example.invalid/v1/\n"
        "    api_key_env: GRADER_KEY\n"
        "    model: judge-1\n"
        "    sampling: {temperature: 0, max_tokens: 256}\n"
    )
    json_file = tmp_path / "models.json"
    json_file.write_text(json.dumps({"models": {"grader": GRADER}}))
    from_yaml = ModelTable.from_file(yaml_file)
    assert from_yaml == ModelTable.from_file(json_file)
    assert from_yaml == ModelTable.from_dict({"models": {"grader": GRADER}})
    grader = from_yaml.resolve("grader")
    assert grader.base_url == "https://example.invalid/v1"  # trailing slash dropped
    assert grader.chat_url == "https://example.invalid/v1/chat/completions"
    assert grader.sampling == {"temperature": 0, "max_tokens": 256}


def test_policy_is_reserved_and_supplied_per_rollout() -> None:
    with pytest.raises(ModelConfigError, match="reserved"):
        ModelTable.from_dict({"models": {"policy": GRADER}})
    table = ModelTable.from_dict({"models": {"grader": GRADER}})
    policy = ModelEndpoint(base_url="http://127.0.0.1:1/v1", model="pi")
    assert table.resolve("policy", policy=policy) is policy
    with pytest.raises(UnknownModelError, match="per rollout"):
        table.resolve("policy")
    with pytest.raises(UnknownModelError, match=r"known: grader"):
        table.resolve("critic")


def test_invalid_table_names_fields_and_never_echoes_a_pasted_key(tmp_path: Path) -> None:
    pasted = "sk-live-0123456789abcdef"
    bad = dict(GRADER, api_key_env=pasted, sampling={"stream": True})
    with pytest.raises(ModelConfigError) as info:
        ModelTable.from_dict({"models": {"grader": bad}})
    message = str(info.value)
    assert "api_key_env" in message and "sampling" in message
    assert pasted not in message
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [unclosed")
    with pytest.raises(ModelConfigError, match="not valid"):
        ModelTable.from_file(broken)


def test_missing_key_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GRADER_KEY", raising=False)
    endpoint = ModelEndpoint.model_validate(GRADER)
    with pytest.raises(ModelConfigError, match="GRADER_KEY"):
        ChatClient(endpoint)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_chat_sends_key_model_sampling_and_parses_reply(
    scripted: ScriptedFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "sk-test-secret-value-123"
    monkeypatch.setenv("SCRIPTED_KEY", key)
    server = scripted([reply("hello", usage=(12, 3))], api_key=key)
    endpoint = server.endpoint(api_key_env="SCRIPTED_KEY", sampling={"temperature": 0.2})
    async with ChatClient(endpoint) as client:
        assert key not in repr(client)
        answer = await client.chat([{"role": "user", "content": "hi"}])
    assert answer.content == "hello"
    assert answer.tool_calls == []
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (12, 3)
    assert answer.usage.total_tokens == 15
    assert answer.latency > 0
    assert server.failures == []
    sent = server.requests[0]
    assert sent.api_key == key
    assert sent.body["model"] == "scripted-model"
    assert sent.body["temperature"] == 0.2


@pytest.mark.anyio
async def test_tool_calls_are_parsed(scripted: ScriptedFactory) -> None:
    server = scripted([bash_call("ls -la")])
    async with ChatClient(server.endpoint()) as client:
        answer = await client.chat([{"role": "user", "content": "list"}])
    assert answer.finish_reason == "tool_calls"
    [call] = answer.tool_calls
    assert call.name == "bash"
    assert call.parsed_arguments() == {"command": "ls -la"}
    assert answer.assistant_message()["tool_calls"][0]["function"]["name"] == "bash"


@pytest.mark.anyio
@pytest.mark.parametrize("status", [429, 500])
async def test_http_errors_pass_through_typed(scripted: ScriptedFactory, status: int) -> None:
    server = scripted([http_error(status, "slow down")])
    async with ChatClient(server.endpoint()) as client:
        with pytest.raises(ModelHTTPError) as info:
            await client.chat([{"role": "user", "content": "hi"}])
    assert info.value.status_code == status
    assert "slow down" in info.value.body
    assert len(server.requests) == 1


@pytest.mark.anyio
async def test_retryable_statuses_are_retried_then_succeed(scripted: ScriptedFactory) -> None:
    server = scripted([http_error(429), http_error(503), reply("finally")])
    async with ChatClient(server.endpoint(max_retries=2)) as client:
        answer = await client.chat([{"role": "user", "content": "hi"}])
    assert answer.content == "finally"
    assert [r.status for r in server.requests] == [429, 503, 200]


@pytest.mark.anyio
async def test_client_errors_are_not_retried(scripted: ScriptedFactory) -> None:
    server = scripted([http_error(400, "bad"), reply("never")])
    async with ChatClient(server.endpoint(max_retries=3)) as client:
        with pytest.raises(ModelHTTPError):
            await client.chat([{"role": "user", "content": "hi"}])
    assert len(server.requests) == 1


@pytest.mark.anyio
async def test_key_echoed_by_provider_is_redacted(
    scripted: ScriptedFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "sk-echoed-0123456789"
    monkeypatch.setenv("ECHO_KEY", key)
    server = scripted([http_error(401, f"Incorrect API key provided: {key}")])
    async with ChatClient(server.endpoint(api_key_env="ECHO_KEY")) as client:
        with pytest.raises(ModelHTTPError) as info:
            await client.chat([{"role": "user", "content": "hi"}])
    assert info.value.status_code == 401
    assert key not in str(info.value) and key not in info.value.body
    assert "***" in info.value.body


@pytest.mark.anyio
async def test_timeout_is_typed(scripted: ScriptedFactory) -> None:
    server = scripted([reply("late", delay=1.5)])
    async with ChatClient(server.endpoint(timeout=0.3)) as client:
        with pytest.raises(ModelTimeoutError):
            await client.chat([{"role": "user", "content": "hi"}])


@pytest.mark.anyio
async def test_unreachable_endpoint_is_a_connection_error() -> None:
    server = LocalHTTPServer(lambda r: HTTPResponse(200, b""))
    server.start()
    port = server.port
    server.stop()  # nothing listens there any more
    endpoint = ModelEndpoint(base_url=f"http://127.0.0.1:{port}/v1", model="m", max_retries=1)
    async with ChatClient(endpoint) as client:
        with pytest.raises(ModelConnectionError):
            await client.chat([{"role": "user", "content": "hi"}])


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"not json at all", "invalid JSON"),
        (b'{"object": "chat.completion"}', "no choices"),
        (b'{"choices": [{"message": {"content": 5}}]}', "content"),
        (b'{"choices": [{"message": {"tool_calls": [{"function": {}}]}}]}', "no function name"),
    ],
)
async def test_malformed_replies_are_response_errors(payload: bytes, reason: str) -> None:
    def handler(request: HTTPRequest) -> HTTPResponse:
        return HTTPResponse(200, payload, {"Content-Type": "application/json"})

    with LocalHTTPServer(handler) as server:
        endpoint = ModelEndpoint(base_url=f"http://127.0.0.1:{server.port}/v1", model="m")
        async with ChatClient(endpoint) as client:
            with pytest.raises(ModelResponseError, match=reason):
                await client.chat([{"role": "user", "content": "hi"}])


@pytest.mark.anyio
async def test_cancelling_a_chat_returns_promptly(scripted: ScriptedFactory) -> None:
    server = scripted([reply("slow", delay=2.0)])
    async with ChatClient(server.endpoint()) as client:
        with anyio.move_on_after(0.2) as scope:
            await client.chat([{"role": "user", "content": "hi"}])
    assert scope.cancelled_caught
