"""Gated rollouts for online RL: the trainer answers the harness's model calls.

A trainer that must generate every assistant turn itself (to keep the exact token ids and
logprobs) drives a harness through an :class:`AgentSession`. The harness keeps its own
loop in its own sandbox; its model calls go to the interception proxy in gated mode
(:mod:`harnesses.gate`), which parks each one until the trainer answers it::

    async with AgentSessionFactory({"type": "docker", "image": "vf-sandbox/python:latest"},
                                   {"id": "bash"}, verify=my_reward) as factory:
        session = await factory.create(task="Write hello.txt", rollout_id="r-0")
        try:
            while (request := await session.next_request()) is not None:
                text, meta = my_policy.generate(request.messages, request.tools)
                await session.deliver(request, Completion(content=text, metadata=meta))
            await session.verify()
            record = session.record()      # messages, delivered turns, reward, trace
        finally:
            await session.close()

Which harnesses can be gated: every harness whose model calls go through a
:class:`~harnesses.llm.ModelEndpoint` it is given. Host-side harnesses (``bash``,
``null``) call the endpoint the session hands them, which points at the gated proxy on
127.0.0.1 with the session's secret; installed harnesses route their agent's calls
through their own proxy, which forwards to that same endpoint. Either way every call of
the agent reaches the gated proxy, is recorded on :attr:`AgentSession.gate_trace`, and
is handed to the trainer.

The dict-shaped contract works too: a request is also a mapping (``request["messages"]``),
``deliver`` takes a plain string, and :class:`Verification` has ``env_reward``. The trainer
side (N sessions at once, samples with loss masks) is :mod:`harnesses.trainer`.

Failures are typed (:class:`~harnesses.errors.SessionError`): a harness that makes no
call within the request timeout (:class:`~harnesses.errors.SessionRequestTimeout`), a
trainer that does not deliver within the delivery timeout (the agent gets an error reply;
:class:`~harnesses.errors.SessionDeliveryTimeout`), a sandbox that dies
(:class:`~harnesses.errors.SessionSandboxLost`), an agent that fails
(:class:`~harnesses.errors.SessionAgentFailed`). A failure is final: when it is raised,
the agent has been stopped (the runtime killed its processes); ``close()`` then removes
the sandbox.

:class:`SyncAgentSessionFactory` / :class:`SyncAgentSession` are the same contract for
trainers that are not async: an event loop runs in a background thread (anyio's
blocking portal) and every call blocks until it is done.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import logging
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus
from anyio.from_thread import BlockingPortal, start_blocking_portal
from pydantic import BaseModel, Field, PrivateAttr

from runtimes import (
    Runtime,
    RuntimeConfig,
    SandboxTransportError,
    SandboxUnavailableError,
    open_runtime,
    resolve_runtime_config,
)
from runtimes.pool import RuntimePool, pool_for

from .base import Budget, Harness, HarnessConfig, Trace, for_policy
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
    SessionVerifyError,
)
from .gate import Completion, InterceptedRequest, RequestGate, call, resolved_usage
from .llm import Message, ModelEndpoint, Usage
from .proxy import ModelProxy, ProxyRun
from .registry import open_harness

__all__ = [
    "AgentSession",
    "AgentSessionFactory",
    "Completion",
    "InterceptedRequest",
    "RolloutRecord",
    "RolloutTurn",
    "SyncAgentSession",
    "SyncAgentSessionFactory",
    "Verification",
    "VerifyContext",
    "VerifyFn",
    "call",
    "run_verify",
]

log = logging.getLogger("harnesses.session")

ROLLOUT_LABEL = "vf-sandbox.rollout"
_ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")

Status = Literal["running", "completed", "truncated", "failed", "stopped"]
"""``completed``: the agent finished on its own; ``truncated``: its budget ran out;
``failed``: a :class:`~harnesses.errors.SessionError` ended it; ``stopped``: the session was
closed while the agent ran."""


# ---------------------------------------------------------------------- verification


class Verification(BaseModel):
    """The reward the environment computed for a rollout, with whatever explains it.

    ``env_reward`` is the same number under the contract's name."""

    reward: float
    details: dict[str, Any] = Field(default_factory=dict)

    @property
    def env_reward(self) -> float:
        """:attr:`reward`, by the name the harness-rollout contract uses."""
        return self.reward


