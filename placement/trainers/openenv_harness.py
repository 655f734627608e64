"""Loop-owning OpenEnv sessions over gated sessions: :class:`HarnessSessionFactory`.

A harness (``bash``, ``mini-swe-agent``, any installed agent) runs its own agent loop in a
fresh sandbox; its model calls are parked by the gated proxy and answered in the background
by the trainer's ``generate`` (:class:`~placement.trainers.generation.TransformersGenerator`
on a local model, :class:`~harnesses.trainer.OpenAIGenerator` on vLLM). The sessions satisfy
OpenEnv's runtime-checkable ``LoopOwningSession`` and ``TrainableSession``:
``wait_for_completion``, ``fetch_proxy_trace``, ``fetch_training_trace`` (an OpenEnv
``TrainingTrace``, validated by OpenEnv's own model) and ``verify`` in the agent's own sandbox,
unscored (``env_reward=None``) when anything under the rollout failed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Self, cast

import anyio
from anyio.abc import TaskGroup
from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness.rollout import (
    Message,
    ResourceSession,
    ResourceSessionFactory,
    ToolResult,
    TraceEntry,
    VerifyResult,
)
from openenv.core.harness.training import TrainingTrace, TrainingTurn

from harnesses.base import Budget, Harness, HarnessConfig
from harnesses.errors import SampleError, SessionError, SessionStateError
from harnesses.session import AgentSession, AgentSessionFactory, VerifyFn
from harnesses.trainer import GenerateFn, answer_requests
from runtimes.errors import SandboxError

from .grading import scored, unscored
from .host import RuntimeSpec, SandboxHost
from .openenv import rollout_id_for, task_record

__all__ = ["HarnessSession", "HarnessSessionFactory"]

log = logging.getLogger("placement.trainers")

# ---------------------------------------------------------------------- loop-owning sessions


class _Tasks(AbstractAsyncContextManager[TaskGroup]):
    """A task group held on the host's loop; leaving it cancels what still runs."""

    _group: TaskGroup

    async def __aenter__(self) -> TaskGroup:
        self._group = anyio.create_task_group()
        return await self._group.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        self._group.cancel_scope.cancel()
        return await self._group.__aexit__(exc_type, exc, tb)


