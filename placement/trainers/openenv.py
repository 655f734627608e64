"""vf-sandbox sandboxes under OpenEnv's harness contracts.

- :class:`SandboxSessionFactory` / :class:`SandboxSession`: OpenEnv's
  ``ResourceSessionFactory`` / ``ResourceSession`` (the white-box path: the trainer's own
  harness loop, e.g. ``MCPHarnessAdapter``, calls the tools). One fresh sandbox per session;
  tools run through :func:`~placement.trainers.tools.call_tool`, the reward through
  :func:`~placement.trainers.grading.grade`.
- :func:`transformers_model_step`: the ``model_step_builder`` of
  ``build_harness_rollout_func`` for a local ``transformers`` model.
- :class:`~placement.trainers.openenv_harness.HarnessSessionFactory` (its own module): the
  loop-owning path (a harness such as ``bash`` runs its own agent loop in the sandbox; its
  model calls are gated and answered by the trainer's ``generate``): a ``LoopOwningSession``
  and ``TrainableSession``.

An infrastructure failure (a sandbox that died, a verifier that failed) is never a reward:
``VerifyResult(env_reward=None)`` with the typed cause in ``metrics`` (``scored: False``,
``error_type``, ``error``, ``stage``). Upstream's ``build_harness_rollout_func`` raises
``ValueError("rollout did not produce an environment reward")`` for such a rollout; our own
TRL ``rollout_func`` (:mod:`placement.trainers.trl`) leaves it out of the group instead.

Everything here is synchronous (OpenEnv calls sessions from the trainer's threads); the
sandboxes live on a :class:`~placement.trainers.host.SandboxHost`'s event loop.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self, cast

import anyio
from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness.rollout import (
    Message,
    ModelStep,
    ModelStepResult,
    ResourceSession,
    ResourceSessionFactory,
    ToolResult,
    VerifyResult,
)
from openenv.core.llm_client import LLMResponse, ToolCall

from harnesses.errors import SessionProtocolError
from harnesses.session import PrepareFn, VerifyFn
from runtimes import Runtime
from runtimes.errors import SandboxError, SandboxUnavailableError

from .generation import TransformersGenerator
from .grading import Graded, grade, unscored
from .host import RuntimeSpec, SandboxHost
from .tools import DEFAULT_TOOLS, SandboxTool, ToolLimits, call_tool, tool_specs

__all__ = [
    "SandboxSession",
    "SandboxSessionFactory",
    "rollout_id_for",
    "task_record",
    "transformers_model_step",
]

log = logging.getLogger("placement.trainers")

_LIMITS = ToolLimits()


def task_record(task: Any) -> dict[str, Any]:
    """The task as a mapping with a ``prompt``: a string, a message list (TRL's
    conversational prompt) or a mapping with a ``prompt`` (plus anything verify should see).

    Raises:
        SessionProtocolError: no usable prompt.
    """
    if isinstance(task, str):
        record: dict[str, Any] = {"prompt": task}
    elif isinstance(task, list):
        record = {"prompt": task}
    elif isinstance(task, Mapping):
        record = dict(task)
    else:
        raise SessionProtocolError(
            f"a task is a prompt string, a message list or a mapping, not {type(task).__name__}"
        )
    prompt = record.get("prompt")
    if isinstance(prompt, str) and prompt.strip():
        return record
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in prompt)
    ):
        record["prompt"] = [dict(m) for m in prompt]
        return record
    raise SessionProtocolError(
        "a task needs a 'prompt': a non-empty string, or a list of messages with a role"
    )


def rollout_id_for(episode_id: str | None) -> str:
    """The episode id OpenEnv passed, or a fresh ``openenv-<hex>`` rollout id."""
    return episode_id or f"openenv-{uuid.uuid4().hex[:16]}"


# ---------------------------------------------------------------------- white-box sessions


class SandboxSession(ResourceSession):  # type: ignore[misc]
    """One rollout's sandbox, its tools and its reward (made by :class:`SandboxSessionFactory`).

    ``call_tool`` raises ``ToolNotFoundError`` (a ``KeyError``) for an unknown tool,
    ``ToolArgumentsError`` (a ``ValueError``) for arguments that do not match it (OpenEnv's
    ``SessionMCPBridge`` maps them to ``METHOD_NOT_FOUND`` / ``INVALID_PARAMS``) and
    ``SandboxUnavailableError`` / ``SandboxTransportError`` for a sandbox that died, which
    the session remembers: its ``verify()`` is then unscored.
    """

    def __init__(
        self,
        factory: SandboxSessionFactory,
        runtime: Runtime,
        rollout_id: str,
        task: dict[str, Any],
    ):
        self._factory = factory
        self.runtime = runtime
        self.rollout_id = rollout_id
        self.task = task
        self._lost: SandboxError | None = None
        self._result: VerifyResult | None = None
        self._closed = False
        self._lock = threading.Lock()
        self.tool_calls = 0
        self.tool_errors = 0

    @property
    def closed(self) -> bool:
        return self._closed

    def initial_messages(self) -> list[Message]:
        """The factory's system prompt (unless the task brings its own) and the task's prompt."""
        prompt = self.task["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = [dict(m) for m in messages]
        system = self._factory.system_prompt
        if system is not None and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system})
        return messages

    def list_tools(self) -> list[Tool]:
        return [
            Tool(name=t.name, description=t.description, input_schema=t.schema())
            for t in self._factory.tools
        ]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        """Raises: ToolNotFoundError, ToolArgumentsError, SandboxUnavailableError,
        SandboxTransportError (see the class)."""
        if self._lost is not None:
            raise SandboxUnavailableError(f"the sandbox of this session died: {self._lost}")
        if self._closed:
            raise SandboxUnavailableError("the session is closed")
        factory = self._factory
        try:
            outcome = factory.host.call(
                call_tool, self.runtime, factory.tools, name, arguments, factory.limits
            )
        except SandboxError as exc:
            self._lost = exc
            raise
        self.tool_calls += 1
        self.tool_errors += outcome.error is not None
        return ToolResult(
            data=outcome.output, error=outcome.error, metadata={"exit_code": outcome.exit_code}
        )

    def verify(self, transcript: list[Message], final_state: Any | None = None) -> VerifyResult:
        """The reward from the factory's verify function on the live sandbox, computed once;
        ``env_reward=None`` (never 0.0) when the sandbox died or the verifier failed."""
        with self._lock:
            if self._result is None:
                self._result = self._verify(transcript)
            return self._result

    def _verify(self, transcript: list[Message]) -> VerifyResult:
        factory = self._factory
        graded: Graded
        if self._lost is not None:
            graded = unscored(self._lost, "tools")
        elif self._closed:
            graded = unscored(SandboxUnavailableError("the session is closed"), "verify")
        else:
            try:
                graded = factory.host.call(
                    grade,
                    factory.verify_fn,
                    runtime=self.runtime,
                    rollout_id=self.rollout_id,
                    task=self.task,
                    messages=list(transcript),
                    tools=tool_specs(factory.tools),
                    timeout=factory.verify_timeout,
                )
            except SandboxError as exc:  # the host itself is gone
                graded = unscored(exc, "verify")
        metrics = {**graded.metrics, "tool_calls": self.tool_calls, "tool_errors": self.tool_errors}
        return VerifyResult(
            env_reward=graded.reward, done=True, metrics=metrics, artifacts=dict(graded.artifacts)
        )

    def close(self) -> None:
        """Remove the sandbox; idempotent, never raises (a failure is logged)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._factory._forget(self)
        try:
            self._factory.host.call(self.runtime.close)
        except Exception as exc:  # noqa: BLE001 - a dead sandbox or host: nothing to keep
            log.warning("closing the sandbox of rollout %r failed: %r", self.rollout_id, exc)


