"""Streaming through the proxy: the ``openai`` package's client, with ``stream=True``, run
INSIDE the sandbox (subprocess; Docker with ``network="none"``, through the channel relay),
gets a correct stream of text and of tool calls, in pass-through mode and in a gated run;
the trace records the whole reply.

The images carry no ``openai``: the test unpacks the ``openai`` wheel and its dependencies
from the mini-swe-agent wheelhouse (the host cache; downloaded by whichever test needs it
first) into a directory it uploads into the sandbox and puts on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harnesses.base import Trace
from harnesses.gate import Completion, InterceptedRequest, RequestGate, call
from harnesses.installed import prepare_wheelhouse
from harnesses.mini_swe_agent import MiniSweAgentHarness
from harnesses.proxy import SSE_PIECE, ModelProxy, route_to_host, sse_body
from harnesses.scripted import ScriptedEndpoint, reply, tool_calls
from runtimes import Runtime, open_runtime

pytestmark = pytest.mark.anyio

OPENAI_DEPS = (
    "openai",
    "httpx",
    "httpcore",
    "h11",
    "anyio",
    "sniffio",
    "idna",
    "certifi",
    "pydantic",
    "pydantic_core",
    "typing_extensions",
    "typing_inspection",
    "annotated_types",
    "distro",
    "jiter",
    "tqdm",
)
LONG_TEXT = "streamed " + "word " * 40 + "end"
ARGS = {"command": "echo 'a long enough command' && ls -la /tmp | head -n 3"}

CLIENT = r"""
import json, sys
from openai import OpenAI
tools = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object",
         "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
def one(client, prompt):
    stream = client.chat.completions.create(model="agent-model", stream=True, tools=tools,
        messages=[{"role": "user", "content": prompt}], stream_options={"include_usage": True})
    text, calls, chunks, finish, usage = "", {}, 0, None, None
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage.total_tokens
        for choice in chunk.choices:
            delta = choice.delta
            text += delta.content or ""
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] = tc.function.name or slot["name"]
                    slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return {"text": text, "calls": [calls[i] for i in sorted(calls)], "chunks": chunks,
            "finish": finish, "usage": usage}
results = []
for url, key in zip(sys.argv[1::2], sys.argv[2::2]):  # one run per (url, key): two calls
    client = OpenAI(base_url=url, api_key=key, max_retries=0)
    results.append([one(client, prompt) for prompt in ("talk", "act")])
print(json.dumps(results))
"""


async def openai_libs(runtime: Runtime, into: Path) -> Path:
    """``openai`` and its dependencies for ``runtime``'s interpreter, unpacked into ``into``
    from mini-swe-agent's wheelhouse (the same host cache the mini tests fill: downloaded
    once, offline after)."""
    mini = MiniSweAgentHarness()
    house = await prepare_wheelhouse(mini.requirements, await mini.sandbox_python(runtime))
    for name in OPENAI_DEPS:
        wheels = sorted(house.glob(f"{name}-*.whl"))
        assert wheels, f"{name} is not in {house}"
        with zipfile.ZipFile(wheels[-1]) as wheel:
            wheel.extractall(into)
    return into


class Deliverer:
    """A gate listener that answers each parked call from a script, in the loop's thread."""

    def __init__(self, answers: list[Completion]) -> None:
        self.answers = answers
        self.gate: RequestGate | None = None

    def request_parked(self, request: InterceptedRequest) -> None:
        assert self.gate is not None
        self.gate.deliver(request.request_id, self.answers.pop(0))

    def request_expired(self, request: InterceptedRequest, timeout: float) -> None:
        raise AssertionError(f"call {request.turn} expired")


@dataclass
class Streamed:
    """What one client process in the sandbox got from a pass-through run and a gated run
    (two streamed calls each: text, then tool calls), and what the host recorded."""

    passed: list[dict[str, Any]]
    gated: list[dict[str, Any]]
    passed_trace: Trace
    gated_trace: Trace
    upstream: ScriptedEndpoint


