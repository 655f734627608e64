"""The interception proxy: secrets, turn recording, budgets, status pass-through, routing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harnesses.base import Budget, Trace
from harnesses.errors import ModelHTTPError, ProxyRouteError
from harnesses.llm import ChatClient, ModelEndpoint
from harnesses.proxy import ModelProxy, route_to_host
from harnesses.scripted import bash_call, http_error, reply
from runtimes import open_runtime
from runtimes.docker import gateway_from_route_table

from .conftest import ScriptedFactory

UPSTREAM_KEY = "sk-upstream-0123456789"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture
def proxy() -> Iterator[ModelProxy]:
    with ModelProxy() as running:
        yield running


def agent_post(proxy: ModelProxy, body: dict[str, Any], key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{proxy.base_url}/chat/completions", json=body, headers=headers, timeout=30)


def upstream_endpoint(server: Any, **fields: Any) -> ModelEndpoint:
    return server.endpoint(api_key_env="VF_TEST_UPSTREAM_KEY", **fields)  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VF_TEST_UPSTREAM_KEY", UPSTREAM_KEY)


def test_secret_is_enforced(scripted: ScriptedFactory, proxy: ModelProxy) -> None:
    server = scripted([reply("ok")], api_key=UPSTREAM_KEY)
    trace = Trace(harness="test")
    run = proxy.open_run(upstream_endpoint(server), trace)
    body = {"model": "anything", "messages": USER}
    assert agent_post(proxy, body, None).status_code == 401
    assert agent_post(proxy, body, "wrong-secret").status_code == 401
    assert agent_post(proxy, body, UPSTREAM_KEY).status_code == 401  # the real key is no secret
    assert server.requests == [] and trace.turns == []
    assert agent_post(proxy, body, run.secret).status_code == 200
    run.close()
    assert agent_post(proxy, body, run.secret).status_code == 401
    assert len(server.requests) == 1


@pytest.mark.anyio
async def test_turns_are_recorded_and_requests_rewritten(
    scripted: ScriptedFactory, proxy: ModelProxy
) -> None:
    server = scripted(
        [bash_call("ls", usage=(20, 5)), reply("done", usage=(30, 2))], api_key=UPSTREAM_KEY
    )
    trace = Trace(harness="test")
    run = proxy.open_run(
        upstream_endpoint(server, sampling={"temperature": 0.1, "top_p": 0.5}), trace
    )
    # the sandboxed agent: an OpenAI client that knows only the proxy URL and the secret
    agent_side = ModelEndpoint(
        base_url=proxy.base_url,
        model="placeholder",
        max_retries=0,
        sampling={"top_p": 0.9, "presence_penalty": 0.5},
    )
    async with ChatClient(agent_side, api_key=run.secret) as agent:
        first = await agent.chat(USER, tools=[{"type": "function", "function": {"name": "bash"}}])
        followup = [*USER, first.assistant_message()]
        followup.append({"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "a b"})
        second = await agent.chat(followup)
    assert second.content == "done"
    assert server.failures == []
    # upstream saw its own model name and key, the endpoint's sampling (it wins over the
    # agent's), and what the agent may add where the endpoint sets nothing
    for seen in server.requests:
        assert seen.api_key == UPSTREAM_KEY
        assert seen.body["model"] == "scripted-model"
        assert seen.body["temperature"] == 0.1 and seen.body["top_p"] == 0.5
        assert seen.body["presence_penalty"] == 0.5
    assert [t.index for t in trace.turns] == [0, 1]
    assert trace.turns[0].request_messages == USER
    assert trace.turns[1].request_messages == followup
    assert trace.turns[0].reply is not None and trace.turns[0].reply.tool_calls[0].name == "bash"
    assert trace.turns[1].reply is not None and trace.turns[1].reply.content == "done"
    assert [t.status_code for t in trace.turns] == [200, 200]
    assert trace.usage.total_tokens == 57
    assert all(t.latency > 0 for t in trace.turns)
    assert json.loads(trace.model_dump_json())["usage"]["total_tokens"] == 57


def test_turn_budget_is_checked_before_each_turn(
    scripted: ScriptedFactory, proxy: ModelProxy
) -> None:
    server = scripted([reply("1"), reply("2"), reply("3")], api_key=UPSTREAM_KEY)
    trace = Trace(harness="test")
    run = proxy.open_run(upstream_endpoint(server), trace, Budget(max_turns=2))
    body = {"model": "m", "messages": USER}
    assert [agent_post(proxy, body, run.secret).status_code for _ in range(2)] == [200, 200]
    refused = agent_post(proxy, body, run.secret)
    assert refused.status_code == 429
    assert refused.headers["x-should-retry"] == "false"
    error = refused.json()["error"]
    assert error["type"] == "budget_exceeded" and error["code"] == "budget_turns"
    assert "turn budget of 2" in error["message"]
    assert trace.error is not None and trace.error.kind == "budget_turns"
    assert len(server.requests) == 2 and len(trace.turns) == 2
    assert agent_post(proxy, body, run.secret).status_code == 429  # stays over budget


def test_token_budget_is_checked(scripted: ScriptedFactory, proxy: ModelProxy) -> None:
    server = scripted([reply("a", usage=(90, 20)), reply("b")], api_key=UPSTREAM_KEY)
    trace = Trace(harness="test")
    run = proxy.open_run(upstream_endpoint(server), trace, Budget(max_tokens=100))
    body = {"model": "m", "messages": USER}
    assert agent_post(proxy, body, run.secret).status_code == 200
    refused = agent_post(proxy, body, run.secret)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "budget_tokens"
    assert trace.error is not None and trace.error.kind == "budget_tokens"


@pytest.mark.parametrize("status", [400, 429, 500, 503])
def test_upstream_status_and_body_pass_through(
    scripted: ScriptedFactory, proxy: ModelProxy, status: int
) -> None:
    server = scripted([http_error(status, f"provider says {status}")], api_key=UPSTREAM_KEY)
    trace = Trace(harness="test")
    run = proxy.open_run(upstream_endpoint(server), trace)
    answer = agent_post(proxy, {"model": "m", "messages": USER}, run.secret)
    assert answer.status_code == status
    assert answer.json()["error"]["message"] == f"provider says {status}"
    assert trace.turns[0].status_code == status
    assert trace.turns[0].reply is None and f"provider says {status}" in (
        trace.turns[0].error or ""
    )
    assert trace.error is None  # the agent decides what an upstream error means


@pytest.mark.anyio
async def test_agent_client_sees_typed_errors_through_the_proxy(
    scripted: ScriptedFactory, proxy: ModelProxy
) -> None:
    server = scripted([http_error(429, "rate limited")], api_key=UPSTREAM_KEY)
    run = proxy.open_run(upstream_endpoint(server), Trace(harness="test"))
    agent_side = ModelEndpoint(base_url=proxy.base_url, model="x", max_retries=0)
    async with ChatClient(agent_side, api_key=run.secret) as agent:
        with pytest.raises(ModelHTTPError) as info:
            await agent.chat(USER)
    assert info.value.status_code == 429 and "rate limited" in info.value.body


def test_unreachable_upstream_is_502(proxy: ModelProxy) -> None:
    with ModelProxy() as dead:
        port = dead.port
    trace = Trace(harness="test")
    run = proxy.open_run(ModelEndpoint(base_url=f"http://127.0.0.1:{port}/v1", model="m"), trace)
    answer = agent_post(proxy, {"model": "m", "messages": USER}, run.secret)
    assert answer.status_code == 502
    assert trace.turns[0].status_code == 502


def test_malformed_requests_are_refused_and_streaming_is_answered(
    scripted: ScriptedFactory, proxy: ModelProxy
) -> None:
    server = scripted([reply("streamed")], api_key=UPSTREAM_KEY)
    run = proxy.open_run(upstream_endpoint(server), Trace(harness="test"))
    assert agent_post(proxy, {"model": "m"}, run.secret).status_code == 400
    assert server.requests == [] and run.trace.turns == []
    streaming = agent_post(proxy, {"model": "m", "messages": USER, "stream": True}, run.secret)
    assert streaming.status_code == 200
    assert streaming.headers["content-type"] == "text/event-stream"
    assert streaming.text.endswith("data: [DONE]\n\n")
    assert run.trace.turns[0].reply is not None
    assert run.trace.turns[0].reply.content == "streamed"


def test_runs_are_kept_apart(scripted: ScriptedFactory, proxy: ModelProxy) -> None:
    server = scripted([reply("for a"), reply("for b")], api_key=UPSTREAM_KEY)
    trace_a, trace_b = Trace(harness="a"), Trace(harness="b")
    run_a = proxy.open_run(upstream_endpoint(server), trace_a)
    run_b = proxy.open_run(upstream_endpoint(server), trace_b)
    assert run_a.secret != run_b.secret
    agent_post(proxy, {"model": "m", "messages": [{"role": "user", "content": "a"}]}, run_a.secret)
    agent_post(proxy, {"model": "m", "messages": [{"role": "user", "content": "b"}]}, run_b.secret)
    assert [t.request_messages[0]["content"] for t in trace_a.turns] == ["a"]
    assert [t.request_messages[0]["content"] for t in trace_b.turns] == ["b"]
    assert run_a.secret not in repr(run_a)


def test_models_listing_needs_the_secret(scripted: ScriptedFactory, proxy: ModelProxy) -> None:
    server = scripted([], api_key=UPSTREAM_KEY)
    run = proxy.open_run(upstream_endpoint(server), Trace(harness="t"))
    url = f"{proxy.base_url}/models"
    assert httpx.get(url, timeout=10).status_code == 401
    listed = httpx.get(url, headers={"Authorization": f"Bearer {run.secret}"}, timeout=10)
    assert listed.json()["data"][0]["id"] == "scripted-model"


def test_gateway_is_read_from_the_route_table() -> None:
    table = (
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\n"
        "eth0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\n"
        "eth0\t00000000\t010011AC\t0003\t0\t0\t0\t00000000\n"
    )
    assert gateway_from_route_table(table) == "172.17.0.1"
    assert gateway_from_route_table(table.splitlines()[0]) is None


@pytest.mark.anyio
async def test_subprocess_sandbox_reaches_the_proxy_over_loopback(
    scripted: ScriptedFactory,
) -> None:
    server = scripted([reply("hello from upstream")], api_key=UPSTREAM_KEY)
    async with open_runtime({"type": "subprocess"}) as runtime:
        route = await route_to_host(runtime)
        assert (route.via, route.bind_host) == ("loopback", "127.0.0.1")
        with ModelProxy(host=route.bind_host) as proxy:
            trace = Trace(harness="test")
            run = proxy.open_run(upstream_endpoint(server), trace)
            url = await route.sandbox_base_url(runtime, proxy)
            answer = await runtime.exec(
                ["python3", "-c", AGENT_SNIPPET, url, run.secret], timeout=30
            )
    assert answer.exit_code == 0, answer.stderr
    assert answer.stdout.strip() == "hello from upstream"
    assert len(trace.turns) == 1 and trace.turns[0].status_code == 200


AGENT_SNIPPET = r"""
import json, sys, urllib.request
url, key = sys.argv[1], sys.argv[2]
body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
req = urllib.request.Request(url + "/chat/completions", data=body,
    headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=20))["choices"][0]["message"]["content"])
