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

import enum
import logging
import re
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack, ExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

import anyio
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal, start_blocking_portal

from runtimes import (
    RuntimeConfig,
    resolve_runtime_config,
)
from runtimes.blocking import Blocking
from runtimes.pool import RuntimePool, pool_for
from runtimes.portal import refuse_inside_event_loop

from .agent_session import ROLLOUT_LABEL, AgentSession, SessionOptions
from .base import Budget, Harness, HarnessConfig
from .errors import (
    SessionClosedError,
    SessionProtocolError,
    SessionStateError,
)
from .gate import Completion, InterceptedRequest, call
from .proxy import ModelProxy
from .registry import open_harness
from .rollout import (
    PrepareFn,
    RolloutRecord,
    RolloutTurn,
    Status,
    Verification,
    VerifyContext,
    VerifyFn,
    run_verify,
    task_record,
)

if TYPE_CHECKING:
    from .session_faces import AgentSessionFace, AgentSessionFactoryFace
else:  # at run time the faces' members would hide Blocking's lookup
    AgentSessionFace = AgentSessionFactoryFace = object

__all__ = [
    "ROLLOUT_LABEL",
    "AgentSession",
    "AgentSessionFactory",
    "Completion",
    "FactoryState",
    "InterceptedRequest",
    "PrepareFn",
    "RolloutRecord",
    "RolloutTurn",
    "Status",
    "SyncAgentSession",
    "SyncAgentSessionFactory",
    "Verification",
    "VerifyContext",
    "VerifyFn",
    "call",
    "run_verify",
]

log = logging.getLogger("harnesses.session")

_ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")


class FactoryState(enum.StrEnum):
    """Where an :class:`AgentSessionFactory` is in its life (as a runtime's
    :class:`~runtimes.lifecycle.State`): made, entered, exited."""

    NEW = "new"
    OPEN = "open"
    CLOSED = "closed"


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
        self._options = SessionOptions(
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
        self._state = FactoryState.NEW

    @property
    def state(self) -> FactoryState:
        """Where the factory is in its life: new, open (inside ``async with``), closed."""
        return self._state

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
        if self._state != FactoryState.NEW:
            raise SessionStateError(f"the session factory is {self._state}; make a new one")
        async with AsyncExitStack() as stack:
            self._proxy = ModelProxy(host="127.0.0.1").start()
            stack.callback(self._proxy.stop)
            self._group = await stack.enter_async_context(anyio.create_task_group())
            self._stack = stack.pop_all()
        self._state = FactoryState.OPEN
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = FactoryState.CLOSED
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
        if self._state != FactoryState.OPEN or self._group is None or self._proxy is None:
            raise SessionClosedError(f"the session factory is {self._state}: use `async with`")
        if not _ROLLOUT_ID.fullmatch(rollout_id):
            raise SessionProtocolError(
                f"invalid rollout id {rollout_id!r}: 1-128 letters, digits, '_', '.', ':', '-'"
            )
        if rollout_id in self._sessions:
            raise SessionProtocolError(f"rollout id {rollout_id!r} is already used here")
        session = AgentSession(self._options, self._proxy, rollout_id, task_record(task))
        self._sessions[rollout_id] = session
        try:
            await self._group.start(session.serve)
        except BaseException:
            del self._sessions[rollout_id]
            session.abandon()
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


# ---------------------------------------------------------------------- the blocking facade


class SyncAgentSession(Blocking, AgentSessionFace):
    """:class:`AgentSession` for synchronous code, from :meth:`SyncAgentSessionFactory.create`:
    a :class:`~runtimes.blocking.Blocking` facade, so each coroutine method of the session
    (``next_request(timeout=None) -> InterceptedRequest | None``,
    ``deliver(request, completion)``, ``verify() -> Verification``, ``close()``) blocks
    until it is done and raises what it raises (the typed face:
    :class:`~harnesses.session_faces.AgentSessionFace`), plus
    :class:`~harnesses.errors.SessionClosedError` once the factory has exited; the rest
    (``rollout_id``, ``record() -> RolloutRecord``, ``status``, ...) is the session's own.
    """

    in_loop = frozenset({"record"})

    @property
    def session(self) -> AgentSession:
        """The async session underneath (use it only from the factory's event loop)."""
        session: AgentSession = self._target
        return session

    @property
    def rollout_id(self) -> str:
        return self.session.rollout_id

    def _portal(self, what: str) -> BlockingPortal:
        factory = self._parent
        if not isinstance(factory, SyncAgentSessionFactory) or factory.portal is None:
            raise SessionClosedError(
                "the session factory has exited", rollout_id=self.session.rollout_id
            )
        return super()._portal(what)

    def __enter__(self) -> Self:
        """Nothing to start (``create`` started the session); the block ends with :meth:`close`."""
        return self

    def close(self) -> None:
        """See :meth:`AgentSession.close` (same errors); nothing to do once the factory
        exited (it closed every session)."""
        factory = self._parent
        if isinstance(factory, SyncAgentSessionFactory) and factory.portal is not None:
            self._call(self.session.close)


class SyncAgentSessionFactory(Blocking, AgentSessionFactoryFace):
    """:class:`AgentSessionFactory` for synchronous trainers.

    ``with SyncAgentSessionFactory(runtime, harness, verify=...) as factory:`` starts an
    event loop in a background thread (``anyio.from_thread.start_blocking_portal``,
    ``backend="asyncio"`` or ``"trio"``) and enters the async factory there; leaving the
    block closes every session, then stops the loop and joins its thread. The arguments
    are :class:`AgentSessionFactory`'s. The root of a :class:`~runtimes.blocking.Blocking`
    facade: ``create(*, task, rollout_id) -> SyncAgentSession`` blocks on the async
    ``create`` (same errors; SessionClosedError outside the ``with`` block); ``state``,
    ``harness`` and the rest are the async factory's (the typed face:
    :class:`~harnesses.session_faces.AgentSessionFactoryFace`).
    """

    facades = {AgentSession: SyncAgentSession}

    def __init__(
        self,
        runtime: RuntimeConfig | Mapping[str, Any] | str,
        harness: Harness | HarnessConfig | Mapping[str, Any] | str,
        *,
        backend: str = "asyncio",
        **options: Any,
    ):
        super().__init__(AgentSessionFactory(runtime, harness, **options))
        self._backend = backend
        self._stack: ExitStack | None = None
        self.portal: BlockingPortal | None = None
        """The running portal, inside the ``with`` block."""

    @property
    def factory(self) -> AgentSessionFactory:
        """The async factory underneath (use it only from its event loop)."""
        factory: AgentSessionFactory = self._target
        return factory

    def _portal(self, what: str) -> BlockingPortal:
        refuse_inside_event_loop(what)
        if self.portal is None:
            raise SessionClosedError("the session factory is not open: use `with`")
        return self.portal

    def __enter__(self) -> Self:
        with ExitStack() as stack:
            portal = stack.enter_context(start_blocking_portal(self._backend))
            self.portal = portal
            try:
                super().__enter__()
            except BaseException:
                self.portal = None
                raise
            stack.callback(super().close)
            self._stack = stack.pop_all()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        stack, self._stack, self.portal = self._stack, None, None
        if stack is not None:
            stack.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Leave the ``with`` block's work early: close every session, stop the loop."""
        self.__exit__(None, None, None)
