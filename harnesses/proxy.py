"""The interception proxy: an OpenAI-compatible chat-completions endpoint on the host for
harnesses that run INSIDE sandboxes.

An agent installed in a sandbox is pointed at the proxy instead of the provider. Every
byte it sends is treated as hostile. The proxy serves ``POST /v1/chat/completions`` (and
``/chat/completions``, and ``GET /v1/models``) and, for every request:

1. authenticates it by the run's **secret** (the agent's API key; a fresh random token
   per run) from the headers, before any of the body is read. No or a wrong secret: 401,
   the body never read. The real provider key never enters the sandbox.
2. reads the body within the server's limits (:class:`~harnesses._http.ServerLimits`:
   4 MiB by default, ``413`` past it; a read timeout; connection caps), refuses JSON that
   would allocate without bound, and validates the request into typed models
   (:mod:`harnesses.proxy_requests`). Malformed: ``400``, kept typed on the run
   (:attr:`ProxyRun.rejections`) and its trace (``metadata["proxy_rejected"]``).
3. keeps only the request parameters the run's mode allows (the sampling belongs to the
   trainer and the budget; :data:`~harnesses.proxy_requests.GATED_PARAMS`,
   :data:`~harnesses.proxy_requests.FORWARDED_PARAMS`); what it dropped is named on the
   turn (:attr:`~harnesses.base.Turn.dropped_params`).
4. checks the run's **budget** before the turn (turns, tokens, wall time). Over budget:
   ``429`` with ``{"error": {"type": "budget_exceeded", "code": "budget_turns", ...}}``
   and ``x-should-retry: false``, and the run's trace gets the typed error.
5. forwarding: rewrites ``model`` to the upstream endpoint's model, applies the endpoint's
   ``sampling`` (it wins over the agent's), clamps ``max_tokens`` to what the token budget
   has left (reserved for the turn, so concurrent turns share it), and forwards. A reply
   past that grant is cut there and fails the run (``budget_tokens``).
6. records the turn (request messages, at most ``max_recorded_chars`` of them; reply,
   usage, latency, status) on the run's :class:`~harnesses.base.Trace`, and passes the
   upstream's status code and body through (429, 500, ... reach the agent as the provider
   sent them). An unreachable upstream is a 502, an upstream timeout a 504, a reply over
   ``max_reply_bytes`` a 502.

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

The server runs its own event loop in a thread (:mod:`harnesses._http`), so it serves
whatever event loop the caller runs. Where it binds, and the URL the sandbox uses, are the
runtime's to say (:func:`route_to_host` asks :meth:`runtimes.base.Runtime.plan_host_route`
and :meth:`~runtimes.base.Runtime.expose_host`): by default a relay over the sandbox's
channel (Docker with any network, SSH, Modal) or the loopback (subprocess, Docker
``network="host"``); the bridge gateway and an SSH reverse forward on request; a URL the
user exposed (``proxy_url``).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Literal, Self

import httpx

from ._http import (
    HTTPRequest,
    HTTPResponse,
    LocalHTTPServer,
    MiB,
    ServerLimits,
    error_response,
    json_response,
)
from .base import Budget, BudgetClock, Trace, Turn, utc_now
from .errors import ModelResponseError, ProxyRouteError
from .gate import RequestGate
from .llm import ModelEndpoint, parse_chat_completion, redact
from .proxy_replies import (
    BUDGET_EXCEEDED_STATUS,
    SSE_PIECE,
    cut_at_budget,
    model_card,
    refused,
    sse_body,
    streamed,
    unauthenticated,
)
from .proxy_requests import (
    MAX_REJECTIONS_KEPT,
    ProxyRequestError,
    RejectedRequest,
    parse_json_bounded,
    recorded_messages,
    select_params,
    validate_request,
)
from .proxy_routes import ProxyRoute, route_to_host

__all__ = [
    "BUDGET_EXCEEDED_STATUS",
    "SSE_PIECE",
    "ModelProxy",
    "ProxyRoute",
    "ProxyRun",
    "RejectedRequest",
    "ServerLimits",
    "route_to_host",
    "sse_body",
]

log = logging.getLogger("harnesses.proxy")

_CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
_MODELS_PATHS = frozenset({"/v1/models", "/models"})


class ProxyRun:
    """One run's registration on a :class:`ModelProxy`: its secret, trace and budget.

    A forwarding run has an ``upstream``; a gated run has a ``gate`` instead (and serves
    ``model`` as its model name). ``close()`` (or leaving the ``with`` block) unregisters
    it: its secret stops working. ``rejections`` holds the malformed requests it refused
    (typed; the first :data:`MAX_REJECTIONS_KEPT`), ``rejected`` counts them all.
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
        self.rejections: list[RejectedRequest] = []
        self.rejected = 0
        self.in_flight = 0
        self.reserved_tokens = 0

    def __repr__(self) -> str:
        mode = "gated" if self.gate is not None else "forwarding"
        return f"ProxyRun({mode}, model={self.model!r}, turns={len(self.trace.turns)})"

    @property
    def mode(self) -> Literal["gated", "forwarding"]:
        return "gated" if self.gate is not None else "forwarding"

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


