"""One gated rollout while it runs: :class:`AgentSession` (a harness in its own sandbox,
its model calls parked by the gate until the trainer answers them). Made by
:class:`~harnesses.session.AgentSessionFactory`, which hands it its
:class:`SessionOptions` and runs :meth:`AgentSession.serve` in its task group; the
contract is described in :mod:`harnesses.session`."""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus
from pydantic import PrivateAttr

from runtimes import (
    Runtime,
    RuntimeConfig,
    SandboxTransportError,
    SandboxUnavailableError,
    open_runtime,
)
from runtimes.pool import RuntimePool

from .base import Budget, Harness, Trace, for_policy
from .errors import (
    SessionAgentFailed,
    SessionClosedError,
    SessionDeliveryTimeout,
    SessionError,
    SessionProtocolError,
    SessionRequestTimeout,
    SessionSandboxLost,
    SessionStartError,
    SessionStateError,
)
from .gate import Completion, InterceptedRequest, RequestGate, resolved_usage
from .llm import ModelEndpoint
from .proxy import ModelProxy, ProxyRun
from .rollout import (
    Delivered,
    PrepareFn,
    RolloutRecord,
    RolloutTurn,
    Status,
    Verification,
    VerifyContext,
    VerifyFn,
    conversation,
    prompt_of,
    request_id_of,
    run_verify,
)

__all__ = ["ROLLOUT_LABEL", "AgentSession", "SessionOptions"]

log = logging.getLogger("harnesses.session")

ROLLOUT_LABEL = "vf-sandbox.rollout"


class _SessionEndpoint(ModelEndpoint):
    """The gated proxy as the harness's model: the session's secret is its API key, held
    here (never in the environment) and never shown in a repr."""

    _secret: str = PrivateAttr(default="")

    def resolve_api_key(self) -> str | None:
        return self._secret


class _Listener:
    """The gate's callbacks, run in the session's event loop."""

    def __init__(self, session: AgentSession):
        self._session = session

    def request_parked(self, request: InterceptedRequest) -> None:
        self._session._requests.send_nowait(request)

    def request_expired(self, request: InterceptedRequest, timeout: float) -> None:
        self._session._fail(
            SessionDeliveryTimeout(
                f"request {request.request_id} (turn {request.turn}) got no completion "
                f"within {timeout}s; the agent was answered with an error",
                rollout_id=self._session.rollout_id,
            ),
            grace=self._session._options.stop_grace,
        )


class _Wake:
    """Wakes a waiting :meth:`AgentSession.next_request`: the agent stopped or failed."""


@dataclass(frozen=True)
class SessionOptions:
    runtime: RuntimeConfig
    pool: RuntimePool | None
    harness: Harness
    verify: VerifyFn | None
    prepare: PrepareFn | None
    budget: Budget
    model: str
    request_timeout: float
    delivery_timeout: float
    setup_timeout: float
    verify_timeout: float | None
    stop_grace: float