"""


@pytest.mark.docker
@pytest.mark.anyio
async def test_network_less_container_has_no_gateway_route() -> None:
    async with open_runtime({"type": "docker", "image": "vf-sandbox/python:latest"}) as runtime:
        with pytest.raises(ProxyRouteError, match="network='bridge'"):
            await route_to_host(runtime, via="gateway")


@pytest.mark.docker
@pytest.mark.anyio
async def test_bridge_container_reaches_the_proxy_via_its_gateway(
    scripted: ScriptedFactory,
) -> None:
    server = scripted([reply("hello container")], api_key=UPSTREAM_KEY)
    config = {"type": "docker", "image": "vf-sandbox/python:latest", "network": "bridge"}
    async with open_runtime(config) as runtime:
        route = await route_to_host(runtime, via="gateway")
        assert route.via == "gateway" and route.bind_host != "127.0.0.1"
        with ModelProxy(host=route.bind_host) as proxy:
            trace = Trace(harness="test")
            run = proxy.open_run(upstream_endpoint(server), trace)
            url = await route.sandbox_base_url(runtime, proxy)
            assert url == f"http://{route.bind_host}:{proxy.port}/v1"
            answer = await runtime.exec(
                ["python3", "-c", AGENT_SNIPPET, url, run.secret], timeout=60
            )
    assert answer.exit_code == 0, answer.stderr
    assert answer.stdout.strip() == "hello container"
    assert trace.turns[0].status_code == 200


@pytest.mark.ssh
@pytest.mark.anyio
async def test_ssh_sandbox_reaches_the_proxy_through_a_reverse_forward(
    scripted: ScriptedFactory, tmp_path: Path
) -> None:
    from tests.ssh.sshd import SSHServer, image_present

    assert image_present(), "vf-sandbox/sshd is missing: build it with `make images`"
    server = scripted([reply("hello over ssh")], api_key=UPSTREAM_KEY)
    with SSHServer(tmp_path / "sshd") as sshd:
        async with open_runtime(sshd.config()) as runtime:
            route = await route_to_host(runtime, via="forward")
            assert (route.via, route.bind_host) == ("forward", "127.0.0.1")
            with ModelProxy(host=route.bind_host) as proxy:
                trace = Trace(harness="test")
                run = proxy.open_run(upstream_endpoint(server), trace)
                url = await route.sandbox_base_url(runtime, proxy)
                assert route.exposed is not None and route.exposed.via == "forward"
                answer = await runtime.exec(
                    ["python3", "-c", AGENT_SNIPPET, url, run.secret], timeout=60
                )
                await route.release(runtime)
                assert route.exposed is None
    assert answer.exit_code == 0, answer.stderr
    assert answer.stdout.strip() == "hello over ssh"
    assert trace.turns[0].status_code == 200