@dataclass(frozen=True)
class VerifyContext:
    """What a verify function gets: the finished rollout and its still-live sandbox."""

    rollout_id: str
    task: dict[str, Any]
    runtime: Runtime
    trace: Trace
    record: RolloutRecord


VerifyFn = Callable[[VerifyContext], Awaitable[float | Verification]]
"""``async def verify(ctx) -> float | Verification``. It may raise a
:class:`~harnesses.errors.SessionError` of its own; any other exception becomes
:class:`~harnesses.errors.SessionVerifyError` (or ``SessionSandboxLost``)."""

PrepareFn = Callable[[Runtime, dict[str, Any]], Awaitable[None]]
"""``async def prepare(runtime, task)``: set the sandbox up before the agent starts."""


# ---------------------------------------------------------------------- the record


class RolloutTurn(BaseModel):
    """One model call the trainer answered."""

    index: int = Field(description="the turn's index on the gate trace")
    request_id: str
    prompt_messages: int = Field(description="how many messages the request carried")
    message_index: int | None = Field(
        description="where this turn's assistant message sits in RolloutRecord.messages "
        "(None when the harness rewrote its history after this turn)"
    )
    completion: Completion = Field(description="what the trainer delivered, metadata included")
    usage: Usage
    usage_estimated: bool
    latency: float = Field(description="seconds from the call arriving to its delivery")


class RolloutRecord(BaseModel):
    """A rollout at message level, for a trainer to turn into a training sample.

    ``messages`` is the whole conversation as the harness saw it: its last request's
    messages followed by the last delivered assistant message. Each delivered turn names
    the position of its assistant message (``turns[i].message_index``); ``linear`` says
    every request extended the previous one, so one pass over ``messages`` with
    :meth:`delivered_mask` covers every turn.
    """

    rollout_id: str
    task: dict[str, Any]
    status: Status
    stop_reason: str | None = None
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    turns: list[RolloutTurn]
    linear: bool
    reward: float | None = None
    verification: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None
    trace: Trace | None = Field(default=None, description="the harness's own trace")
    gate_trace: Trace = Field(description="what the gated proxy recorded")

    def delivered_mask(self) -> list[bool]:
        """One flag per message: whether it is an assistant message the trainer delivered."""
        marked = {t.message_index for t in self.turns if t.message_index is not None}
        return [index in marked for index in range(len(self.messages))]


@dataclass(frozen=True)
class _Delivered:
    request: InterceptedRequest
    completion: Completion
    usage: Usage
    estimated: bool
    latency: float


def _conversation(delivered: Sequence[_Delivered]) -> tuple[list[Message], list[int | None]]:
    """The full conversation, and where each delivered assistant message sits in it."""
    if not delivered:
        return [], []
    last = delivered[-1]
    messages = [*last.request.messages, last.completion.assistant_message()]
    positions: list[int | None] = []
    for turn in delivered:
        at = len(turn.request.messages)
        fits = (
            at < len(messages)
            and messages[:at] == turn.request.messages
            and messages[at] == turn.completion.assistant_message()
        )
        positions.append(at if fits else None)
    return messages, positions


