"""vf-sandbox placement: agents and judges placed into rollout or clean-room sandboxes.

The top layer: :class:`AgentSpec` / :class:`JudgeSpec`, :func:`run_agent`,
:func:`run_judges`, the judge input snapshot under ``/tmp/vf-agent/<id>/``, verdict
collection with strict typed failures, and the ``vf-sandbox`` command line.
"""

from .errors import (
    InputTamperError,
    JudgeAgentFailed,
    JudgeBudgetExceeded,
    JudgeCancelled,
    JudgeError,
    JudgeInputsTampered,
    JudgeModelFailed,
    JudgeModelUnresolved,
    JudgeRecordInvalid,
    JudgeSandboxLost,
    JudgeSetupFailed,
    JudgesHookFailed,
    JudgingFailed,
    PlacementConfigError,
    PlacementError,
    RecordInvalid,
    VerdictInvalid,
    VerdictMissing,
)
from .inputs import INPUTS_ROOT, JudgeInputs, materialise, render_transcript
from .run import AgentRun, JudgesHook, run_agent, run_judges
from .specs import AgentSpec, JudgeSpec, load_judges

__all__ = [
    "INPUTS_ROOT",
    "AgentRun",
    "AgentSpec",
    "InputTamperError",
    "JudgeAgentFailed",
    "JudgeBudgetExceeded",
    "JudgeCancelled",
    "JudgeError",
    "JudgeInputs",
    "JudgeInputsTampered",
    "JudgeModelFailed",
    "JudgeModelUnresolved",
    "JudgeRecordInvalid",
    "JudgeSandboxLost",
    "JudgeSetupFailed",
    "JudgeSpec",
    "JudgesHook",
    "JudgesHookFailed",
    "JudgingFailed",
    "PlacementConfigError",
    "PlacementError",
    "RecordInvalid",
    "VerdictInvalid",
    "VerdictMissing",
    "load_judges",
    "materialise",
    "render_transcript",
    "run_agent",
    "run_judges",
]
