"""The interception proxy: an OpenAI-compatible chat-completions endpoint on the host for
harnesses that run INSIDE sandboxes.

An agent installed in a sandbox is pointed at the proxy instead of the provider. The
proxy serves ``POST /v1/chat/completions`` (and ``/chat/completions``, and
``GET /v1/models``) and, for every request:

1. authenticates it by the run's **secret** (the agent's API key; a fresh random token
   per run). No or a wrong secret: 401. The real provider key never enters the sandbox.
2. checks the run's **budget** before the turn (turns, tokens, wall time). Over budget:
   ``429`` with ``{"error": {"type": "budget_exceeded", "code": "budget_turns", ...}}``
   and ``x-should-retry: false``, and the run's trace gets the typed error.
3. rewrites ``model`` to the upstream endpoint's model and fills the endpoint's
   ``sampling`` defaults the agent did not set, then forwards to the upstream.
4. records the turn (request messages, reply, usage, latency, status) on the run's
   :class:`~harnesses.base.Trace`, and passes the upstream's status code and body
   through unchanged (429, 500, ... reach the agent as the provider sent them).
   An unreachable upstream is a 502, an upstream timeout a 504.

Streaming (``"stream": true``) is answered with server-sent events (``data: {chunk}``,
then ``data: [DONE]``) cut from the whole reply: a forwarding run asks its upstream for a
whole (non-streaming) completion, records it, and streams it back re-chunked; a gated run
streams the completion its caller delivered. Errors keep their status and JSON body (as
providers answer a streaming request that fails before its first token). The trace records
the whole reply either way (:func:`sse_body`).

**Gated mode** (:meth:`ModelProxy.open_gated_run`, for online RL): instead of forwarding,
the proxy parks each request in a :class:`~harnesses.gate.RequestGate` and answers the
harness with the completion the caller delivers (an OpenAI-shaped chat completion, usage
as given or estimated); the turn is recorded on the run's trace as usual. A request left
undelivered past the gate's delivery timeout is answered ``504`` (``gate_timeout``,
``x-should-retry: false``) and fails the run; later requests are refused. A closed gate
answers ``503``. :mod:`harnesses.session` builds the trainer-facing contract on it.

The server is a thread (:mod:`harnesses._http`), so it serves whatever event loop the
caller runs. Where it binds, and the URL the sandbox uses, are the runtime's to say
(:func:`route_to_host` asks :meth:`runtimes.base.Runtime.plan_host_route` and
:meth:`~runtimes.base.Runtime.expose_host`): by default a relay over the sandbox's channel
(Docker with any network, SSH, Modal) or the loopback (subprocess, Docker
``network="host"``); the bridge gateway and an SSH reverse forward on request; a URL the
user exposed (``proxy_url``).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import httpx

from runtimes import Runtime
from runtimes.errors import HostRouteError
from runtimes.routes import HostRoute

from ._http import HTTPRequest, HTTPResponse, LocalHTTPServer, error_response, json_response
from .base import Budget, BudgetClock, Trace, Turn, utc_now
from .errors import ModelResponseError, ProxyRouteError
from .gate import RequestGate
from .llm import ModelEndpoint, parse_chat_completion, redact

__all__ = [
    "BUDGET_EXCEEDED_STATUS",
    "SSE_PIECE",
    "ModelProxy",
    "ProxyRoute",
    "ProxyRun",
    "route_to_host",
    "sse_body",
]

log = logging.getLogger("harnesses.proxy")

BUDGET_EXCEEDED_STATUS = 429
_CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
_MODELS_PATHS = frozenset({"/v1/models", "/models"})


class ProxyRun:
    """One run's registration on a :class:`ModelProxy`: its secret, trace and budget.

    A forwarding run has an ``upstream``; a gated run has a ``gate`` instead (and serves
    ``model`` as its model name). ``close()`` (or leaving the ``with`` block) unregisters
    it: its secret stops working.
    """

    def __init__(
        self,
        proxy: ModelProxy,
        upstream: ModelEndpoint | None,
        trace: Trace,
        budget: Budget,
        api_key: str | None,
        *,
        gate: RequestGate | None = None,
        model: str | None = None,
    ):
        if (upstream is None) == (gate is None):
            raise ValueError("a proxy run either forwards to an upstream or is gated")
        self.proxy = proxy
        self.upstream = upstream
        self.gate = gate
        self.model = model if model is not None else upstream.model if upstream else "gated"
        self.trace = trace
        self.budget = budget
        self.secret = secrets.token_urlsafe(32)
        self._api_key = api_key
        self.lock = threading.Lock()

    def __repr__(self) -> str:
        mode = "gated" if self.gate is not None else "forwarding"
        return f"ProxyRun({mode}, model={self.model!r}, turns={len(self.trace.turns)})"

    @property
    def upstream_key(self) -> str | None:
        return self._api_key

    def close(self) -> None:
        """Unregister the run. Idempotent."""
        self.proxy._forget(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ModelProxy:
    """The host-side proxy. One server serves many runs, told apart by their secrets."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0):
        self._server = LocalHTTPServer(self._handle, host=host, port=port)
        self._runs: dict[str, ProxyRun] = {}
        self._lock = threading.Lock()
        self._http: httpx.Client | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        """Bind and serve.

        Raises:
            ProxyRouteError: the address cannot be bound (not an address of this host).
        """
        try:
            self._server.start()
        except OSError as exc:
            raise ProxyRouteError(
                f"the model proxy cannot listen on {self._server.host}: {exc}"
            ) from exc
        self._http = httpx.Client(timeout=None)
        return self

    def stop(self) -> None:
        """Stop serving; every run's secret stops working. Idempotent."""
        self._server.stop()
        with self._lock:
            self._runs.clear()
        if self._http is not None:
            self._http.close()
            self._http = None

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
    def host(self) -> str:
        return self._server.host

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def base_url(self) -> str:
        """The URL as seen from the host (``http://<bind host>:<port>/v1``)."""
        return f"http://{self.host}:{self.port}/v1"

    def open_run(
        self,
        upstream: ModelEndpoint,
        trace: Trace,
        budget: Budget | None = None,
        *,
        api_key: str | None = None,
    ) -> ProxyRun:
        """Register a run: requests carrying its secret go to ``upstream`` and onto ``trace``.

        The upstream key comes from ``api_key`` or the endpoint's ``api_key_env``.

        Raises:
            ModelConfigError: the endpoint's API key variable is not set.
        """
        key = api_key if api_key is not None else upstream.resolve_api_key()
        return self._register(ProxyRun(self, upstream, trace, budget or Budget(), key))

    def open_gated_run(
        self,
        gate: RequestGate,
        trace: Trace,
        budget: Budget | None = None,
        *,
        model: str = "gated",
    ) -> ProxyRun:
        """Register a gated run: requests carrying its secret are parked in ``gate`` and
        answered with what its caller delivers, never forwarded. ``model`` is the name
        ``GET /v1/models`` lists. ``budget`` defaults to unlimited (harnesses enforce their
        own); when given it is checked before each turn as for forwarding runs."""
        unlimited = Budget(max_turns=None)
        return self._register(
            ProxyRun(self, None, trace, budget or unlimited, None, gate=gate, model=model)
        )

    def _register(self, run: ProxyRun) -> ProxyRun:
        with self._lock:
            self._runs[run.secret] = run
        return run

    def _forget(self, run: ProxyRun) -> None:
        with self._lock:
            self._runs.pop(run.secret, None)

    # ------------------------------------------------------------------ serving

    def _handle(self, request: HTTPRequest) -> HTTPResponse:
        path = request.path.split("?", 1)[0].rstrip("/")
        run = self._authenticate(request)
        if run is None:
            return error_response(
                401,
                "missing or invalid API key for the vf-sandbox model proxy",
                kind="authentication_error",
                code="invalid_api_key",
            )
        if request.method == "GET" and path in _MODELS_PATHS:
            return json_response(200, {"object": "list", "data": [_model_card(run.model)]})
        if request.method != "POST" or path not in _CHAT_PATHS:
            return error_response(404, f"no route {request.method} {request.path}")
        try:
            body = json.loads(request.body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error_response(400, f"request body is not JSON: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return error_response(400, "request body must be an object with a 'messages' list")
        stream = body.get("stream") is True
        options = body.get("stream_options")
        usage_chunk = stream and isinstance(options, dict) and bool(options.get("include_usage"))
        turn, refusal = self._admit(run, body)
        if refusal is not None:
            return refusal
        assert turn is not None
        if run.gate is not None:
            answer = self._answer_gated(run, run.gate, turn, body)
        else:
            whole = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            answer = self._forward(run, turn, whole)
        return _streamed(answer, include_usage=usage_chunk) if stream else answer

    def _authenticate(self, request: HTTPRequest) -> ProxyRun | None:
        token = request.bearer_token() or request.header("x-api-key")
        if not token:
            return None
        with self._lock:
            return self._runs.get(token)

    def _admit(
        self, run: ProxyRun, body: dict[str, Any]
    ) -> tuple[Turn | None, HTTPResponse | None]:
        """Check the budget and reserve the turn (so concurrent requests count too)."""
        with run.lock:
            reason = run.trace.error.kind if run.trace.error else None
            message = run.trace.error.message if run.trace.error else ""
            if reason is None:
                exhausted = BudgetClock(run.budget, run.trace).exhausted()
                if exhausted is not None:
                    reason, message = exhausted
                    run.trace.fail(reason, message)
            if reason is not None:
                return None, error_response(
                    BUDGET_EXCEEDED_STATUS,
                    f"vf-sandbox: {message}; this run may make no more model calls",
                    kind="budget_exceeded" if reason.startswith("budget_") else "run_failed",
                    code=reason,
                    headers={"x-should-retry": "false"},
                )
            turn = Turn(
                index=len(run.trace.turns), started_at=utc_now(), request_messages=body["messages"]
            )
            run.trace.turns.append(turn)
            return turn, None

    @staticmethod
    def _answer_gated(
        run: ProxyRun, gate: RequestGate, turn: Turn, body: dict[str, Any]
    ) -> HTTPResponse:
        """Park the request until the gate's caller delivers, then record and answer."""
        outcome = gate.park(body, turn.index)
        with run.lock:
            turn.latency = outcome.latency
            turn.status_code = outcome.response.status
            if outcome.reply is not None:
                turn.reply = outcome.reply
                turn.usage = outcome.reply.usage
            else:
                turn.error = outcome.error
            if outcome.state == "expired":
                run.trace.fail("model_error", outcome.error or "gated delivery timed out")
        return outcome.response

    def _forward(self, run: ProxyRun, turn: Turn, body: dict[str, Any]) -> HTTPResponse:
        upstream = run.upstream
        assert upstream is not None
        payload = dict(body)
        payload["model"] = upstream.model
        for key, value in upstream.sampling.items():
            payload.setdefault(key, value)
        headers = {"Content-Type": "application/json"}
        if run.upstream_key:
            headers["Authorization"] = f"Bearer {run.upstream_key}"
        started = time.monotonic()
        assert self._http is not None
        try:
            answer = self._http.post(
                upstream.chat_url,
                content=json.dumps(payload).encode("utf-8"),
                headers=headers,
                timeout=upstream.timeout,
            )
        except httpx.TimeoutException:
            return self._fail_turn(run, turn, started, 504, "the upstream model timed out")
        except httpx.TransportError as exc:
            return self._fail_turn(
                run, turn, started, 502, f"the upstream model is unreachable: {type(exc).__name__}"
            )
        latency = time.monotonic() - started
        text = redact(answer.text, run.upstream_key)
        with run.lock:
            turn.latency = latency
            turn.status_code = answer.status_code
            if answer.is_success:
                self._record_reply(turn, text, latency)
            else:
                turn.error = f"HTTP {answer.status_code}: {text[:2000]}"
        content_type = answer.headers.get("content-type", "application/json")
        return HTTPResponse(
            answer.status_code, text.encode("utf-8"), {"Content-Type": content_type}
        )

    @staticmethod
    def _record_reply(turn: Turn, text: str, latency: float) -> None:
        try:
            reply = parse_chat_completion(json.loads(text), latency=latency)
        except (json.JSONDecodeError, ModelResponseError) as exc:
            turn.error = f"malformed upstream reply: {exc}"
            return
        turn.reply = reply
        turn.usage = reply.usage

    @staticmethod
    def _fail_turn(
        run: ProxyRun, turn: Turn, started: float, status: int, message: str
    ) -> HTTPResponse:
        with run.lock:
            turn.latency = time.monotonic() - started
            turn.status_code = status
            turn.error = message
        return error_response(status, message, kind="upstream_error")


SSE_PIECE = 48
"""Characters of content (or of a tool call's arguments) per streamed chunk."""


def _streamed(answer: HTTPResponse, *, include_usage: bool) -> HTTPResponse:
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


def _model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "owned_by": "vf-sandbox-proxy"}


# ---------------------------------------------------------------------- routing


@dataclass
class ProxyRoute:
    """Where the proxy listens on the host, and how the sandbox reaches it.

    ``via`` is a route of the runtime (:mod:`runtimes.routes`: ``"channel"``, a relay over
    the sandbox's channel, the default where it runs; ``"loopback"``; ``"gateway"``;
    ``"forward"``) or ``"url"`` (a URL the user exposed, e.g. a tunnel). The runtime makes
    the route (:meth:`runtimes.base.Runtime.expose_host`); this module never probes the
    sandbox itself.
    """

    bind_host: str
    via: str
    url: str | None = None
    exposed: HostRoute | None = None

    async def sandbox_base_url(self, runtime: Runtime, proxy: ModelProxy) -> str:
        """The proxy's base URL as seen from inside the sandbox.

        Raises:
            HostRouteError: the route could not be made (the channel is down, the forward
                was refused...).
            SandboxError: the sandbox failed.
        """
        if self.url is not None:
            return self.url.rstrip("/")
        self.exposed = await runtime.expose_host(proxy.port, via=self.via)
        return self.exposed.url("/v1")

    def lost(self) -> str | None:
        """Why the route stopped carrying traffic (its channel relay died), or ``None``."""
        return self.exposed.lost() if self.exposed is not None else None

    async def release(self, runtime: Runtime) -> None:
        """Undo what :meth:`sandbox_base_url` set up (a relay, an SSH reverse forward).

        Raises:
            SandboxError: the sandbox failed while undoing it.
        """
        exposed, self.exposed = self.exposed, None
        if exposed is not None:
            await exposed.close()


async def route_to_host(
    runtime: Runtime,
    *,
    proxy_url: str | None = None,
    bind_host: str | None = None,
    via: str | None = None,
) -> ProxyRoute:
    """How a process in ``runtime`` can reach a proxy on this host: the runtime's default
    route (:meth:`runtimes.base.Runtime.host_routes`), or ``via`` when given.

    ``proxy_url`` (a URL the user made reachable from the sandbox, e.g. a tunnel) and
    ``bind_host`` override the choice.

    Raises:
        ProxyRouteError: the sandbox has no such route (or none); the message says what to
            configure.
        SandboxError: probing the sandbox failed.
    """
    if proxy_url is not None:
        return ProxyRoute(bind_host=bind_host or "127.0.0.1", via="url", url=proxy_url)
    try:
        kind, address = await runtime.plan_host_route(via)
    except HostRouteError as exc:
        raise ProxyRouteError(f"no route to the model proxy: {exc}") from exc
    return ProxyRoute(bind_host=bind_host or address, via=kind)
