"""Rewards for gated sessions from judges: :func:`~placement.run.run_judges` on the session's
own sandbox after its agent exited.

``harnesses.session`` cannot import placement, so this is where a session's ``verify``
meets the judges::

    verify = JudgeVerifier([judge], models=table)            # reward: mean verdict score
    async with AgentSessionFactory(runtime, {"id": "bash"}, verify=verify) as factory:
        ...
        result = await session.verify()   # result.reward, result.details["verdicts"]

Judges placed ``"rollout"`` run in the session's live sandbox (after the processes the
agent left running are stopped); judges with a runtime config get clean-room sandboxes.
A failed judge fails verification, typed: never a silent 0 reward.

``judges`` may also be a hook ``judges(task, trace, runtime) -> list[JudgeSpec]`` (plain
or ``async``) that picks the judges per rollout. When no judge is picked (an empty list,
or ``JudgeVerifier([])``) the rollout is not judged: its reward is ``unjudged_reward``
(0.0 unless given) and ``details["judged"]`` is ``False``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, Literal

from harnesses.errors import SessionSandboxLost, SessionVerifyError
from harnesses.llm import ModelEndpoint, ModelTable
from harnesses.session import Verification, VerifyContext
from runtimes.errors import ExecTimeoutError, SandboxError
from runtimes.machinery import machinery_env
from runtimes.pool import RuntimePool

from .errors import JudgeSandboxLost, JudgingFailed, PlacementError
from .run import AgentRun, JudgesHook, run_judges, select_judges
from .specs import JudgeSpec

__all__ = ["CommandCheck", "JudgeVerifier", "RewardFn", "verdict_reward"]

RewardFn = Callable[[Sequence[AgentRun]], float]
"""Turns the judges' runs (verdicts validated) into one reward."""

_REWARD_FIELDS = ("reward", "score")
_LARGEST = sys.float_info.max


def verdict_reward(runs: Sequence[AgentRun]) -> float:
    """The mean over judges of each verdict's ``reward`` or ``score`` (a number), or of
    ``passed`` (a boolean, as 1.0 / 0.0).

    Raises:
        SessionVerifyError: a verdict has none of those fields (pass your own ``reward``),
            or its reward is not a finite number (NaN, Infinity, an integer past a float).
    """
    values = [_verdict_value(run) for run in runs]
    if not values:
        raise SessionVerifyError("no judge ran, so there is no reward")
    return sum(values) / len(values)


def _verdict_value(run: AgentRun) -> float:
    verdict = run.verdict or {}
    for name in _REWARD_FIELDS:
        value = verdict.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            reward = float(value) if abs(value) <= _LARGEST else math.inf
            if not math.isfinite(reward):
                raise SessionVerifyError(
                    f"judge {run.name!r}'s verdict has a {name!r} that is not a finite number"
                )
            return reward
    passed = verdict.get("passed")
    if isinstance(passed, bool):
        return 1.0 if passed else 0.0
    raise SessionVerifyError(
        f"judge {run.name!r}'s verdict has no numeric 'reward'/'score' or boolean 'passed' "
        f"field ({sorted(verdict)}); give JudgeVerifier a reward function"
    )


class JudgeVerifier:
    """A session ``verify`` function that runs judges on the finished rollout.

    Args:
        judges: the judge specs (see :class:`~placement.specs.JudgeSpec`), or a hook
            ``judges(task, trace, runtime) -> list[JudgeSpec]`` (plain or ``async``)
            choosing them per rollout. No judges: the rollout is not judged.
        models: the model table the judges' logical model names resolve in.
        reward: turns the judges' runs into the reward (default :func:`verdict_reward`).
        policy: the endpoint a judge using the ``"policy"`` model would call.
        deadline: seconds the whole judging may take (``run_judges(deadline=)``).
        unjudged_reward: the reward of a rollout no judge was chosen for.
        pools: warm pools (:class:`~runtimes.pool.RuntimePool`) the clean-room judges
            whose placement config one of them serves acquire their sandboxes from.
    """

    def __init__(
        self,
        judges: Sequence[JudgeSpec] | JudgesHook,
        *,
        models: ModelTable,
        reward: RewardFn = verdict_reward,
        policy: ModelEndpoint | None = None,
        deadline: float | None = None,
        unjudged_reward: float = 0.0,
        pools: Sequence[RuntimePool] | None = None,
    ):
        self.judges = judges if callable(judges) else list(judges)
        self.models = models
        self.reward = reward
        self.policy = policy
        self.deadline = deadline
        self.unjudged_reward = unjudged_reward
        self.pools = pools

    async def __call__(self, context: VerifyContext) -> Verification:
        """Judge the rollout in ``context.runtime``; the reward comes from the verdicts.

        Raises:
            SessionSandboxLost: a judge lost the sandbox.
            SessionVerifyError: a judge failed otherwise (no verdict, an invalid one, its
                budget, deadline or model failed); the
                :class:`~placement.errors.JudgingFailed` group is chained. Also: the
                judges hook failed, or two judges share a name.
        """
        try:
            judges = await select_judges(
                self.judges, task=context.task, trace=context.trace, runtime=context.runtime
            )
            if not judges:
                return Verification(reward=self.unjudged_reward, details=_details([], False))
            runs = await run_judges(
                judges,
                task=context.task,
                trace=context.trace,
                models=self.models,
                runtime=context.runtime,
                policy=self.policy,
                deadline=self.deadline,
                pools=self.pools,
            )
        except JudgingFailed as group:
            failures = "; ".join(str(e) for e in group.exceptions)
            lost = [e for e in group.exceptions if isinstance(e, JudgeSandboxLost)]
            if lost:
                # Chained from the runtime's own error (SandboxUnavailableError, ...) when
                # there is one, so callers see why; the group stays as __context__.
                cause = lost[0].__cause__
                raise SessionSandboxLost(
                    f"judging lost the sandbox: {failures}", rollout_id=context.rollout_id
                ) from (cause if isinstance(cause, SandboxError) else group)
            raise SessionVerifyError(
                f"judging failed: {failures}", rollout_id=context.rollout_id
            ) from group
        except PlacementError as exc:  # the hook, or the judges it chose, are unusable
            raise SessionVerifyError(
                f"judging could not start: {exc}", rollout_id=context.rollout_id
            ) from exc
        return Verification(reward=self.reward(runs), details=_details(runs, True))