@dataclass
class _Admitted:
    """A turn let through: its record, and the completion tokens reserved for it."""

    turn: Turn
    grant: int | None


class ModelProxy:
    """The host-side proxy. One server serves many runs, told apart by their secrets.

    ``max_body`` caps a request body (``413`` past it; the default of ``limits``,
    :class:`~harnesses._http.ServerLimits`, is 4 MiB); ``limits`` sets the server's other
    bounds. ``max_recorded_chars`` caps the messages one turn keeps on the trace;
    ``max_in_flight`` caps one run's concurrent requests (``429`` past it);
    ``max_reply_bytes`` caps an upstream reply (``502`` past it).
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body: int | None = None,
        limits: ServerLimits | None = None,
        max_recorded_chars: int = 512 * 1024,
        max_in_flight: int = 16,
        max_reply_bytes: int = 32 * MiB,
    ):
        limits = limits or ServerLimits()
        if max_body is not None:
            limits = replace(limits, max_body=max_body)
        self._server = LocalHTTPServer(
            self._handle, host=host, port=port, admit=self._admit_head, limits=limits
        )
        self._runs: dict[str, ProxyRun] = {}
        self._lock = threading.Lock()
        self._http: httpx.Client | None = None
        self.max_recorded_chars = max_recorded_chars
        self.max_in_flight = max_in_flight
        self.max_reply_bytes = max_reply_bytes

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
    def limits(self) -> ServerLimits:
        return self._server.limits

    @property
    def open_connections(self) -> int:
        """Connections to the proxy open right now."""
        return self._server.open_connections

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

    def _admit_head(self, head: HTTPRequest) -> HTTPResponse | None:
        """Before any of the body is read: no run's secret, no reading (a 401)."""
        return None if self._authenticate(head) is not None else unauthenticated()

    def _handle(self, request: HTTPRequest) -> HTTPResponse:
        path = request.path.split("?", 1)[0].rstrip("/")
        run = self._authenticate(request)
        if run is None:  # closed between its head and its body
            return unauthenticated()
        if request.method == "GET" and path in _MODELS_PATHS:
            return json_response(200, {"object": "list", "data": [model_card(run.model)]})
        if request.method != "POST" or path not in _CHAT_PATHS:
            return error_response(404, f"no route {request.method} {request.path}")
        try:
            data = parse_json_bounded(request.body)
            chat = validate_request(data)
            params, dropped = select_params(chat, run.mode)
        except ProxyRequestError as exc:
            return self._reject(run, exc)
        usage_chunk = chat.stream and bool(
            chat.stream_options and chat.stream_options.include_usage
        )
        body: dict[str, Any] = {"model": chat.model, "messages": data["messages"]}
        if chat.tools is not None:
            body["tools"] = data["tools"]
        body.update(params)
        admitted, refusal = self._admit(run, body, dropped)
        if refusal is not None:
            return refusal
        assert admitted is not None
        try:
            if run.gate is not None:
                answer = self._answer_gated(run, run.gate, admitted.turn, body)
            else:
                answer = self._forward(run, admitted, body)
        finally:
            with run.lock:
                run.in_flight -= 1
                run.reserved_tokens -= admitted.grant or 0
        return streamed(answer, include_usage=usage_chunk) if chat.stream else answer

    def _authenticate(self, request: HTTPRequest) -> ProxyRun | None:
        token = request.bearer_token() or request.header("x-api-key")
        if not token:
            return None
        with self._lock:
            return self._runs.get(token)

    @staticmethod
    def _reject(run: ProxyRun, error: ProxyRequestError) -> HTTPResponse:
        """Answer a malformed request and keep it, typed, on the run and its trace."""
        record = RejectedRequest(status=error.status, code=error.code, message=str(error)[:2000])
        log.info("model proxy refused a request (%s): %s", error.code, record.message[:200])
        with run.lock:
            run.rejected += 1
            if len(run.rejections) < MAX_REJECTIONS_KEPT:
                run.rejections.append(record)
                kept = run.trace.metadata.setdefault("proxy_rejected", [])
                kept.append(record.model_dump(mode="json"))
            run.trace.metadata["proxy_rejected_count"] = run.rejected
        return error_response(error.status, str(error), code=error.code)

    def _admit(
        self, run: ProxyRun, body: dict[str, Any], dropped: list[str]
    ) -> tuple[_Admitted | None, HTTPResponse | None]:
        """Check the budget and reserve the turn (so concurrent requests count too), and
        the completion tokens it may use (what the budget has left, less other turns'
        reservations)."""
        with run.lock:
            reason = run.trace.error.kind if run.trace.error else None
            message = run.trace.error.message if run.trace.error else ""
            if reason is None:
                exhausted = BudgetClock(run.budget, run.trace).exhausted()
                if exhausted is not None:
                    reason, message = exhausted
                    run.trace.fail(reason, message)
            if reason is not None:
                return None, refused(reason, message)
            if run.in_flight >= self.max_in_flight:
                return None, error_response(
                    429,
                    f"vf-sandbox: at most {self.max_in_flight} model calls of a run at once",
                    kind="rate_limit_exceeded",
                    code="too_many_in_flight",
                )
            notes: list[str] = []
            grant = self._grant(run, body, notes)
            if grant is not None and grant < 1:
                return None, error_response(
                    429,
                    "vf-sandbox: the token budget's remainder is reserved by calls in flight",
                    kind="budget_exceeded",
                    code="budget_tokens",
                )
            recorded, cut = recorded_messages(body["messages"], self.max_recorded_chars)
            if cut:
                notes.append(f"request: {cut} characters of message content not recorded")
            turn = Turn(
                index=len(run.trace.turns),
                started_at=utc_now(),
                request_messages=recorded,
                recorded_by="proxy",
                dropped_params=dropped,
                proxy_notes=notes,
            )
            run.trace.turns.append(turn)
            run.in_flight += 1
            run.reserved_tokens += grant or 0
            return _Admitted(turn, grant), None

    @staticmethod
    def _grant(run: ProxyRun, body: dict[str, Any], notes: list[str]) -> int | None:
        """The completion tokens a forwarding turn may ask for (``None``: no token budget).
        Called under the run's lock."""
        if run.upstream is None or run.budget.max_tokens is None:
            return None
        left = run.budget.max_tokens - run.trace.usage.total_tokens - run.reserved_tokens
        asked = [
            value
            for value in (
                run.upstream.sampling.get(key, body.get(key))
                for key in ("max_tokens", "max_completion_tokens")
            )
            if isinstance(value, int)
        ]
        grant = min([left, *asked])
        if not asked or grant < min(asked):
            notes.append(f"max_tokens clamped to {grant}: what the token budget has left")
        return grant

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

    def _forward(self, run: ProxyRun, admitted: _Admitted, body: dict[str, Any]) -> HTTPResponse:
        upstream = run.upstream
        assert upstream is not None
        turn, grant = admitted.turn, admitted.grant
        payload = dict(body)
        payload["model"] = upstream.model
        payload.update(upstream.sampling)  # the model table's sampling wins
        if grant is not None:
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(payload.get(key), int):
                    payload[key] = min(payload[key], grant)
            if not any(key in payload for key in ("max_tokens", "max_completion_tokens")):
                payload["max_tokens"] = grant
        headers = {"Content-Type": "application/json"}
        if run.upstream_key:
            headers["Authorization"] = f"Bearer {run.upstream_key}"
        started = time.monotonic()
        assert self._http is not None
        try:
            status, content_type, raw = self._post_upstream(upstream, payload, headers)
        except httpx.TimeoutException:
            return self._fail_turn(run, turn, started, 504, "the upstream model timed out")
        except httpx.TransportError as exc:
            return self._fail_turn(
                run, turn, started, 502, f"the upstream model is unreachable: {type(exc).__name__}"
            )
        if raw is None:
            message = f"the upstream model's reply is over {self.max_reply_bytes} bytes"
            return self._fail_turn(run, turn, started, 502, message)
        latency = time.monotonic() - started
        text = redact(raw.decode("utf-8", errors="replace"), run.upstream_key)
        with run.lock:
            turn.latency = latency
            turn.status_code = status
            if 200 <= status < 300:
                text = self._record_reply(run, turn, text, latency, grant)
            else:
                turn.error = f"HTTP {status}: {text[:2000]}"
        return HTTPResponse(status, text.encode("utf-8"), {"Content-Type": content_type})

    def _post_upstream(
        self, upstream: ModelEndpoint, payload: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int, str, bytes | None]:
        """POST to the upstream; its status, content type and body (``None``: over
        ``max_reply_bytes``, reading stopped there).

        Raises:
            httpx.TimeoutException / httpx.TransportError: the upstream failed.
        """
        assert self._http is not None
        request = self._http.build_request(
            "POST",
            upstream.chat_url,
            content=json.dumps(payload).encode("utf-8"),
            headers=headers,
            timeout=upstream.timeout,
        )
        answer = self._http.send(request, stream=True)
        try:
            pieces: list[bytes] = []
            size = 0
            for piece in answer.iter_bytes():
                size += len(piece)
                if size > self.max_reply_bytes:
                    return answer.status_code, "", None
                pieces.append(piece)
        finally:
            answer.close()
        content_type = answer.headers.get("content-type", "application/json")
        return answer.status_code, content_type, b"".join(pieces)

    @staticmethod
    def _record_reply(
        run: ProxyRun, turn: Turn, text: str, latency: float, grant: int | None
    ) -> str:
        """Record a 2xx upstream reply on the turn; the text to send (cut at the token
        grant when the upstream went past it). Called under the run's lock."""
        try:
            completion = json.loads(text)
            reply = parse_chat_completion(completion, latency=latency)
        except (json.JSONDecodeError, ModelResponseError) as exc:
            turn.error = f"malformed upstream reply: {exc}"
            return text
        turn.usage = reply.usage
        if grant is not None and reply.usage.completion_tokens > grant:
            cut_at_budget(completion, grant)
            reply = parse_chat_completion(completion, latency=latency)
            reply.usage = turn.usage
            turn.proxy_notes.append(
                f"reply cut: {turn.usage.completion_tokens} completion tokens, "
                f"{grant} allowed by the token budget"
            )
            run.trace.fail(
                "budget_tokens",
                f"the upstream reply went past the token budget ({turn.usage.completion_tokens} "
                f"completion tokens, {grant} left); the reply was cut",
            )
            text = json.dumps(completion)
        turn.reply = reply
        return text

    @staticmethod
    def _fail_turn(
        run: ProxyRun, turn: Turn, started: float, status: int, message: str
    ) -> HTTPResponse:
        with run.lock:
            turn.latency = time.monotonic() - started
            turn.status_code = status
            turn.error = message
        return error_response(status, message, kind="upstream_error")
