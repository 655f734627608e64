"""Placement errors. A judge that fails, fails the rollout: never a silent 0 reward.

Each :class:`JudgeError` subclass names one real cause and carries the judge's own
trace (``err.trace``), on which the failure is also recorded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

from harnesses.errors import HarnessConfigError, HarnessInstallError, ModelConfigError, ModelError
from runtimes import SandboxError

if TYPE_CHECKING:
    from harnesses.base import Trace

    from .run import AgentRun


class PlacementError(Exception):
    """Base of every placement error."""


class PlacementConfigError(PlacementError, ValueError):
    """An agent or judge spec, a rollout directory or a judges file is malformed."""


class InputTamperError(PlacementError):
    """The judge input directory was not fresh: a planted file, directory or symlink."""


class RecordInvalid(PlacementError, ValueError):
    """The rollout's record (its task or trace) is malformed: it cannot be serialised, or a
    recorded message is not a chat message. Found when the judges' input snapshot is taken,
    before any judge runs (:func:`placement.transcript.validate_record`)."""


class JudgeError(PlacementError):
    """A judge could not produce a valid verdict. ``trace`` is the judge's own trace."""

    def __init__(self, judge: str, message: str, trace: Trace | None = None):
        super().__init__(f"judge {judge!r}: {message}")
        self.judge = judge
        self.trace = trace
        self.run: AgentRun | None = None


class VerdictMissing(JudgeError):
    """A tools judge finished without writing ``verdict.json`` (the read found no file)."""


class VerdictInvalid(JudgeError):
    """The verdict is not JSON, is over the size cap, or does not match the schema."""


class JudgeSandboxLost(JudgeError):
    """The judge's sandbox died or its channel failed while it ran or was collected."""


class JudgeBudgetExceeded(JudgeError):
    """The judge ran out of turns, tokens or wall time."""


class JudgeModelFailed(JudgeError):
    """The judge's model endpoint failed (HTTP error, timeout, malformed reply)."""


class JudgeInputsTampered(JudgeError):
    """The judge's input directory was not fresh (a planted file or symlink): refused."""


class JudgeModelUnresolved(JudgeError):
    """The judge's model cannot be called: an unknown logical name, ``"policy"`` with no
    policy endpoint, or an API-key variable that is not set. Found before any sandbox work."""


class JudgeSetupFailed(JudgeError):
    """The judge's harness could not be set up: an invalid harness config, or installing
    it into the sandbox failed (``HarnessInstallError``)."""


class JudgeAgentFailed(JudgeError):
    """The judge's agent itself failed (an installed agent exited abnormally, or the
    harness raised instead of recording the failure on its trace)."""


class JudgeRecordInvalid(JudgeError):
    """The rollout's record the judge was to read is malformed (:class:`RecordInvalid`,
    chained): no judge of the rollout ran."""


class JudgeCancelled(JudgeError):
    """The judge was stopped before it finished: its caller was cancelled, or it never
    started because judging failed before any judge ran."""


class JudgesHookFailed(PlacementError):
    """A ``judges(task, trace, runtime)`` hook raised, or returned something other than a
    list of :class:`~placement.specs.JudgeSpec` (its exception is chained)."""


class JudgingFailed(ExceptionGroup[JudgeError]):
    """One or more judges of a rollout failed. ``runs`` holds every judge's AgentRun."""

    runs: list[AgentRun]

    def __new__(
        cls, message: str, errors: Sequence[JudgeError], runs: Sequence[AgentRun] = ()
    ) -> Self:
        self = super().__new__(cls, message, errors)
        self.runs = list(runs)
        return self

    def derive(self, excs: Sequence[JudgeError]) -> JudgingFailed:  # type: ignore[override]
        return JudgingFailed(self.message, excs, self.runs)


def as_judge_error(judge: str, exc: BaseException) -> JudgeError:
    """The typed :class:`~placement.errors.JudgeError` for what ended judge ``judge``
    (``exc`` itself when it is one already; the caller chains ``exc``)."""
    if isinstance(exc, JudgeError):
        return exc
    if isinstance(exc, InputTamperError):
        return JudgeInputsTampered(judge, str(exc))
    if isinstance(exc, RecordInvalid):
        return JudgeRecordInvalid(judge, f"not run: {exc}")
    if isinstance(exc, ModelConfigError):
        return JudgeModelUnresolved(judge, f"its model cannot be called: {exc}")
    if isinstance(exc, HarnessInstallError):
        return JudgeSetupFailed(judge, f"installing its harness failed: {exc}")
    if isinstance(exc, HarnessConfigError | PlacementConfigError):
        return JudgeSetupFailed(judge, f"its harness cannot be set up: {exc}")
    if isinstance(exc, ModelError):
        return JudgeModelFailed(judge, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, SandboxError):
        return JudgeSandboxLost(judge, f"sandbox failed: {exc}")
    return JudgeAgentFailed(judge, f"{type(exc).__name__}: {exc}")
