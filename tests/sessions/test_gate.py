"""The proxy's gated mode on its own: requests parked, answered with what the caller
delivers, timed out or refused, and recorded on the run's trace."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest

from harnesses.base import Trace
from harnesses.errors import SessionDeliveryTimeout, SessionProtocolError
from harnesses.gate import Completion, InterceptedRequest, RequestGate
from harnesses.llm import ChatClient, ModelEndpoint, ToolCall, Usage
from harnesses.proxy import ModelProxy, ProxyRun

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "hi"}]


@dataclass
class Listener:
    parked: list[InterceptedRequest] = field(default_factory=list)
    expired: list[tuple[str, float]] = field(default_factory=list)
    threads: set[int] = field(default_factory=set)
    arrived: anyio.Event = field(default_factory=anyio.Event)

    def request_parked(self, request: InterceptedRequest) -> None:
        self.threads.add(threading.get_ident())
        self.parked.append(request)
        self.arrived.set()

    def request_expired(self, request: InterceptedRequest, timeout: float) -> None:
        self.threads.add(threading.get_ident())
        self.expired.append((request.request_id, timeout))

    async def next(self) -> InterceptedRequest:
        with anyio.fail_after(10):
            await self.arrived.wait()
        self.arrived = anyio.Event()
        return self.parked[-1]


@dataclass
class Gated:
    proxy: ModelProxy
    run: ProxyRun
    gate: RequestGate
    listener: Listener
    trace: Trace

    async def post(self, body: dict[str, Any], client: httpx.AsyncClient) -> httpx.Response:
        return await client.post(
            f"{self.proxy.base_url}/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {self.run.secret}"},
        )


async def gated(delivery_timeout: float = 30.0) -> Gated:
    listener = Listener()
    gate = RequestGate(listener, delivery_timeout=delivery_timeout)
    proxy = ModelProxy().start()
    trace = Trace(harness="test", model="policy")
    run = proxy.open_gated_run(gate, trace, model="policy")
    return Gated(proxy, run, gate, listener, trace)


@pytest.fixture
async def setup() -> AsyncIterator[Gated]:
    made = await gated()
    yield made
    made.gate.close()
    made.proxy.stop()


@pytest.mark.anyio
async def test_parked_request_is_answered_with_the_delivery(setup: Gated) -> None:
    body = {"model": "policy", "messages": USER, "tools": TOOLS, "temperature": 0.7}
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as tg:

        async def agent() -> None:
            answers.append(await setup.post(body, client))

        tg.start_soon(agent)
        request = await setup.listener.next()
        assert request.messages == USER and request.tools == TOOLS
        # the sampling is the trainer's: the harness's temperature is dropped, and named
        assert request.model == "policy" and request.params == {}
        assert request.turn == 0 and setup.gate.pending() == [request]
        request.messages.append({"role": "user", "content": "not the harness's"})
        completion = Completion(
            content="running it",
            tool_calls=[{"name": "bash", "arguments": {"command": "ls"}, "id": "call_x"}],
            usage=Usage(prompt_tokens=11, completion_tokens=4),
            metadata={"logprobs": [-0.1, -0.2]},
        )
        assert setup.gate.deliver(request.request_id, completion).request_id == request.request_id
    assert setup.listener.threads == {threading.get_ident()}  # callbacks ran in the loop
    answer = answers[0]
    assert answer.status_code == 200
    data = answer.json()
    assert data["object"] == "chat.completion" and data["model"] == "policy"
    assert data["choices"][0]["finish_reason"] == "tool_calls"
    assert data["choices"][0]["message"] == {
        "role": "assistant",
        "content": "running it",
        "tool_calls": [
            {
                "id": "call_x",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls"}'},
            }
        ],
    }
    assert data["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    assert "logprobs" not in json.dumps(data)  # metadata stays with the caller
    turn = setup.trace.turns[0]
    assert turn.request_messages == USER  # the trace keeps what the harness sent
    assert turn.dropped_params == ["temperature"]
    assert turn.status_code == 200 and turn.reply is not None
    assert turn.reply.tool_calls == [
        ToolCall(id="call_x", name="bash", arguments='{"command": "ls"}')
    ]
    assert turn.usage.total_tokens == 15 and turn.latency > 0
    assert setup.gate.pending() == []


@pytest.mark.anyio
async def test_a_chat_client_receives_exactly_the_delivered_message(setup: Gated) -> None:
    endpoint = ModelEndpoint(base_url=setup.proxy.base_url, model="policy", max_retries=0)
    completion = Completion(tool_calls=[{"name": "bash", "arguments": "{not json"}])
    replies: list[Any] = []
    client = ChatClient(endpoint, api_key=setup.run.secret)
    async with client, anyio.create_task_group() as tg:

        async def agent() -> None:
            replies.append(await client.chat(USER, TOOLS))

        tg.start_soon(agent)
        request = await setup.listener.next()
        setup.gate.deliver(request.request_id, completion)
    reply = replies[0]
    # raw, even invalid, arguments reach the harness untouched; the id was generated
    assert reply.tool_calls[0].arguments == "{not json"
    assert reply.tool_calls[0].id.startswith("call_")
    assert reply.assistant_message() == completion.assistant_message()
    assert reply.usage.total_tokens > 0  # estimated: the caller gave none
    assert reply.finish_reason == "tool_calls"


@pytest.mark.anyio
async def test_undelivered_request_times_out_and_fails_the_run() -> None:
    made = await gated(delivery_timeout=0.5)
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await made.post({"model": "policy", "messages": USER}, client)
            assert answer.status_code == 504
            assert answer.headers["x-should-retry"] == "false"
            assert answer.json()["error"]["type"] == "gate_timeout"
            request = made.listener.parked[0]
            assert made.listener.expired == [(request.request_id, 0.5)]
            with pytest.raises(SessionDeliveryTimeout):
                made.gate.deliver(request.request_id, Completion(content="too late"))
            turn = made.trace.turns[0]
            assert turn.status_code == 504 and turn.reply is None
            assert made.trace.error is not None and made.trace.error.kind == "model_error"
            refused = await made.post({"model": "policy", "messages": USER}, client)
            assert refused.status_code == 429
            assert refused.json()["error"]["type"] == "run_failed"
            assert len(made.listener.parked) == 1  # the refused call was never parked
    finally:
        made.gate.close()
        made.proxy.stop()


@pytest.mark.anyio
async def test_closing_the_gate_answers_parked_requests(setup: Gated) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        answers: list[httpx.Response] = []
        async with anyio.create_task_group() as tg:

            async def agent() -> None:
                answers.append(await setup.post({"model": "p", "messages": USER}, client))

            tg.start_soon(agent)
            request = await setup.listener.next()
            setup.gate.close("rollout abandoned")
        assert answers[0].status_code == 503
        assert "rollout abandoned" in answers[0].json()["error"]["message"]
        with pytest.raises(SessionProtocolError, match="already answered"):
            setup.gate.deliver(request.request_id, Completion(content="x"))
        again = await setup.post({"model": "p", "messages": USER}, client)
        assert again.status_code == 503 and len(setup.listener.parked) == 1


@pytest.mark.anyio
async def test_gated_run_lists_its_model_and_checks_its_secret(setup: Gated) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        listed = await client.get(
            f"{setup.proxy.base_url}/models",
            headers={"Authorization": f"Bearer {setup.run.secret}"},
        )
        assert listed.json()["data"][0]["id"] == "policy"
        stranger = await client.post(
            f"{setup.proxy.base_url}/chat/completions",
            json={"model": "p", "messages": USER},
            headers={"Authorization": "Bearer not-the-secret"},
        )
        assert stranger.status_code == 401 and setup.listener.parked == []


def test_completion_forms() -> None:
    openai_shaped = Completion.coerce(
        {
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{}"}}
            ]
        }
    )
    assert openai_shaped.tool_calls == [ToolCall(id="c1", name="bash", arguments="{}")]
    assert openai_shaped.resolved_finish_reason() == "tool_calls"
    assert Completion.coerce("hello").assistant_message() == {
        "role": "assistant",
        "content": "hello",
    }
    assert Completion(content="", finish_reason="length").resolved_finish_reason() == "length"
    with pytest.raises(SessionProtocolError, match="content or tool calls"):
        Completion.coerce({"metadata": {"x": 1}})
    with pytest.raises(SessionProtocolError, match="unknown: Extra inputs"):
        Completion.coerce({"content": "a", "unknown": 1})