# ---------------------------------------------------------------------- the session


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
class _Options:
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

    def __init__(self, options: _Options, proxy: ModelProxy, rollout_id: str, task: dict[str, Any]):
        self.rollout_id = rollout_id
        self.task = task
        self._options = options
        self._prompt = _prompt_of(task)
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
        self._delivered: list[_Delivered] = []
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
        request_id = _request_id(request)
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
        self._delivered.append(_Delivered(intercepted, answer, usage, estimated, waited))
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
        messages, positions = _conversation(ordered)
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

    async def _host(self, *, task_status: TaskStatus[None]) -> None:
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
            self._fail(self._error(SessionSandboxLost, error.message, trace._exception))
        else:
            self._fail(
                self._error(SessionAgentFailed, f"{error.kind}: {error.message}", trace._exception)
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

    def _abandon(self) -> None:
        """Unregister from the proxy and refuse calls (idempotent; no sandbox involved)."""
        self._gate.close("the session ended")
        self._proxy_run.close()
        self._requests.close()

    async def _teardown(self, runtime: Runtime | None) -> None:
        self._abandon()
        try:
            if runtime is not None:
                await runtime.close()
        except Exception as exc:  # noqa: BLE001 - re-raised by close(); other sessions go on
            log.warning("closing the sandbox of rollout %r failed: %r", self.rollout_id, exc)
            self._close_error = exc
        finally:
            self._agent_stopped.set()
            self._finished.set()


def _request_id(request: InterceptedRequest | Mapping[str, Any] | str) -> str:
    """The id of a request given as itself, a mapping with ``request_id``, or the id.

    Raises:
        SessionProtocolError: a mapping without a string ``request_id``.
    """
    if isinstance(request, str):
        return request
    if isinstance(request, InterceptedRequest):
        return request.request_id
    request_id = request.get("request_id")
    if not isinstance(request_id, str):
        raise SessionProtocolError("the request to answer has no 'request_id' string")
    return request_id


def _task_record(task: str | Mapping[str, Any]) -> dict[str, Any]:
    """The task as a mapping with a ``prompt``: a non-empty string or a message list.

    Raises:
        SessionProtocolError: no such prompt.
    """
    record = {"prompt": task} if isinstance(task, str) else dict(task)
    prompt = record.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        return record
    if isinstance(prompt, list) and prompt and all(_is_message(m) for m in prompt):
        return record
    raise SessionProtocolError(
        "a task needs a 'prompt': a non-empty string, or a list of messages with a role"
    )


def _is_message(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("role"), str)


def _prompt_of(task: dict[str, Any]) -> str | list[Message]:
    prompt = task["prompt"]
    return prompt if isinstance(prompt, str) else [dict(m) for m in prompt]


# ---------------------------------------------------------------------- the factory


class AgentSessionFactory:
    """Starts gated sessions: one harness, in a fresh sandbox of any backend, per rollout.

    Use it as an async context manager; it owns the gated proxy (on 127.0.0.1) and the
    task group the sessions run in, and closes every session still open when it exits.

    Args:
        runtime: the sandbox config (a model, a dict, or a type name); each session gets a
            fresh sandbox from it, labelled ``vf-sandbox.rollout=<rollout id>``.
        harness: a harness, its config, or ``{"id": ..., ...}``.
        verify: ``async (VerifyContext) -> float | Verification`` (see
            :mod:`placement.verifier` for judges).
        prepare: ``async (runtime, task)``, run before the harness is set up.
        budget: the agent's budget (turns, tokens, wall time), enforced by the harness.
        model: the model name the harness is told.
        request_timeout: seconds :meth:`AgentSession.next_request` waits by default.
        delivery_timeout: seconds a parked request waits for its completion.
        setup_timeout: seconds to start the sandbox, prepare it and set the harness up.
        verify_timeout: seconds the verify function may take (``None``: unlimited).
        stop_grace: seconds an agent answered with an error gets to exit on its own.
        pools: warm pools (:class:`~runtimes.pool.RuntimePool`, entered by the caller in
            the factory's event loop): when one serves ``runtime``, each session takes a
            fresh sandbox from it (labelled ``vf-sandbox.pool=<pool id>``, not with the
            rollout id, which did not exist when it was made) instead of starting one;
            the session still closes it. Judges of a
            :class:`~placement.verifier.JudgeVerifier` take their own ``pools``.
    """

    def __init__(
        self,
        runtime: RuntimeConfig | Mapping[str, Any] | str,
        harness: Harness | HarnessConfig | Mapping[str, Any] | str,
        *,
        verify: VerifyFn | None = None,
        prepare: PrepareFn | None = None,
        budget: Budget | None = None,
        model: str = "policy",
        request_timeout: float = 300.0,
        delivery_timeout: float = 600.0,
        setup_timeout: float = 600.0,
        verify_timeout: float | None = 900.0,
        stop_grace: float = 5.0,
        pools: Sequence[RuntimePool] | None = None,
    ):
        """Validate the configs; nothing starts before ``async with``.

        Raises:
            RuntimeConfigError / UnknownRuntimeError: an invalid runtime config.
            HarnessConfigError / UnknownHarnessError: an invalid harness config.
            SessionProtocolError: a timeout that is not positive.
        """
        timeouts = {
            "request_timeout": request_timeout,
            "delivery_timeout": delivery_timeout,
            "setup_timeout": setup_timeout,
            "verify_timeout": verify_timeout,
        }
        for name, value in timeouts.items():
            if value is not None and value <= 0:
                raise SessionProtocolError(f"{name} must be > 0, got {value}")
        if stop_grace < 0:
            raise SessionProtocolError(f"stop_grace must be >= 0, got {stop_grace}")
        config = resolve_runtime_config(runtime)
        self._options = _Options(
            runtime=config,
            pool=pool_for(pools, config),
            harness=harness if isinstance(harness, Harness) else _open_harness(harness),
            verify=verify,
            prepare=prepare,
            budget=budget or Budget(),
            model=model,
            request_timeout=request_timeout,
            delivery_timeout=delivery_timeout,
            setup_timeout=setup_timeout,
            verify_timeout=verify_timeout,
            stop_grace=stop_grace,
        )
        self._sessions: dict[str, AgentSession] = {}
        self._stack: AsyncExitStack | None = None
        self._group: TaskGroup | None = None
        self._proxy: ModelProxy | None = None
        self._state: Literal["new", "open", "closed"] = "new"

    @property
    def harness(self) -> Harness:
        return self._options.harness

    @property
    def runtime_config(self) -> RuntimeConfig:
        return self._options.runtime

    @property
    def has_verify(self) -> bool:
        """Whether sessions can :meth:`AgentSession.verify` (a verify function was given)."""
        return self._options.verify is not None

    def sessions(self) -> list[AgentSession]:
        """The sessions created and not yet closed."""
        return [s for s in self._sessions.values() if not s.closed]

    async def __aenter__(self) -> Self:
        """Start the gated proxy and the sessions' task group.

        Raises:
            SessionStateError: the factory was already entered.
            ProxyRouteError: the proxy cannot listen on 127.0.0.1.
        """
        if self._state != "new":
            raise SessionStateError(f"the session factory is {self._state}; make a new one")
        async with AsyncExitStack() as stack:
            self._proxy = ModelProxy(host="127.0.0.1").start()
            stack.callback(self._proxy.stop)
            self._group = await stack.enter_async_context(anyio.create_task_group())
            self._stack = stack.pop_all()
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = "closed"
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as closing:
                for session in self.sessions():
                    closing.start_soon(_close_logging, session)
        assert self._stack is not None
        # No session task is left, so the group exits cleanly; the body's own exception is
        # not handed to it, or it would come out wrapped in an ExceptionGroup.
        await self._stack.__aexit__(None, None, None)

    async def create(self, *, task: str | Mapping[str, Any], rollout_id: str) -> AgentSession:
        """Start one session: a fresh sandbox, the harness set up in it, the agent running.

        ``task`` is the prompt (a string) or a mapping with a ``prompt`` (a string or a
        message list) plus anything a verify function or judge should see.

        Raises:
            SessionProtocolError: an invalid or already used ``rollout_id``, or a task
                without a prompt.
            SessionStartError: the sandbox or the harness could not be started (the
                cause, e.g. a ``ProvisioningError``, is chained).
            SessionClosedError: the factory is not open.
        """
        if self._state != "open" or self._group is None or self._proxy is None:
            raise SessionClosedError(f"the session factory is {self._state}: use `async with`")
        if not _ROLLOUT_ID.fullmatch(rollout_id):
            raise SessionProtocolError(
                f"invalid rollout id {rollout_id!r}: 1-128 letters, digits, '_', '.', ':', '-'"
            )
        if rollout_id in self._sessions:
            raise SessionProtocolError(f"rollout id {rollout_id!r} is already used here")
        session = AgentSession(self._options, self._proxy, rollout_id, _task_record(task))
        self._sessions[rollout_id] = session
        try:
            await self._group.start(session._host)
        except BaseException:
            del self._sessions[rollout_id]
            session._abandon()
            raise
        return session


def _open_harness(spec: HarnessConfig | Mapping[str, Any] | str) -> Harness:
    if isinstance(spec, str):
        return open_harness({"id": spec})
    return open_harness(spec)


async def _close_logging(session: AgentSession) -> None:
    try:
        await session.close()
    except Exception as exc:  # noqa: BLE001 - logged; the factory closes the others regardless
        log.warning("closing rollout %r failed: %r", session.rollout_id, exc)


async def run_verify(
    verify: VerifyFn, context: VerifyContext, timeout: float | None = None
) -> Verification:
    """``verify(context)`` within ``timeout`` seconds, its failures typed: what a session's
    :meth:`AgentSession.verify` runs, and what trainer adapters run on a sandbox of their own.

    Raises:
        SessionVerifyError: the function failed (cause chained) or took longer than ``timeout``.
        SessionSandboxLost: the sandbox died or its channel failed while verifying.
        SessionError: one the function raised itself, as it is.
    """
    rollout_id = context.rollout_id
    try:
        with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
            result = await verify(context)
    except SessionError:
        raise
    except (SandboxUnavailableError, SandboxTransportError) as exc:
        raise SessionSandboxLost(
            f"the sandbox failed while verifying: {exc}", rollout_id=rollout_id
        ) from exc
    except Exception as exc:
        raise SessionVerifyError(
            f"verification failed: {type(exc).__name__}: {exc}", rollout_id=rollout_id
        ) from exc
    if scope.cancelled_caught:
        raise SessionVerifyError(f"verification took longer than {timeout}s", rollout_id=rollout_id)
    return result if isinstance(result, Verification) else Verification(reward=float(result))


# ---------------------------------------------------------------------- sync wrappers


class SyncAgentSession:
    """:class:`AgentSession` for synchronous code: each call blocks until it is done.

    Made by :meth:`SyncAgentSessionFactory.create`; the errors are the async session's,
    plus :class:`~harnesses.errors.SessionClosedError` once the factory has exited.
    """

    def __init__(self, session: AgentSession, factory: SyncAgentSessionFactory):
        self._session = session
        self._factory = factory

    def _call(self, func: Callable[..., Any], *args: Any) -> Any:
        portal = self._factory._portal
        if portal is None:
            raise SessionClosedError(
                "the session factory has exited", rollout_id=self._session.rollout_id
            )
        return portal.call(func, *args)

    @property
    def rollout_id(self) -> str:
        return self._session.rollout_id

    @property
    def session(self) -> AgentSession:
        """The async session underneath (use it only from the factory's event loop)."""
        return self._session

    def next_request(self, timeout: float | None = None) -> InterceptedRequest | None:
        """See :meth:`AgentSession.next_request` (same errors)."""
        request: InterceptedRequest | None = self._call(self._session.next_request, timeout)
        return request

    def deliver(
        self,
        request: InterceptedRequest | Mapping[str, Any] | str,
        completion: Completion | str | Mapping[str, Any],
    ) -> None:
        """See :meth:`AgentSession.deliver` (same errors)."""
        self._call(self._session.deliver, request, completion)

    def verify(self) -> Verification:
        """See :meth:`AgentSession.verify` (same errors)."""
        verification: Verification = self._call(self._session.verify)
        return verification

    def record(self) -> RolloutRecord:
        """See :meth:`AgentSession.record`."""
        record: RolloutRecord = self._call(self._session.record)
        return record

    def close(self) -> None:
        """See :meth:`AgentSession.close` (same errors); nothing to do once the factory
        exited (it closed every session)."""
        if self._factory._portal is not None:
            self._call(self._session.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class SyncAgentSessionFactory:
    """:class:`AgentSessionFactory` for synchronous trainers.

    ``with SyncAgentSessionFactory(runtime, harness, verify=...) as factory:`` starts an
    event loop in a background thread (``anyio.from_thread.start_blocking_portal``,
    ``backend="asyncio"`` or ``"trio"``) and enters the async factory there; leaving the
    block closes every session, then stops the loop and joins its thread. The arguments
    are :class:`AgentSessionFactory`'s.
    """

    def __init__(
        self,
        runtime: RuntimeConfig | Mapping[str, Any] | str,
        harness: Harness | HarnessConfig | Mapping[str, Any] | str,
        *,
        backend: str = "asyncio",
        **options: Any,
    ):
        self._factory = AgentSessionFactory(runtime, harness, **options)
        self._backend = backend
        self._stack: ExitStack | None = None
        self._portal: BlockingPortal | None = None

    def __enter__(self) -> Self:
        with ExitStack() as stack:
            portal = stack.enter_context(start_blocking_portal(self._backend))
            stack.enter_context(portal.wrap_async_context_manager(self._factory))
            self._portal = portal
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack, self._portal = self._stack, None, None
        if stack is not None:
            stack.__exit__(exc_type, exc, tb)

    def create(self, *, task: str | Mapping[str, Any], rollout_id: str) -> SyncAgentSession:
        """See :meth:`AgentSessionFactory.create` (same errors).

        Raises:
            SessionClosedError: the factory is not open (use ``with``).
        """
        if self._portal is None:
            raise SessionClosedError("the session factory is not open: use `with`")

        async def create() -> AgentSession:
            return await self._factory.create(task=task, rollout_id=rollout_id)

        return SyncAgentSession(self._portal.call(create), self)