def _details(runs: Sequence[AgentRun], judged: bool) -> dict[str, Any]:
    return {
        "judged": judged,
        "verdicts": {run.name: run.verdict for run in runs},
        "judges": [run.model_dump(mode="json", exclude={"trace"}) for run in runs],
    }


CheckCommand = str | Sequence[str]


class CommandCheck:
    """A session ``verify`` function that runs a check command in the live sandbox.

    The reward is the command's exit status (``reward="exit_code"``: 0 gives 1.0, anything
    else 0.0) or the number it prints (``reward="stdout"``: the last line, a finite float).
    ``command`` is a shell string (run by ``bash -c``), an argv list, or a function of the
    task giving one (``lambda task: task["check"]``).

    What a policy left cannot forge it: first every process the rollout left running is
    stopped (:meth:`~runtimes.base.Runtime.stop_processes`), so no racer rewrites what the
    check reads while it runs; then the command runs as the policy's account (never with
    more privilege than the policy had), in the workdir, with the machinery's fixed
    ``PATH`` and no shell start-up files (:func:`runtimes.machinery.machinery_env`). The
    workdir is the world being judged: what the check reads there is the policy's work.
    Use judges (:class:`JudgeVerifier`, ``fork`` or clean-room placement) for more.

    A check that runs past ``timeout`` scores 0.0 (the policy's program hung). A check whose
    output is not a number is :class:`~harnesses.errors.SessionVerifyError`, a dead sandbox
    :class:`~harnesses.errors.SessionSandboxLost`: no reward at all.
    """

    def __init__(
        self,
        command: CheckCommand | Callable[[dict[str, Any]], CheckCommand],
        *,
        reward: Literal["exit_code", "stdout"] = "exit_code",
        timeout: float = 120.0,
        output_limit: int = 65_536,
    ):
        self.command = command
        self.reward = reward
        self.timeout = timeout
        self.output_limit = output_limit

    async def __call__(self, context: VerifyContext) -> Verification:
        """Raises: SessionVerifyError (an unusable command or output), SessionSandboxLost."""
        command = self.command(context.task) if callable(self.command) else self.command
        argv = ["bash", "-c", command] if isinstance(command, str) else list(command)
        if not argv or not all(isinstance(a, str) for a in argv):
            raise SessionVerifyError(f"the check command is not a string or argv: {command!r}")
        runtime = context.runtime
        await runtime.stop_processes()
        try:
            result = await runtime.exec(
                argv,
                timeout=self.timeout,
                user=runtime.policy_user,
                env=machinery_env(),
                output_limit=self.output_limit,
            )
        except ExecTimeoutError:
            return Verification(reward=0.0, details={"check": "timed out", "timeout": self.timeout})
        details: dict[str, Any] = {
            "check_exit_code": result.exit_code,
            "check_output": (result.stdout + result.stderr)[-2000:],
        }
        if self.reward == "exit_code":
            return Verification(reward=1.0 if result.exit_code == 0 else 0.0, details=details)
        lines = result.stdout.strip().splitlines()
        try:
            value = float(lines[-1]) if lines else math.nan
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise SessionVerifyError(
                f"the check printed no finite number on its last line "
                f"(exit code {result.exit_code}): {result.stdout[-200:]!r}"
            )
        return Verification(reward=value, details=details)