class AgentSession:
    """One rollout: a harness running in its own sandbox, its model calls answered by you.

    Made by :meth:`AgentSessionFactory.create`. Call :meth:`next_request` until it returns
    ``None`` (the agent exited), answering each request with :meth:`deliver`; then
    :meth:`verify` for the reward, :meth:`record` for the sample, :meth:`close` (also on
    error). Use it from the event loop that runs its factory; one consumer at a time.
    """

    def __init__(
        self, options: SessionOptions, proxy: ModelProxy, rollout_id: str, task: dict[str, Any]
    ):
        self.rollout_id = rollout_id
        self.task = task
        self._options = options
        self._prompt = prompt_of(task)
        self._requests, self._inbox = anyio.create_memory_object_stream[InterceptedRequest | _Wake](
            max_buffer_size=math.inf
        )
        self._gate = RequestGate(_Listener(self), delivery_timeout=options.delivery_timeout)
        self.gate_trace = Trace(harness=options.harness.id, model=options.model)
        self._proxy_run: ProxyRun = proxy.open_gated_run(
            self._gate, self.gate_trace, model=options.model
        )
        self._endpoint = _SessionEndpoint(
            base_url=proxy.base_url,
            model=options.model,
            timeout=options.delivery_timeout + 30,
            max_retries=0,
        )
        self._endpoint._secret = self._proxy_run.secret
        self._runtime: Runtime | None = None
        self._harness: Harness | None = None
        """The harness this rollout runs: the factory's, as the sandbox's policy user."""
        self._trace: Trace | None = None
        self._delivered: list[Delivered] = []
        self._failure: SessionError | None = None
        self._stop_reason: str | None = None
        self._agent_scope: anyio.CancelScope | None = None
        self._agent_stopped = anyio.Event()
        self._closing = anyio.Event()
        self._finished = anyio.Event()
        self._closed = False
        self._close_error: Exception | None = None
        self._verification: Verification | None = None
        self._verify_error: SessionError | None = None
        self._verify_lock = anyio.Lock()

    def __repr__(self) -> str:
        return f"AgentSession({self.rollout_id!r}, status={self.status!r})"

    # ------------------------------------------------------------------ state

    @property
    def status(self) -> Status:
        if self._failure is not None:
            return "failed"
        if not self._agent_stopped.is_set():
            return "running"
        if self._stop_reason in ("completed", "closed"):
            return "completed" if self._stop_reason == "completed" else "stopped"
        return "truncated"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def runtime(self) -> Runtime:
        """The session's sandbox (open until :meth:`close`).

        Raises:
            SessionClosedError: the session is closed.
        """
        if self._closed or self._runtime is None:
            raise SessionClosedError("the session is closed", rollout_id=self.rollout_id)
        return self._runtime

    @property
    def trace(self) -> Trace | None:
        """The harness's own trace, once the agent exited (``None`` if it was stopped)."""
        return self._trace

    @property
    def failure(self) -> SessionError | None:
        return self._failure

    # ------------------------------------------------------------------ the contract

    async def next_request(self, timeout: float | None = None) -> InterceptedRequest | None:
        """The agent's next model call, or ``None`` once the agent exited.

        The request is also a read-only mapping (``req["messages"]``, ``req["tools"]``,
        ``req["request_id"]``, ``dict(req)``), as the dict-shaped contract has it.

        ``timeout`` (default: the factory's ``request_timeout``) bounds the wait for the
        agent to call or exit; running out of it fails the session.

        Raises:
            SessionRequestTimeout: the agent neither called nor exited in time.
            SessionDeliveryTimeout: an earlier request was not delivered in time.
            SessionAgentFailed: the agent or harness failed.
            SessionSandboxLost: the sandbox died or its channel failed.
            SessionClosedError: the session is closed.
            SessionProtocolError: ``timeout`` is not positive.
        """
        if timeout is not None and timeout <= 0:
            raise SessionProtocolError(f"timeout must be > 0, got {timeout}")
        await self._raise_if_unusable()
        wait = self._options.request_timeout if timeout is None else timeout
        with anyio.move_on_after(wait):
            while not self._agent_stopped.is_set():
                try:
                    item = await self._inbox.receive()
                except anyio.EndOfStream:
                    break
                if isinstance(item, InterceptedRequest):
                    return item.model_copy(deep=True)  # the record keeps the original
                await self._raise_if_unusable()
            await self._raise_if_unusable()
            return None
        self._fail(
            SessionRequestTimeout(
                f"the agent made no model call and did not exit within {wait}s",
                rollout_id=self.rollout_id,
            )
        )
        await self._raise_if_unusable()
        return None  # the agent exited just as the wait ran out

    async def deliver(
        self,
        request: InterceptedRequest | Mapping[str, Any] | str,
        completion: Completion | str | Mapping[str, Any],
    ) -> None:
        """Answer ``request`` with ``completion``: text, tool calls, or both.

        ``request`` is what :meth:`next_request` returned, any mapping with its
        ``request_id`` (``dict(request)``), or the id itself; ``completion`` a
        :class:`Completion`, the completion's text, or a dict of its fields.

        The harness receives it as an OpenAI chat completion. ``completion.usage`` is
        reported as given (estimated when missing); ``completion.metadata`` is kept for
        the record only.

        Raises:
            SessionProtocolError: an invalid completion, or a request that is unknown or
                already answered.
            SessionDeliveryTimeout: the request waited longer than the delivery timeout
                (the agent got an error; the session failed).
            SessionAgentFailed / SessionSandboxLost / SessionRequestTimeout: the session
                failed earlier.
            SessionClosedError: the session is closed.
        """
        await self._raise_if_unusable()
        request_id = request_id_of(request)
        answer = Completion.coerce(completion)
        try:
            intercepted = self._gate.deliver(request_id, answer)
        except SessionDeliveryTimeout as exc:
            late = SessionDeliveryTimeout(str(exc), rollout_id=self.rollout_id)
            self._fail(late, grace=self._options.stop_grace)
            await self._raise_if_unusable()
            raise late from None
        usage, estimated = resolved_usage(intercepted, answer)
        waited = (_dt.datetime.now(_dt.UTC) - intercepted.received_at).total_seconds()
        self._delivered.append(Delivered(intercepted, answer, usage, estimated, waited))
        await anyio.lowlevel.checkpoint()

    async def verify(self) -> Verification:
        """The reward of the finished rollout, from the factory's verify function (for
        example judges run in this sandbox). Computed once; later calls return it.

        Raises:
            SessionStateError: the agent is still running, or the factory has no verify
                function.
            SessionVerifyError: the verify function failed or timed out (cause chained).
            SessionSandboxLost: the sandbox died while verifying.
            SessionAgentFailed / SessionDeliveryTimeout / SessionRequestTimeout: the
                session failed; there is no reward to compute.
            SessionClosedError: the session is closed.
        """
        await self._raise_if_unusable()
        if not self._agent_stopped.is_set():
            raise SessionStateError(
                "the agent is still running: call next_request() until it returns None",
                rollout_id=self.rollout_id,
            )
        verify = self._options.verify
        if verify is None:
            raise SessionStateError(
                "the factory has no verify function", rollout_id=self.rollout_id
            )
        async with self._verify_lock:
            if self._verification is None:
                try:
                    self._verification = await self._run_verify(verify)
                except SessionError as exc:
                    self._verify_error = exc
                    raise
            return self._verification

    def record(self) -> RolloutRecord:
        """The rollout so far, at message level (see :class:`RolloutRecord`): a snapshot,
        later turns do not change it."""
        ordered = sorted(self._delivered, key=lambda d: d.request.turn)
        messages, positions = conversation(ordered)
        turns = [
            RolloutTurn(
                index=d.request.turn,
                request_id=d.request.request_id,
                prompt_messages=len(d.request.messages),
                message_index=position,
                completion=d.completion.model_copy(deep=True),
                usage=d.usage,
                usage_estimated=d.estimated,
                latency=d.latency,
            )
            for d, position in zip(ordered, positions, strict=True)
        ]
        error = self._failure or self._verify_error
        return RolloutRecord(
            rollout_id=self.rollout_id,
            task=self.task,
            status=self.status,
            stop_reason=type(self._failure).__name__ if self._failure else self._stop_reason,
            messages=messages,
            tools=ordered[-1].request.tools if ordered else None,
            turns=turns,
            linear=all(p is not None for p in positions),
            reward=self._verification.reward if self._verification else None,
            verification=self._verification.details if self._verification else None,
            error=str(error) if error else None,
            error_type=type(error).__name__ if error else None,
            trace=self._trace.model_copy(deep=True) if self._trace else None,
            gate_trace=self._gate_trace_snapshot(),
        )

    def _gate_trace_snapshot(self) -> Trace:
        with self._proxy_run.lock:  # the proxy's threads record onto it
            return self.gate_trace.model_copy(deep=True)

    async def close(self) -> None:
        """Stop the agent (its processes are killed), unregister the proxy route and remove
        the sandbox. Idempotent and shielded from cancellation.

        Raises:
            SandboxTransportError: the backend could not confirm the sandbox is gone
                (it is left to ``vf-sandbox cleanup``), or whatever else the backend's
                ``close`` raised; raised by the first call only.
        """
        with anyio.CancelScope(shield=True):
            if not self._closed:
                self._closed = True
                self._gate.close("the session was closed")
                if self._agent_scope is not None:
                    self._agent_scope.cancel()
                self._closing.set()
            await self._finished.wait()
        error, self._close_error = self._close_error, None
        if error is not None:
            raise error

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ internals

    async def _raise_if_unusable(self) -> None:
        if self._closed:
            raise SessionClosedError("the session is closed", rollout_id=self.rollout_id)
        if self._failure is not None:
            # Nothing of the agent is left running once its failure surfaces.
            await self._agent_stopped.wait()
            raise self._failure

    def _fail(self, error: SessionError, *, grace: float = 0.0) -> None:
        """Record the session's failure (the first one wins) and stop the agent, at once or
        after ``grace`` seconds (time to react to an error reply and exit on its own)."""
        if self._failure is not None or self._stop_reason is not None:
            return
        self._failure = error
        if self._agent_scope is not None:
            self._agent_scope.deadline = min(
                self._agent_scope.deadline, anyio.current_time() + grace
            )
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._requests.send_nowait(_Wake())

    async def serve(self, *, task_status: TaskStatus[None]) -> None:
        """The session's task in its factory's task group: start the sandbox and harness,
        run the agent, keep the sandbox until :meth:`close`, then tear everything down."""
        try:
            runtime = await self._start()
            task_status.started()
            await self._run_agent(runtime)
            await self._closing.wait()
        finally:
            with anyio.CancelScope(shield=True):
                await self._teardown(self._runtime)

    def _runtime_config(self) -> RuntimeConfig:
        config = self._options.runtime
        labels = {**config.labels, ROLLOUT_LABEL: self.rollout_id}
        return config.model_copy(update={"labels": labels})

    async def _start(self) -> Runtime:
        limit = self._options.setup_timeout
        try:
            with anyio.fail_after(limit):
                runtime = await self._open_runtime()
                if self._options.prepare is not None:
                    await self._options.prepare(runtime, self.task)
                self._harness = for_policy(self._options.harness, runtime)
                await self._harness.setup(runtime)
                return runtime
        except TimeoutError as exc:
            raise SessionStartError(
                f"starting the sandbox and harness took longer than {limit}s: {exc}",
                rollout_id=self.rollout_id,
            ) from exc
        except Exception as exc:
            raise SessionStartError(
                f"could not start: {type(exc).__name__}: {exc}", rollout_id=self.rollout_id
            ) from exc

    async def _open_runtime(self) -> Runtime:
        """The session's started sandbox, kept as ``self._runtime`` (torn down with the
        session) as soon as it exists: the factory's pool's, else a new one labelled with
        the rollout id (a pooled one was made before the id was known: it carries the
        pool's label instead)."""
        pool = self._options.pool
        if pool is not None:
            self._runtime = await pool.take()
            return self._runtime
        runtime = self._runtime = open_runtime(self._runtime_config())
        await runtime.start()
        return runtime

    async def _run_agent(self, runtime: Runtime) -> None:
        harness = self._harness or self._options.harness
        with anyio.CancelScope() as scope:
            self._agent_scope = scope
            if self._closed or self._failure is not None:
                scope.cancel()  # closed while it was starting: never run the agent
            try:
                trace = await harness.run(
                    self._prompt, runtime=runtime, model=self._endpoint, budget=self._options.budget
                )
            except (SandboxUnavailableError, SandboxTransportError) as exc:
                self._fail(self._error(SessionSandboxLost, f"the sandbox failed: {exc}", exc))
            except Exception as exc:  # noqa: BLE001 - a harness bug fails only its session
                self._fail(self._error(SessionAgentFailed, f"the harness raised: {exc!r}", exc))
            else:
                self._trace = trace
                self._agent_exited(trace)
        if scope.cancelled_caught and self._failure is None:
            self._stop_reason = "closed"
        self._agent_scope = None
        self._agent_stopped.set()
        self._wake()

    def _agent_exited(self, trace: Trace) -> None:
        error = trace.error
        if error is None:
            self._stop_reason = "completed"
        elif error.kind.startswith("budget_"):
            self._stop_reason = error.kind
        elif error.kind == "sandbox_error":
            self._fail(self._error(SessionSandboxLost, error.message, trace.exception))
        else:
            self._fail(
                self._error(SessionAgentFailed, f"{error.kind}: {error.message}", trace.exception)
            )

    def _error(
        self, kind: type[SessionError], message: str, cause: BaseException | None
    ) -> SessionError:
        error = kind(message, rollout_id=self.rollout_id)
        error.__cause__ = cause
        return error

    async def _run_verify(self, verify: VerifyFn) -> Verification:
        assert self._runtime is not None
        trace = self._trace or self.gate_trace
        context = VerifyContext(self.rollout_id, self.task, self._runtime, trace, self.record())
        return await run_verify(verify, context, self._options.verify_timeout)

    def abandon(self) -> None:
        """Unregister from the proxy and refuse calls (idempotent; no sandbox involved)."""
        self._gate.close("the session ended")
        self._proxy_run.close()
        self._requests.close()

    async def _teardown(self, runtime: Runtime | None) -> None:
        self.abandon()
        try:
            if runtime is not None:
                await runtime.close()
        except Exception as exc:  # noqa: BLE001 - re-raised by close(); other sessions go on
            log.warning("closing the sandbox of rollout %r failed: %r", self.rollout_id, exc)
            self._close_error = exc
        finally:
            self._agent_stopped.set()
            self._finished.set()