class SandboxSessionFactory(ResourceSessionFactory[SandboxSession]):  # type: ignore[misc]
    """OpenEnv sessions over fresh vf-sandbox sandboxes (any backend)::

        factory = SandboxSessionFactory({"type": "docker", "image": "vf-sandbox/python"},
                                        verify=CommandCheck("pytest -q"))
        rollout_func = build_harness_rollout_func(session_factory=factory, ...)

    Args:
        runtime: the sandbox config (a model, dict or type name); the factory then owns a
            :class:`SandboxHost` (started on first use, closed by :meth:`close`).
        host: or a started-on-demand host the caller owns (and closes).
        verify: ``async (VerifyContext) -> float | Verification``.
        tools: the tools the model may call.
        limits: bounds on each tool call.
        prepare: ``async (runtime, task)``, run on each new sandbox.
        system_prompt: put before the task's messages (unless they start with a system one).
        pool_size, pool_options: a warm pool on the owned host.
        verify_timeout: seconds ``verify`` may take (``None``: unlimited).

    Raises:
        TypeError: neither or both of ``runtime`` and ``host``.
        RuntimeConfigError / UnknownRuntimeError: an invalid runtime config.
    """

    def __init__(
        self,
        runtime: RuntimeSpec | None = None,
        *,
        host: SandboxHost | None = None,
        verify: VerifyFn,
        tools: Sequence[SandboxTool] = DEFAULT_TOOLS,
        limits: ToolLimits = _LIMITS,
        prepare: PrepareFn | None = None,
        system_prompt: str | None = None,
        pool_size: int = 0,
        pool_options: Mapping[str, Any] | None = None,
        verify_timeout: float | None = 900.0,
    ):
        if (runtime is None) == (host is None):
            raise TypeError("pass a runtime config or a host=, not both or neither")
        self._owns_host = host is None
        self.host = host or SandboxHost(
            cast(RuntimeSpec, runtime), pool_size=pool_size, pool_options=pool_options
        )
        self.verify_fn = verify
        self.tools = tuple(tools)
        self.limits = limits
        self.prepare = prepare
        self.system_prompt = system_prompt
        self.verify_timeout = verify_timeout
        self._sessions: dict[int, SandboxSession] = {}
        self._lock = threading.Lock()

    def create(
        self, task: Any, seed: int | None = None, episode_id: str | None = None
    ) -> SandboxSession:
        """A session in a fresh sandbox (``prepare`` run).

        Raises:
            SessionProtocolError: a task without a usable prompt (before any sandbox is made).
            ProvisioningError: the sandbox could not be made; whatever ``prepare`` raised
                (the sandbox is closed first).
        """
        record = task_record(task)
        self.host.start()
        runtime = self.host.call(self._open, record)
        session = SandboxSession(self, runtime, rollout_id_for(episode_id), record)
        with self._lock:
            self._sessions[id(session)] = session
        return session

    async def _open(self, task: dict[str, Any]) -> Runtime:
        runtime = await self.host.open_sandbox()
        try:
            if self.prepare is not None:
                await self.prepare(runtime, task)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await runtime.close()
            raise
        return runtime

    def _forget(self, session: SandboxSession) -> None:
        with self._lock:
            self._sessions.pop(id(session), None)

    def open_sessions(self) -> list[SandboxSession]:
        with self._lock:
            return list(self._sessions.values())

    def close(self) -> None:
        """Close every session still open, then the owned host; idempotent."""
        for session in self.open_sessions():
            session.close()
        if self._owns_host:
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


