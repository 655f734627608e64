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

Streaming (``"stream": true``) is refused with a 400 naming the reason: the trace
records whole replies.

**Gated mode** (:meth:`ModelProxy.open_gated_run`, for online RL): instead of forwarding,
the proxy parks each request in a :class:`~harnesses.gate.RequestGate` and answers the
harness with the completion the caller delivers (an OpenAI-shaped chat completion, usage
as given or estimated); the turn is recorded on the run's trace as usual. A request left
undelivered past the gate's delivery timeout is answered ``504`` (``gate_timeout``,
``x-should-retry: false``) and fails the run; later requests are refused. A closed gate
answers ``503``. :mod:`harnesses.session` builds the trainer-facing contract on it.

The server is a thread (:mod:`harnesses._http`), so it serves whatever event loop the
caller runs. Where it binds, and the URL the sandbox uses, depend on the backend
(:func:`route_to_host`): ``127.0.0.1`` for sandboxes sharing the host's network (the
subprocess runtime, Docker with ``network="host"``); the bridge gateway for Docker
containers on a bridge network; ``127.0.0.1`` plus a reverse forward
(``runtime.forward_remote``) for SSH; for Modal or any sandbox without a route to the
host the user exposes the proxy (a tunnel) and passes its URL.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

import httpx

from runtimes import Runtime

from ._http import HTTPRequest, HTTPResponse, LocalHTTPServer, error_response, json_response
from .base import Budget, BudgetClock, Trace, Turn, utc_now
from .errors import ModelResponseError, ProxyRouteError
from .gate import RequestGate
from .models import ModelEndpoint, parse_chat_completion, redact

__all__ = [
    "BUDGET_EXCEEDED_STATUS",
    "ModelProxy",
    "ProxyRoute",
    "ProxyRun",
    "SupportsRemoteForward",
    "route_to_host",
    "sandbox_default_gateway",
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
        if body.get("stream"):
            return error_response(
                400, "the vf-sandbox model proxy does not stream: send 'stream': false"
            )
        turn, refusal = self._admit(run, body)
        if refusal is not None:
            return refusal
        assert turn is not None
        if run.gate is not None:
            return self._answer_gated(run, run.gate, turn, body)
        return self._forward(run, turn, body)

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


def _model_card(model: str) -> dict[str, Any]:
    return {"id": model, "object": "model", "owned_by": "vf-sandbox-proxy"}


# ---------------------------------------------------------------------- routing


@runtime_checkable
class SupportsRemoteForward(Protocol):
    """Runtimes (SSH) that can make a host port reachable inside the sandbox."""

    async def forward_remote(self, local_port: int) -> int: ...


@dataclass
class ProxyRoute:
    """Where the proxy listens on the host, and how the sandbox reaches it.

    ``via`` is ``"loopback"`` (shared network namespace), ``"gateway"`` (the sandbox's
    default gateway is this host, e.g. a Docker bridge), ``"forward"`` (a reverse port
    forward, e.g. SSH) or ``"url"`` (a URL the user exposed, e.g. a tunnel for Modal).
    """

    bind_host: str
    via: str
    sandbox_host: str | None = None
    url: str | None = None
    forwarded_port: int | None = None

    async def sandbox_base_url(self, runtime: Runtime, proxy: ModelProxy) -> str:
        """The proxy's base URL as seen from inside the sandbox.

        Raises:
            SandboxError: the reverse forward was refused (SSH).
        """
        if self.url is not None:
            return self.url.rstrip("/")
        if self.via == "forward":
            assert isinstance(runtime, SupportsRemoteForward)
            self.forwarded_port = await runtime.forward_remote(proxy.port)
            return f"http://127.0.0.1:{self.forwarded_port}/v1"
        return f"http://{self.sandbox_host}:{proxy.port}/v1"

    async def release(self, runtime: Runtime) -> None:
        """Undo what :meth:`sandbox_base_url` set up (the SSH reverse forward).

        Raises:
            SandboxError: the sandbox failed while cancelling the forward.
        """
        port, self.forwarded_port = self.forwarded_port, None
        cancel = getattr(runtime, "cancel_forward_remote", None)
        if port is not None and cancel is not None and not runtime.closed:
            await cancel(port)


async def route_to_host(
    runtime: Runtime, *, proxy_url: str | None = None, bind_host: str | None = None
) -> ProxyRoute:
    """How a process in ``runtime`` can reach a proxy on this host.

    ``proxy_url`` (a URL the user made reachable from the sandbox, e.g. a tunnel) and
    ``bind_host`` override the choice.

    Raises:
        ProxyRouteError: the sandbox has no route to the host (a container with
            ``network="none"``, a remote sandbox without a forward); the message says
            what to configure.
        SandboxError: probing the sandbox failed.
    """
    if proxy_url is not None:
        return ProxyRoute(bind_host=bind_host or "127.0.0.1", via="url", url=proxy_url)
    if runtime.config.is_local():
        host = bind_host or "127.0.0.1"
        return ProxyRoute(bind_host=host, via="loopback", sandbox_host=host)
    if isinstance(runtime, SupportsRemoteForward):
        return ProxyRoute(bind_host=bind_host or "127.0.0.1", via="forward")
    gateway = await sandbox_default_gateway(runtime)
    if gateway is None:
        raise ProxyRouteError(
            f"{runtime.describe()} has no network route to the host, so an agent inside it "
            f"cannot reach the model proxy. Give the sandbox a network (Docker: "
            f"network='bridge'), or expose the proxy yourself and pass proxy_url"
        )
    if not _is_local_address(gateway):
        raise ProxyRouteError(
            f"{runtime.describe()} routes through {gateway}, which is not an address of this "
            f"host: expose the model proxy to the sandbox (a tunnel) and pass proxy_url"
        )
    return ProxyRoute(bind_host=bind_host or gateway, via="gateway", sandbox_host=gateway)


async def sandbox_default_gateway(runtime: Runtime) -> str | None:
    """The IPv4 default gateway inside a Linux sandbox (from ``/proc/net/route``), or ``None``.

    Raises:
        SandboxError: the sandbox failed (typed, from :mod:`runtimes.errors`).
    """
    table = await runtime.exec(["cat", "/proc/net/route"], timeout=30)
    if table.exit_code != 0:
        return None
    return _gateway_from_route_table(table.stdout)


def _gateway_from_route_table(text: str) -> str | None:
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[1] == "00000000" and fields[2] != "00000000":
            raw = bytes.fromhex(fields[2])
            return ".".join(str(b) for b in reversed(raw))
    return None


def _is_local_address(address: str) -> bool:
    """Whether ``address`` belongs to an interface of this host (it can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True
