"""Attack class 21: the model proxy's parsers of a sandbox's bytes, fuzzed (hypothesis).

Everything the proxy reads came from an agent in a sandbox: the request head (method, path,
headers: the secret), the body (bytes that should be JSON), and the structure in it
(messages, roles, content, tool calls, tools, sampling parameters). The invariant, for
every input: the proxy answers with a well-formed HTTP response (a status and a JSON body:
a completion or an OpenAI-shaped error) and what it raises internally is its own typed
:class:`~harnesses.proxy_requests.ProxyRequestError`; never an untyped exception (which
the server would turn into a 500), never a record on the trace that is not a validated
request, and never an allocation out of proportion with the input.

The budget: see :mod:`tests.security.fuzzing` (a fixed number of derandomized examples in
``make test``, ``VF_FUZZ_EXAMPLES`` for a longer session).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from harnesses._http import HTTPRequest, HTTPResponse
from harnesses.base import Trace
from harnesses.proxy import ModelProxy, ProxyRun
from harnesses.proxy_requests import (
    ROLES,
    ChatRequest,
    ProxyRequestError,
    parse_json_bounded,
    recorded_messages,
    select_params,
    validate_request,
)
from harnesses.scripted import ScriptedEndpoint, reply

from .fuzzing import allocation_peak, fuzz

pytestmark = pytest.mark.attack(21)

# ---------------------------------------------------------------------- strategies

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
json_ish = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
roles = st.sampled_from([*ROLES, "grader", "", "function"]) | st.text(max_size=8)
contents = (
    st.text(max_size=40)
    | st.none()
    | st.integers()
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url", 3])}, optional={"text": scalars}
        ),
        max_size=3,
    )
    | json_ish
)
calls = (
    st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "id": st.text(max_size=8) | st.integers(),
                "type": st.sampled_from(["function", "tool", None]),
                "function": st.fixed_dictionaries(
                    {}, optional={"name": st.text(max_size=8) | st.none(), "arguments": json_ish}
                )
                | st.text(max_size=8),
            },
        ),
        max_size=3,
    )
    | st.text(max_size=10)
    | json_ish
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles},
        optional={
            "content": contents,
            "tool_calls": calls,
            "tool_call_id": st.text(max_size=8) | st.integers() | st.none(),
            "name": scalars,
        },
    )
    | json_ish,
    max_size=4,
)
tools = (
    st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "code"])},
            optional={
                "function": st.fixed_dictionaries(
                    {"name": st.text(max_size=10) | st.integers()},
                    optional={"parameters": json_ish, "description": scalars},
                )
            },
        ),
        max_size=2,
    )
    | json_ish
)
params = st.dictionaries(
    st.sampled_from(
        [
            "temperature",
            "top_p",
            "max_tokens",
            "max_completion_tokens",
            "stop",
            "tool_choice",
            "parallel_tool_calls",
            "response_format",
            "n",
            "best_of",
            "seed",
            "logit_bias",
            "stream_options",
            "reasoning_effort",
        ]
    ),
    json_ish,
    max_size=4,
)
requests = st.builds(
    lambda m, t, p, stream, model: {
        "messages": m,
        **({"tools": t} if t is not None else {}),
        **p,
        **({"stream": stream} if stream is not None else {}),
        **({"model": model} if model is not None else {}),
    },
    messages,
    st.none() | tools,
    params,
    st.none() | st.booleans() | st.text(max_size=3),
    st.none() | scalars,
)
near_valid = st.builds(
    lambda m, p, stream: {"messages": m, **p, **({"stream": True} if stream else {})},
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system"]), "content": st.text(max_size=30)}
        ),
        min_size=1,
        max_size=3,
    ),
    params,
    st.booleans(),
).map(lambda r: json.dumps(r).encode())
bodies = (
    near_valid
    | near_valid
    | st.binary(max_size=200)
    | requests.map(lambda r: json.dumps(r).encode())
    | json_ish.map(lambda v: json.dumps(v).encode())
    | st.builds(
        lambda depth, width: b'{"messages": ' + b"[" * depth + b"{}," * width + b"]" * depth + b"}",
        st.integers(0, 200),
        st.integers(0, 200),
    )
)


# ---------------------------------------------------------------------- the parsers


@fuzz(300)
@given(bodies)
@example(b'{"messages": [{"role": "assistant", "content": null, "tool_calls": "rm -rf /"}]}')
@example(b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1' + b"0" * 5000 + b"}")
@example(b"\xff\xfe")
def test_the_parsers_give_a_typed_request_or_a_typed_refusal(body: bytes) -> None:
    with allocation_peak() as peak:
        try:
            request = validate_request(parse_json_bounded(body))
            kept, dropped = select_params(request, "forwarding")
            gated, _ = select_params(request, "gated")
        except ProxyRequestError as exc:
            assert 400 <= exc.status < 500 and str(exc)
            request = None
    assert peak[0] < 64 * len(body) + 1024 * 1024, (peak[0], len(body))
    if request is None:
        return
    assert isinstance(request, ChatRequest) and request.messages
    assert all(m.role in ROLES for m in request.messages)
    assert all(
        isinstance(c.function.arguments, str) for m in request.messages for c in m.tool_calls or []
    )
    assert not {"n", "best_of", "seed", "logit_bias"} & set(kept) and not set(dropped) & set(kept)
    assert set(gated) <= {"tool_choice", "parallel_tool_calls", "stop"}
    raw = json.loads(body)["messages"]
    kept_messages, cut = recorded_messages(raw, 200)
    assert len(kept_messages) == len(raw) and cut >= 0


# ---------------------------------------------------------------------- the handler


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[ModelProxy, ProxyRun]]:
    upstream = ScriptedEndpoint(respond=lambda body: reply("ok", usage=(1, 1)))
    with (
        upstream,
        ModelProxy() as proxy,
        proxy.open_run(upstream.endpoint(), Trace(harness="fuzz")) as run,
    ):
        yield proxy, run


headers = st.dictionaries(
    st.sampled_from(["Authorization", "authorization", "x-api-key", "Content-Type", "X-Other"]),
    st.text(max_size=30),
    max_size=3,
)


@fuzz(200)
@given(
    body=bodies,
    extra=headers,
    method=st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]),
    path=st.sampled_from(
        ["/v1/chat/completions"] * 4 + ["/chat/completions/", "/v1/models", "/x?y"]
    ),
    authorised=st.sampled_from([True, True, True, False]),
)
def test_the_handler_always_answers_a_well_formed_response(
    served: tuple[ModelProxy, ProxyRun],
    body: bytes,
    extra: dict[str, str],
    method: str,
    path: str,
    authorised: bool,
) -> None:
    proxy, run = served
    head = dict(extra)
    if authorised:
        head = {k: v for k, v in head.items() if k.lower() != "authorization"}
        head["Authorization"] = f"Bearer {run.secret}"
    request = HTTPRequest(method, path, head, body)
    turns = len(run.trace.turns)
    refused = proxy._admit_head(request)  # what the server asks before reading a body
    answer = refused if refused is not None else proxy._handle(request)
    assert isinstance(answer, HTTPResponse) and 200 <= answer.status < 600
    event(f"status {answer.status}")
    assert answer.status != 500, answer.body
    decoded = json.loads(answer.body.split(b"\n\n")[0].removeprefix(b"data: ") or b"{}")
    assert isinstance(decoded, dict) and (
        "error" in decoded or "choices" in decoded or "data" in decoded
    )
    if answer.status == 200 and "choices" in decoded:
        assert len(run.trace.turns) == turns + 1
        # what the trace keeps was validated: roles from the closed set
        assert all(m["role"] in ROLES for m in run.trace.turns[-1].request_messages)
    elif answer.status != 200:
        assert len(run.trace.turns) == turns  # nothing refused is recorded as a turn


# ---------------------------------------------------------------------- the wire


@fuzz(100)
@given(
    line=st.binary(max_size=60)
    | st.sampled_from([b"POST /v1/chat/completions HTTP/1.1", b"GET / HTTP/1.0"]),
    head=st.lists(st.binary(max_size=40), max_size=4),
    body=st.binary(max_size=60),
)
def test_arbitrary_bytes_on_the_wire_get_an_http_answer_or_a_close(
    served: tuple[ModelProxy, ProxyRun], line: bytes, head: list[bytes], body: bytes
) -> None:
    proxy, run = served
    with socket.create_connection(("127.0.0.1", proxy.port), 5) as sock:
        sock.settimeout(5)
        sock.sendall(line + b"\r\n" + b"\r\n".join(head) + b"\r\n\r\n" + body)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        try:
            while piece := sock.recv(65536):
                got += piece
        except ConnectionError:
            pass
    assert got == b"" or got.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), got[:80]
    if got:
        status = int(got.split(b" ", 2)[1])
        assert status != 500, got[:300]
    # the server is alive and serves the agent
    listed = httpx.get(
        f"{proxy.base_url}/models", headers={"Authorization": f"Bearer {run.secret}"}, timeout=10
    )
    assert listed.status_code == 200
