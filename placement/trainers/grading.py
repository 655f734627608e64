"""A finished rollout's reward, from its live sandbox, or *unscored*: :func:`grade`.

Every adapter (OpenEnv sessions, TRL's ``rollout_func`` and ``environment_factory``) grades
through the one verify contract of gated sessions (``async verify(VerifyContext) ->
float | Verification``): a :class:`~placement.verifier.CommandCheck`, judges placed by
:class:`~placement.verifier.JudgeVerifier`, or a function of the caller's own.

What no trainer may ever see is an infrastructure failure turned into a reward. A sandbox
that died, a harness that could not start, judges that failed, a check that could not run:
each gives a :class:`Graded` with ``reward=None`` and the typed cause in its ``metrics``
(``scored: False``, ``error_type``, ``error``, ``stage``), which each adapter hands its
trainer as that trainer's "no sample" (OpenEnv: ``VerifyResult(env_reward=None)``; TRL:
a reward function returning ``None``, which TRL leaves out of the group's baseline and
gives no advantage). Never ``0.0``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from harnesses.base import Trace
from harnesses.errors import SessionError
from harnesses.llm import Message
from harnesses.session import (
    RolloutRecord,
    Verification,
    VerifyContext,
    VerifyFn,
    run_verify,
)
from placement.errors import RecordInvalid
from placement.traces import trace_from_messages
from runtimes import Runtime

__all__ = ["Graded", "grade", "transcript_trace", "unscored"]

log = logging.getLogger("placement.trainers")

ERROR_CHARS = 2000


@dataclass(frozen=True)
class Graded:
    """A rollout's reward (``None``: unscored), what explains it, and the judges' traces."""

    reward: float | None
    metrics: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, Any] = field(default_factory=dict)

    @property
    def scored(self) -> bool:
        return self.reward is not None


def unscored(exc: BaseException, stage: str) -> Graded:
    """The rollout has no reward because ``exc`` happened during ``stage`` (``"start"``,
    ``"tools"``, ``"agent"``, ``"verify"``)."""
    log.warning("rollout unscored at %s: %s: %s", stage, type(exc).__name__, exc)
    return Graded(
        None,
        {
            "scored": False,
            "stage": stage,
            "error_type": type(exc).__name__,
            "error": str(exc)[:ERROR_CHARS],
        },
    )


def scored(verification: Verification, trace: Trace | None) -> Graded:
    """What a verification gave: its reward, its details as metrics, the judges' traces."""
    metrics: dict[str, Any] = {"scored": True, "reward": verification.reward}
    for key, value in verification.details.items():
        metrics.setdefault(key, value)
    artifacts: dict[str, Any] = {}
    if trace is not None and trace.agents:
        artifacts["judges"] = [agent.model_dump(mode="json") for agent in trace.agents]
    return Graded(verification.reward, metrics, artifacts)


def transcript_trace(messages: Sequence[Message], harness: str = "trainer") -> Trace:
    """A :class:`~harnesses.base.Trace` of a conversation the trainer's own loop ran on the
    host (white-box), by the one converter :func:`placement.traces.trace_from_messages`:
    one turn per assistant message (its request the messages before it, the tool messages
    after it its tool results). Judges read it as they read a harness's trace.

    Raises:
        RecordInvalid: a message that is not a chat message, an unreadable tool call, a
            tool message that follows no assistant message, a field a trace cannot hold.
    """
    return trace_from_messages(messages, harness=harness)


async def grade(
    verify: VerifyFn,
    *,
    runtime: Runtime,
    rollout_id: str,
    task: dict[str, Any],
    messages: Sequence[Message],
    tools: list[dict[str, Any]] | None = None,
    timeout: float | None = 900.0,
) -> Graded:
    """Grade a white-box rollout (the trainer ran the loop, the tools ran in ``runtime``):
    ``verify`` on the live sandbox, through :func:`~harnesses.session.run_verify`.

    Never raises for a failure of the sandbox or the verifier, nor for a transcript that
    cannot be recorded (a message that is not a mapping, an unreadable tool call: stage
    ``"record"``): that is an unscored :class:`Graded` (the typed cause in its metrics).
    Cancellation propagates.
    """
    try:
        trace = transcript_trace(messages)
        record = RolloutRecord(
            rollout_id=rollout_id,
            task=task,
            status="completed",
            messages=list(messages),
            tools=tools,
            turns=[],
            linear=True,
            gate_trace=trace,
        )
    except (RecordInvalid, ValidationError) as exc:  # a transcript no judge could read
        return unscored(exc, "record")
    context = VerifyContext(rollout_id, task, runtime, trace, record)
    try:
        verification = await run_verify(verify, context, timeout)
    except SessionError as exc:
        return unscored(exc, "verify")
    return scored(verification, trace)
