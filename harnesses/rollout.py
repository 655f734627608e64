"""What a gated rollout is, apart from the live session: its task and prompt, the turns
the trainer delivered, the conversation they make, the verification and the record
(:class:`RolloutRecord`). :mod:`harnesses.session` drives rollouts; this module holds
their data and the pure functions over it."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from pydantic import BaseModel, Field

from runtimes import (
    Runtime,
    SandboxTransportError,
    SandboxUnavailableError,
)

from .base import Trace
from .errors import (
    SessionError,
    SessionProtocolError,
    SessionSandboxLost,
    SessionVerifyError,
)
from .gate import Completion, InterceptedRequest
from .llm import Message, Usage

__all__ = [
    "Delivered",
    "PrepareFn",
    "RolloutRecord",
    "RolloutTurn",
    "Status",
    "Verification",
    "VerifyContext",
    "VerifyFn",
    "conversation",
    "prompt_of",
    "request_id_of",
    "run_verify",
    "task_record",
]


Status = Literal["running", "completed", "truncated", "failed", "stopped"]
"""``completed``: the agent finished on its own; ``truncated``: its budget ran out;
``failed``: a :class:`~harnesses.errors.SessionError` ended it; ``stopped``: the session was
closed while the agent ran."""


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
class Delivered:
    request: InterceptedRequest
    completion: Completion
    usage: Usage
    estimated: bool
    latency: float


def conversation(delivered: Sequence[Delivered]) -> tuple[list[Message], list[int | None]]:
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


def request_id_of(request: InterceptedRequest | Mapping[str, Any] | str) -> str:
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


def task_record(task: str | Mapping[str, Any]) -> dict[str, Any]:
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


def prompt_of(task: dict[str, Any]) -> str | list[Message]:
    prompt = task["prompt"]
    return prompt if isinstance(prompt, str) else [dict(m) for m in prompt]


# ---------------------------------------------------------------------- the factory


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