@pytest.fixture(
    params=[
        pytest.param({"type": "subprocess"}, id="subprocess"),
        pytest.param(
            {"type": "docker", "image": "vf-sandbox/python:latest"},
            id="docker-no-network",
            marks=pytest.mark.docker,
        ),
    ],
    scope="module",
)
async def streamed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Streamed]:
    """One sandbox per backend, one upload of the ``openai`` package, and one client process
    (one ``openai`` import) that streams through a pass-through run and then a gated run of
    the same proxy: the tests below only read what it got."""
    upstream = ScriptedEndpoint(
        [reply(LONG_TEXT), tool_calls(("bash", ARGS), ("bash", {"command": "pwd"}))]
    )
    upstream.start()
    deliverer = Deliverer(
        [
            Completion(content=LONG_TEXT),
            Completion(tool_calls=[call("bash", ARGS), call("bash", {"command": "pwd"})]),
        ]
    )
    gate = RequestGate(deliverer, delivery_timeout=60)
    deliverer.gate = gate
    try:
        async with open_runtime(request.param) as runtime:
            libs = await openai_libs(runtime, tmp_path_factory.mktemp("openai-libs"))
            await runtime.upload(libs, "pylibs")
            route = await route_to_host(runtime)
            with ModelProxy(host=route.bind_host) as proxy:
                passed_trace, gated_trace = Trace(harness="test"), Trace(harness="gated")
                passed = proxy.open_run(upstream.endpoint(), passed_trace)
                gated = proxy.open_gated_run(gate, gated_trace)
                url = await route.sandbox_base_url(runtime, proxy)
                try:
                    result = await runtime.exec(
                        ["python3", "-c", CLIENT, url, passed.secret, url, gated.secret],
                        env={"PYTHONPATH": f"{runtime.workdir}/pylibs"},
                        timeout=120,
                    )
                finally:
                    await route.release(runtime)
            assert result.exit_code == 0, result.stderr
            outs = json.loads(result.stdout)
            yield Streamed(outs[0], outs[1], passed_trace, gated_trace, upstream)
    finally:
        upstream.stop()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def assert_streams(out: list[dict[str, Any]]) -> None:
    talk, act = out
    assert talk["text"] == LONG_TEXT and talk["calls"] == [] and talk["finish"] == "stop"
    assert talk["chunks"] > len(LONG_TEXT) // SSE_PIECE  # really cut into pieces
    assert act["finish"] == "tool_calls"
    assert [c["name"] for c in act["calls"]] == ["bash", "bash"]
    assert [json.loads(c["arguments"]) for c in act["calls"]] == [ARGS, {"command": "pwd"}]
    assert all(c["id"] for c in act["calls"]) and act["calls"][0]["id"] != act["calls"][1]["id"]
    assert talk["usage"] and act["usage"]


def assert_whole_turns(trace: Trace) -> None:
    assert [t.status_code for t in trace.turns] == [200, 200]
    first, second = (t.reply for t in trace.turns)
    assert first is not None and first.content == LONG_TEXT
    assert second is not None and [json.loads(c.arguments) for c in second.tool_calls] == [
        ARGS,
        {"command": "pwd"},
    ]


async def test_pass_through_streams_text_and_tool_calls(streamed: Streamed) -> None:
    assert_streams(streamed.passed)
    assert_whole_turns(streamed.passed_trace)
    # the upstream was asked for whole completions, and only by the pass-through run
    requests = streamed.upstream.requests
    assert len(requests) == 2
    assert all("stream" not in r.body and "stream_options" not in r.body for r in requests)


async def test_gated_run_streams_the_delivered_completion(streamed: Streamed) -> None:
    assert_streams(streamed.gated)
    assert_whole_turns(streamed.gated_trace)


def test_sse_body_cuts_a_completion_into_chunks() -> None:
    completion = {
        "id": "c1",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * 100},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
    }
    events = sse_body(completion, include_usage=True).decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == (
        "x" * 100
    )
    assert chunks[-1]["usage"]["total_tokens"] == 3 and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