# ---------------------------------------------------------------------- the model step


class _TransformersStep:
    """One rollout's ``ModelStep``: one :class:`TokenChain`, ids returned so that
    ``MCPHarnessAdapter``'s concatenation of all turns is the whole chained sequence."""

    def __init__(self, generator: TransformersGenerator):
        self._generator = generator
        self._chain = generator.chain()
        self._seen: list[int] = []
        self._turn = 0

    def __call__(
        self, messages: list[Message], tools: list[Tool], sampling: dict[str, Any]
    ) -> ModelStepResult:
        specs = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.input_schema,
                },
            }
            for t in tools
        ]
        turn = self._generator.sample(self._chain, messages, specs or None, sampling)
        if not self._seen:
            prompt, completion = list(turn.prompt_ids), list(turn.completion_ids)
            logprobs = list(turn.logprobs)
        else:
            glue = turn.prompt_ids[len(self._seen) :]
            prompt, completion = [], glue + turn.completion_ids
            logprobs = [0.0] * len(glue) + turn.logprobs
        self._seen = turn.prompt_ids + turn.completion_ids
        calls: list[ToolCall] = []
        content = [turn.content] if turn.content else []
        for index, call in enumerate(turn.tool_calls):
            arguments = call.get("arguments")
            if isinstance(arguments, dict):
                calls.append(ToolCall(f"call_{self._turn}_{index}", call["name"], arguments))
            else:  # not a JSON object: kept as text, never run (see transformers_model_step)
                raw = {"name": call["name"], "arguments": arguments}
                content.append(f"<tool_call>{json.dumps(raw)}</tool_call>")
        self._turn += 1
        return ModelStepResult(
            response=LLMResponse(content="\n".join(content), tool_calls=calls),
            prompt_ids=prompt,
            completion_ids=completion,
            logprobs=logprobs,
        )


def transformers_model_step(
    generator: TransformersGenerator,
) -> Callable[[Any, ResourceSession], ModelStep]:
    """A ``model_step_builder`` for OpenEnv's ``build_harness_rollout_func`` sampling from a
    local ``transformers`` model (``TransformersGenerator(lambda: trainer.model, tokenizer)``).

    Each rollout's step owns one token chain. ``MCPHarnessAdapter`` concatenates the ids of
    all turns, so turn 1 returns its full prompt and each later turn ``prompt_ids=[]`` and,
    as ``completion_ids``, the glue (the tool output and the template's tokens between the
    previous reply and the new one) followed by the new reply, with logprob 0.0 on the glue.
    Upstream hands these to TRL with no environment mask, so **the glue is trained as if the
    model had sampled it**: use ``HarnessRunLimits(max_turns=1)`` there, or our own
    ``rollout_func`` (:mod:`placement.trainers.trl`), which masks it.

    A tool call whose arguments are not a JSON object is not run (``MCPHarnessAdapter``
    would abort the whole batch on the ``ToolArgumentsError``): its text stays in the reply's
    content, and the turn ends the rollout if it was the only call.
    """

    def build(trainer: Any, session: ResourceSession) -> ModelStep:
        return _TransformersStep(generator)

    return build