class HarnessSession(ResourceSession):  # type: ignore[misc]
    """One gated rollout whose harness owns its agent loop; the trainer's ``generate``
    answers its model calls in the background (made by :class:`HarnessSessionFactory`)."""

    def __init__(self, factory: HarnessSessionFactory, session: AgentSession):
        self._factory = factory
        self.session = session
        self.rollout_id = session.rollout_id
        self._finished = threading.Event()
        self._scope: anyio.CancelScope | None = None
        self.error: BaseException | None = None
        self._result: VerifyResult | None = None
        self._closed = False
        self._lock = threading.Lock()

    async def _drive(self) -> None:
        factory = self._factory
        try:
            with anyio.CancelScope() as self._scope:
                await answer_requests(
                    self.session, factory.generate, factory.sampling, factory.request_timeout
                )
        except Exception as exc:  # noqa: BLE001 - the rollout failed: kept, reported by wait
            self.error = exc
            log.info("rollout %r failed: %r", self.rollout_id, exc)
        finally:
            self._finished.set()

    def wait_for_completion(self, timeout_s: float | None = None) -> int:
        """0 when the agent completed (or its budget truncated it), 1 when it failed.

        Raises:
            TimeoutError: it still runs after ``timeout_s`` seconds.
        """
        if not self._finished.wait(timeout_s):
            raise TimeoutError(f"rollout {self.rollout_id!r} still runs after {timeout_s}s")
        return 0 if self.error is None and self.session.status in ("completed", "truncated") else 1

    def _record_turns(self) -> list[TrainingTurn]:
        record = self._factory.host.call(self._snapshot)
        turns = []
        for turn in record.turns:
            meta = turn.completion.metadata
            prompt, ids, logps = (
                meta.get(k) for k in ("prompt_token_ids", "token_ids", "logprobs")
            )
            if not (isinstance(prompt, list) and isinstance(ids, list) and isinstance(logps, list)):
                raise SampleError(
                    f"turn {turn.index} of rollout {self.rollout_id!r} has no token ids "
                    "(generate must keep prompt_token_ids, token_ids and logprobs)"
                )
            message = (
                record.messages[turn.message_index]
                if turn.message_index is not None
                else turn.completion.assistant_message()
            )
            request = {"messages": record.messages[: turn.prompt_messages], "tools": record.tools}
            turns.append(
                TrainingTurn(
                    node_id=f"{self.rollout_id}:{turn.index}",
                    prompt_token_ids=list(prompt),
                    completion_token_ids=list(ids),
                    per_token_logps=[float(x) for x in logps],
                    loss_mask=[0] * len(prompt) + [1] * len(ids),
                    request=request if record.linear else {"tools": record.tools},
                    response={"choices": [{"message": dict(message)}]},
                    metadata={"rollout_id": self.rollout_id, "turn": turn.index},
                )
            )
        return turns

    async def _snapshot(self) -> Any:
        return self.session.record()

    def fetch_training_trace(self) -> TrainingTrace:
        """One validated turn per delivered completion.

        Raises:
            SampleError: a turn without token ids; ValueError (pydantic): a malformed one.
        """
        return TrainingTrace(turns=self._record_turns())

    def fetch_proxy_trace(self) -> list[TraceEntry]:
        entries = self.fetch_training_trace().to_trace_entries()
        if self._result is not None:
            for entry in entries:
                entry["reward"] = self._result.env_reward
        return cast(list[TraceEntry], entries)

    def initial_messages(self) -> list[Message]:
        prompt = self.session.task["prompt"]
        return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def list_tools(self) -> list[Tool]:
        """The tools the harness offered its model (known once it made a model call)."""
        record = self._factory.host.call(self._snapshot)
        tools = []
        for spec in record.tools or []:
            function = spec.get("function", spec)
            tools.append(
                Tool(
                    name=str(function.get("name", "")),
                    description=str(function.get("description") or ""),
                    input_schema=dict(function.get("parameters") or {}),
                )
            )
        return tools

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Raises: SessionStateError: the loop-owning agent runs its tools itself."""
        raise SessionStateError(
            f"the harness of rollout {self.rollout_id!r} owns its agent loop and runs its "
            "tools itself; nothing calls them from outside",
            rollout_id=self.rollout_id,
        )

    def verify(
        self, transcript: list[Message] | None = None, final_state: Any | None = None
    ) -> VerifyResult:
        """The reward (after the agent finished), computed once; ``env_reward=None``
        (never 0.0) when the session failed, its sandbox died or the verifier failed."""
        self._finished.wait()
        with self._lock:
            if self._result is None:
                self._result = self._verify()
            return self._result

    def _verify(self) -> VerifyResult:
        try:
            verification = self._factory.host.call(self.session.verify)
            graded = scored(verification, self.session.trace)
        except (SessionError, SandboxError) as exc:
            graded = unscored(exc, "verify")
        record = self._factory.host.call(self._snapshot)
        metrics = {**graded.metrics, "status": record.status, "turns": len(record.turns)}
        return VerifyResult(
            env_reward=graded.reward, done=True, metrics=metrics, artifacts=dict(graded.artifacts)
        )

    def close(self) -> None:
        """Stop the answering task and the agent, remove the sandbox; idempotent, never
        raises (a failure is logged)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._factory.host.call(self._aclose)
        except Exception as exc:  # noqa: BLE001 - a dead sandbox or host: nothing to keep
            log.warning("closing rollout %r failed: %r", self.rollout_id, exc)

    async def _aclose(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
        await self.session.close()


class HarnessSessionFactory(ResourceSessionFactory[HarnessSession]):  # type: ignore[misc]
    """Loop-owning OpenEnv sessions over gated sessions
    (:class:`~harnesses.session.AgentSessionFactory`): each ``create`` starts the harness in
    a fresh sandbox and answers its model calls with ``generate`` in the background::

        factory = HarnessSessionFactory("subprocess", {"id": "bash"},
                                        generate=TransformersGenerator(model, tokenizer),
                                        verify=CommandCheck("pytest -q"))
        session = factory.create("Fix the failing test.")
        session.wait_for_completion()
        trace, result = session.fetch_training_trace(), session.verify()

    Args:
        runtime, harness: as :class:`~harnesses.session.AgentSessionFactory`.
        generate: ``async (rollout_id, turn, messages, tools, sampling) -> Completion`` whose
            metadata keeps ``prompt_token_ids``, ``token_ids`` and ``logprobs``.
        verify: the reward function.
        sampling: overrides each request's sampling.
        budget: the agent's budget.
        pool_size, pool_options: a warm pool of sandboxes on the factory's host.
        request_timeout: seconds each model call may take to arrive (``None``: the factory's).
        **options: more :class:`AgentSessionFactory` arguments.
    """

    def __init__(
        self,
        runtime: RuntimeSpec,
        harness: Harness | HarnessConfig | Mapping[str, Any] | str,
        *,
        generate: GenerateFn,
        verify: VerifyFn,
        sampling: Mapping[str, Any] | None = None,
        budget: Budget | None = None,
        pool_size: int = 0,
        pool_options: Mapping[str, Any] | None = None,
        request_timeout: float | None = None,
        **options: Any,
    ):
        self.host = SandboxHost(runtime, pool_size=pool_size, pool_options=pool_options)
        self.generate = generate
        self.sampling = dict(sampling or {})
        self.request_timeout = request_timeout
        self._make: Callable[[], AgentSessionFactory] = lambda: AgentSessionFactory(
            self.host.config,
            harness,
            verify=verify,
            budget=budget,
            pools=[self.host.pool] if self.host.pool is not None else None,
            **options,
        )
        self._make()  # validates the configs now
        self._factory: AgentSessionFactory | None = None
        self._tasks: TaskGroup | None = None
        self._lock = threading.Lock()

    def _open(self) -> tuple[AgentSessionFactory, TaskGroup]:
        with self._lock:
            if self._factory is None or self._tasks is None:
                self.host.start()
                self._factory = self.host.hold(self._make())
                self._tasks = self.host.hold(_Tasks())
            return self._factory, self._tasks

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> HarnessSession:
        """Start one rollout; its model calls are answered in the background.

        Raises:
            SessionProtocolError: a task without a usable prompt, an invalid episode id.
            SessionStartError: the sandbox or the harness could not start (cause chained).
        """
        record = task_record(task)
        factory, tasks = self._open()

        async def start() -> HarnessSession:
            session = HarnessSession(
                self, await factory.create(task=record, rollout_id=rollout_id_for(episode_id))
            )
            tasks.start_soon(session._drive)
            return session

        return self.host.call(start)

    def close(self) -> None:
        """Stop every rollout still running, remove the sandboxes, stop the host."""
        with self._lock:
            self._factory = self._tasks = None
        self.host.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
