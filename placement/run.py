"""Running agents and judges where their spec places them.

:func:`run_agent` is a standalone executor: it provisions the harness per placement,
materialises the inputs, runs, collects the outputs before an owned sandbox is torn
down, and records a failure onto the run's own trace before raising.

:func:`run_judges` takes the judge inputs once, stops what the policy left running in the
live sandbox, runs rollout-placed judges there one after another and clean-room judges
concurrently in fresh sandboxes of their own, and fails the rollout with
:class:`~placement.errors.JudgingFailed` when any judge fails.

A file-verdict judge's verdict is watched by a :class:`~placement.guard.VerdictGuard`:
processes are stopped before each rollout-placed judge, after each of its commands (for
harnesses that run commands one by one) and before its verdict is read; the verdict must
be a regular file last changed by a command of the judge's that names it.
"""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any, TypeAlias

import anyio
from pydantic import ConfigDict, PrivateAttr

from harnesses.base import (
    AgentRecord,
    AgentRole,
    Harness,
    HarnessConfig,
    Trace,
    for_judge,
    for_policy,
)
from harnesses.errors import (
    HarnessError,
    ModelConfigError,
)
from harnesses.llm import ModelEndpoint, ModelTable
from harnesses.registry import load_harness_class, open_harness, resolve_harness_config
from runtimes import (
    Runtime,
    RuntimeConfig,
    SandboxError,
)
from runtimes.pool import RuntimePool, open_pooled
from runtimes.snapshot import SandboxSnapshot

from .errors import (
    JudgeBudgetExceeded,
    JudgeCancelled,
    JudgeError,
    JudgeInputsTampered,
    JudgesHookFailed,
    JudgingFailed,
    PlacementConfigError,
    RecordInvalid,
    as_judge_error,
)
from .guard import VerdictGuard
from .inputs import INPUTS_ROOT, JudgeInputs, materialise, new_agent_id
from .judge_sandbox import (
    InputsCleanup,
    command_user,
    drop_fork,
    judge_account,
    open_fork,
    take_fork,
    with_input_env,
)
from .prompts import render_prompt
from .specs import AgentSpec, JudgeSpec
from .verdicts import collect_verdict

log = logging.getLogger("placement.run")

Role = AgentRole


class AgentRun(AgentRecord):
    """Provenance of one agent run: who, with which model, trainable or not, what it did
    (the fields of :class:`harnesses.base.AgentRecord`, the form kept on a trace)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    _exception: JudgeError | None = PrivateAttr(default=None)

    @property
    def ok(self) -> bool:
        return self.error is None

    def raise_for_error(self) -> None:
        if self._exception is not None:
            raise self._exception


def _placement_label(spec: AgentSpec) -> str:
    if not spec.needs_runtime():
        return "host (no sandbox)"
    if spec.is_fork():
        return "fork"
    config = spec.runtime_config()
    return "rollout" if config is None else f"clean-room:{config.type}"


async def run_agent(
    spec: AgentSpec,
    task: str | Sequence[dict[str, Any]],
    *,
    models: ModelTable,
    runtime: Runtime | None = None,
    policy: ModelEndpoint | None = None,
    inputs: JudgeInputs | None = None,
    role: Role = "agent",
    pools: Sequence[RuntimePool] | None = None,
) -> AgentRun:
    """Run one agent (or judge) where its spec places it, and collect what it produced.

    Its harness, model name and API-key variable are checked before any sandbox work
    (:func:`plan_agent`). For a :class:`JudgeSpec`, ``inputs`` is required and the
    verdict is collected and validated; every failure of a judge is one typed
    :class:`~placement.errors.JudgeError`, recorded on the run (``error``,
    ``error_type``, ``err.run``) and on its trace (``trace.metadata["failure"]``), then
    raised. With ``role="policy"`` the agent's commands run as the runtime's
    ``policy_user`` where it keeps one (:func:`harnesses.base.for_policy`).

    A clean-room agent whose placement config is served by one of ``pools``
    (:func:`runtimes.pool.pool_for`) gets its sandbox from that pool instead of starting
    one; either way the sandbox is closed when the agent is done.

    Cancelling it stops the agent: a judge in a rollout's sandbox has the processes it
    left stopped and its inputs dir removed (shielded, bounded by
    :data:`CLEANUP_SECONDS`), its run records :class:`~placement.errors.JudgeCancelled`,
    and the cancellation propagates.

    Raises:
        PlacementConfigError: rollout placement without a runtime for a harness that
            needs one; a judge without its inputs.
        JudgeModelUnresolved: (judges) an unknown model name, ``"policy"`` with no
            ``policy`` endpoint, or an unset API-key variable; before any sandbox work.
        JudgeSetupFailed: (judges) an invalid harness config, or installing it failed.
        VerdictMissing / VerdictInvalid / JudgeSandboxLost / JudgeBudgetExceeded /
            JudgeModelFailed / JudgeAgentFailed: the judge failed, for that cause.
        JudgeInputsTampered: the inputs dir was planted, or the verdict was changed by
            something other than the judge's own commands, or is a link it did not make.
        HarnessError / ModelConfigError / SandboxError / ProvisioningError: an agent's
            (non-judge) harness, model or sandbox failed, as raised.
    """
    judge = isinstance(spec, JudgeSpec)
    if judge and inputs is None:
        raise PlacementConfigError(f"judge {spec.name!r} needs the rollout's judge inputs")
    run = new_run(spec, "judge" if judge else role)
    try:
        plan = plan_agent(spec, models=models, runtime=runtime, policy=policy)
    except (HarnessError, ModelConfigError) as exc:
        if not judge:
            raise
        error = as_judge_error(spec.name, exc)
        _record_failure(run, error, None)
        raise error from exc
    await _execute(spec, task, run, plan, runtime=runtime, inputs=inputs, role=role, pools=pools)
    return run


@dataclass(frozen=True)
class AgentPlan:
    """What running one agent needs, checked before any sandbox work (:func:`plan_agent`)."""

    harness: HarnessConfig
    needs_runtime: bool
    endpoint: ModelEndpoint
    clean_room: RuntimeConfig | None
    fork: bool = False

    @property
    def own_sandbox(self) -> bool:
        """Whether the agent gets a sandbox of its own (clean room or fork): such agents run
        concurrently; the others take turns in the rollout's sandbox."""
        return self.needs_runtime and (self.clean_room is not None or self.fork)


def plan_agent(
    spec: AgentSpec,
    *,
    models: ModelTable,
    runtime: Runtime | None,
    policy: ModelEndpoint | None = None,
) -> AgentPlan:
    """Check, with no sandbox work, that ``spec`` can run: its harness config, where it is
    placed, its logical model and that model's API-key variable.

    Raises:
        HarnessConfigError / HarnessPluginError: an unknown harness or an invalid config.
        PlacementConfigError: rollout or fork placement with no rollout runtime given, or
            fork placement on a backend that cannot take snapshots.
        UnknownModelError: no such model in ``models``, or ``"policy"`` with no
            ``policy`` endpoint.
        ModelConfigError: the endpoint's ``api_key_env`` variable is not set.
    """
    harness = resolve_harness_config(spec.harness)
    needs_runtime = load_harness_class(harness.id).needs_runtime
    clean_room = spec.runtime_config()
    if clean_room is None and needs_runtime and runtime is None:
        where = "a fork of the rollout" if spec.is_fork() else "the rollout"
        raise PlacementConfigError(
            f"{spec.name!r} is placed in {where} but no rollout runtime was given"
        )
    if spec.is_fork() and needs_runtime and runtime is not None and runtime.snapshot_holds is None:
        raise PlacementConfigError(
            f"{spec.name!r} is placed in a fork, but the {runtime.name} backend cannot take "
            "snapshots (docs/snapshots.md)"
        )
    endpoint = models.resolve(spec.model, policy=policy)
    endpoint.resolve_api_key()
    return AgentPlan(harness, needs_runtime, endpoint, clean_room, fork=spec.is_fork())


def new_run(spec: AgentSpec, role: Role) -> AgentRun:
    """A not-yet-started run of ``spec`` with a fresh agent id."""
    return AgentRun(
        name=spec.name,
        role=role,
        model=spec.model,
        trainable=spec.trainable,
        placement=_placement_label(spec),
        agent_id=new_agent_id(spec.name),
    )


async def _execute(
    spec: AgentSpec,
    task: str | Sequence[dict[str, Any]],
    run: AgentRun,
    plan: AgentPlan,
    *,
    runtime: Runtime | None,
    inputs: JudgeInputs | None,
    role: Role,
    pools: Sequence[RuntimePool] | None = None,
    fork: SandboxSnapshot | None = None,
) -> None:
    """Run ``spec`` per ``plan``, filling ``run`` (a fork-placed agent in a sandbox opened
    from ``fork``). Raises what :func:`run_agent` raises."""
    judge = spec if isinstance(spec, JudgeSpec) else None
    harness: Harness | None = None
    run.started = time.time()
    clock = time.monotonic()
    try:
        async with AsyncExitStack() as stack:
            target = runtime if plan.needs_runtime else None
            if plan.needs_runtime and plan.clean_room is not None:
                target = await stack.enter_async_context(open_pooled(plan.clean_room, pools))
            if plan.needs_runtime and plan.fork:
                target = await stack.enter_async_context(open_fork(runtime, fork))
            in_rollout = target is not None and not plan.own_sandbox
            inputs_dir = None
            if judge is not None and target is not None and in_rollout:
                await target.stop_processes()  # nothing the policy or a judge left is alive
            if judge is not None and runtime is not None and (in_rollout or plan.fork):
                reason = await runtime.system_tampered()
                if reason is not None:
                    raise JudgeInputsTampered(
                        spec.name,
                        f"the rollout's sandbox cannot host a judge: {reason}; place the "
                        "judge in a clean-room sandbox, or give the policy an account",
                    )
            judge_ids = None
            if judge is not None and target is not None:
                judge_ids = await judge_account(target)
            if target is not None and inputs is not None:
                # registered before the directory exists: a cancellation while it is being
                # made still removes it
                cleanup = InputsCleanup(target, f"{INPUTS_ROOT}/{run.agent_id}", in_rollout)
                stack.push_async_exit(cleanup)
                gid = None if judge_ids is None else judge_ids[1]
                inputs_dir = await materialise(target, run.agent_id, inputs, judge_gid=gid)
            harness = open_harness(with_input_env(plan.harness, inputs_dir))
            if role == "policy" and target is not None:
                harness = for_policy(harness, target)
            if judge is not None and target is not None:
                harness = for_judge(harness, target)
            guard = None
            if judge is not None and target is not None and inputs_dir is not None:
                guard = VerdictGuard(
                    target,
                    inputs_dir,
                    spec.name,
                    judge.verdict_max_bytes,
                    writer=None if judge_ids is None else judge_ids[0],
                )
                await guard.start()
                harness.add_command_hook(guard.after_command)
                if judge_ids is not None:
                    harness.set_command_user(
                        command_user(guard, target.judge_user, target.policy_user)
                    )
            if target is not None:
                await harness.setup(target)
            prompt: str | Sequence[dict[str, Any]] = task
            if judge is not None:
                assert inputs is not None
                prompt = render_prompt(judge, inputs, inputs_dir)
            run.trace = await harness.run(
                prompt, runtime=target, model=plan.endpoint, budget=spec.budget
            )
            if judge is not None:
                run.verdict = await collect_verdict(judge, run.trace, guard)
    except anyio.get_cancelled_exc_class():
        if judge is not None:
            _record_failure(run, JudgeCancelled(spec.name, "cancelled before it finished"), harness)
        raise
    except Exception as exc:
        if judge is None:
            raise
        error = as_judge_error(spec.name, exc)
        _record_failure(run, error, harness)
        if error is exc:
            raise
        raise error from exc
    finally:
        run.seconds = time.monotonic() - clock
        run.finished = time.time()


def _record_failure(run: AgentRun, exc: JudgeError, harness: Harness | None) -> None:
    """Put ``exc`` on ``run`` (and ``run`` on ``exc``); a run that ended before its harness
    returned keeps the trace its harness recorded so far."""
    if run.trace is None and harness is not None and harness.current_trace is not None:
        run.trace = harness.current_trace
        if run.trace.finished_at is None:
            run.trace.finish()
    exc.trace = run.trace
    exc.run = run
    run.error = str(exc)
    run.error_type = type(exc).__name__
    run._exception = exc
    if run.trace is not None:
        run.trace.metadata["failure"] = {"type": type(exc).__name__, "message": str(exc)}


JudgesHook: TypeAlias = Callable[
    [dict[str, Any], Trace, Runtime | None],
    Sequence[JudgeSpec] | Awaitable[Sequence[JudgeSpec]],
]
"""``judges(task, trace, runtime) -> list[JudgeSpec]`` (plain or ``async``): the judges a
taskset wants for one finished rollout. An empty list means the rollout is not judged."""


async def select_judges(
    judges: Sequence[JudgeSpec] | JudgesHook,
    *,
    task: dict[str, Any],
    trace: Trace,
    runtime: Runtime | None,
) -> list[JudgeSpec]:
    """The judges for one rollout: ``judges`` itself, or what the hook returns for it.

    Raises:
        JudgesHookFailed: the hook raised (chained), or returned something other than a
            list of :class:`~placement.specs.JudgeSpec`.
    """
    if not callable(judges):
        chosen: object = judges
    else:
        try:
            chosen = judges(task, trace, runtime)
            if inspect.isawaitable(chosen):
                chosen = await chosen
        except Exception as exc:
            raise JudgesHookFailed(f"the judges hook raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(chosen, Sequence) or isinstance(chosen, str | bytes):
        raise JudgesHookFailed(f"judges must be a list of JudgeSpec, got {type(chosen).__name__}")
    wrong = [type(j).__name__ for j in chosen if not isinstance(j, JudgeSpec)]
    if wrong:
        raise JudgesHookFailed(f"judges must be JudgeSpec objects, got {wrong}")
    return list(chosen)


def check_unique_names(judges: Sequence[JudgeSpec]) -> None:
    """Raises PlacementConfigError: two judges share a name (their runs, verdicts and
    inputs dirs are told apart by it)."""
    names = [j.name for j in judges]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise PlacementConfigError(f"judge names must be unique; repeated: {repeated}")


async def run_judges(
    judges: Sequence[JudgeSpec] | JudgesHook,
    *,
    task: dict[str, Any],
    trace: Trace,
    models: ModelTable,
    runtime: Runtime | None = None,
    policy: ModelEndpoint | None = None,
    strict: bool = True,
    on_done: Callable[[AgentRun], None] | None = None,
    deadline: float | None = None,
    pools: Sequence[RuntimePool] | None = None,
) -> list[AgentRun]:
    """Judge one finished rollout. Runs come back in the order of the judges.

    ``judges`` is a list of specs or a :data:`JudgesHook` called with ``(task, trace,
    runtime)``; an empty list judges nothing and returns ``[]``. Before any sandbox work
    every judge's harness, model name and API-key variable are checked
    (:func:`plan_agent`): if one fails, no judge runs — the failing ones carry their typed
    error (:class:`~placement.errors.JudgeModelUnresolved`, ...), the others
    :class:`~placement.errors.JudgeCancelled`. Rollout-placed judges then run one after
    another in ``runtime``, clean-room judges concurrently; a judge that fails does not
    stop the others, and every run comes back with its trace. A clean-room judge whose
    placement config is served by one of ``pools`` (:class:`~runtimes.pool.RuntimePool`)
    acquires its sandbox from it instead of starting one (``docs/pools.md``).

    ``deadline`` (seconds) bounds the whole scoring stage: when it expires every judge
    still running is stopped (its processes in the rollout's sandbox killed, its inputs
    dir removed) and every unfinished run fails with
    :class:`~placement.errors.JudgeBudgetExceeded`. Cancelling ``run_judges`` does the
    same cleanup (shielded), records the unfinished runs as ``JudgeCancelled`` and then
    lets the cancellation propagate.

    Every run, failed ones included, is also kept on the rollout's ``trace``:
    ``trace.agents`` (with each judge's own trace) and the judges' usage summed in
    ``trace.extra_usage["judges"]`` (:meth:`~harnesses.base.Trace.attach_agents`).

    Raises:
        JudgingFailed: (when ``strict``) one or more judges failed; ``err.runs`` has all
            runs and ``err.exceptions`` the typed :class:`JudgeError` of each failure
            (not the ``JudgeCancelled`` of judges that never started).
        PlacementConfigError: two judges share a name, a rollout-placed judge needs a
            runtime and none was given, or ``deadline`` is not positive; before any work.
        JudgesHookFailed: the judges hook raised or returned something else than specs.

    Each rollout-placed judge first stops what the policy (or an earlier judge) left
    running (:func:`run_agent`); a sweep that fails is that judge's ``JudgeSandboxLost``.
    """
    specs = await select_judges(judges, task=task, trace=trace, runtime=runtime)
    check_unique_names(specs)
    if deadline is not None and not deadline > 0:
        raise PlacementConfigError(f"the scoring deadline must be positive, got {deadline}")
    runs = [new_run(spec, "judge") for spec in specs]
    failures: dict[int, JudgeError] = {}
    plans = _plan_judges(specs, runs, failures, models=models, runtime=runtime, policy=policy)
    try:
        inputs = None if failures else _judge_inputs(specs, runs, failures, task, trace)
        if failures:
            _not_started(specs, runs, failures)
        elif inputs is not None:
            await _judge_all(
                specs, runs, plans, failures, runtime, inputs,
                deadline=deadline, on_done=on_done, pools=pools,
            )  # fmt: skip
    finally:
        trace.attach_agents([AgentRecord.of(run) for run in runs])  # provenance: trace.agents
    if strict and failures:
        errors = [failures[i] for i in sorted(failures)]
        raise JudgingFailed(f"{len(errors)} of {len(specs)} judges failed", errors, runs)
    return runs


def _plan_judges(
    specs: Sequence[JudgeSpec],
    runs: Sequence[AgentRun],
    failures: dict[int, JudgeError],
    *,
    models: ModelTable,
    runtime: Runtime | None,
    policy: ModelEndpoint | None,
) -> list[AgentPlan]:
    """Every judge's plan; a judge whose model or harness is wrong gets its typed error
    in ``failures`` (and on its run). Raises PlacementConfigError: no rollout runtime."""
    plans = []
    for index, spec in enumerate(specs):
        try:
            plans.append(plan_agent(spec, models=models, runtime=runtime, policy=policy))
        except (HarnessError, ModelConfigError) as exc:
            error = as_judge_error(spec.name, exc)
            error.__cause__ = exc
            _record_failure(runs[index], error, None)
            failures[index] = error
    return plans


def _judge_inputs(
    specs: Sequence[JudgeSpec],
    runs: Sequence[AgentRun],
    failures: dict[int, JudgeError],
    task: dict[str, Any],
    trace: Trace,
) -> JudgeInputs | None:
    """The judges' inputs; a malformed record fails every judge with
    :class:`~placement.errors.JudgeRecordInvalid` (in ``failures``, on each run)."""
    try:
        return JudgeInputs.take(task, trace)
    except RecordInvalid as exc:
        for index, spec in enumerate(specs):
            error = as_judge_error(spec.name, exc)
            error.__cause__ = exc
            _record_failure(runs[index], error, None)
            failures[index] = error
        return None


def _not_started(
    specs: Sequence[JudgeSpec], runs: Sequence[AgentRun], failures: dict[int, JudgeError]
) -> None:
    failed = [specs[i].name for i in sorted(failures)]
    for index, spec in enumerate(specs):
        if index not in failures:
            message = f"not started: judges {failed} failed their checks, so no judge ran"
            _record_failure(runs[index], JudgeCancelled(spec.name, message), None)


async def _judge_all(
    specs: Sequence[JudgeSpec],
    runs: Sequence[AgentRun],
    plans: Sequence[AgentPlan],
    failures: dict[int, JudgeError],
    runtime: Runtime | None,
    inputs: JudgeInputs,
    *,
    deadline: float | None,
    on_done: Callable[[AgentRun], None] | None,
    pools: Sequence[RuntimePool] | None,
) -> None:
    """Run the planned judges (rollout ones in turn, clean-room ones concurrently) within
    ``deadline``; failures go to ``failures``."""
    settled: set[int] = set()

    def settle(index: int) -> None:
        settled.add(index)
        if on_done is not None:
            on_done(runs[index])

    fork: SandboxSnapshot | None = None

    async def one(index: int) -> None:
        try:
            await _execute(
                specs[index], "", runs[index], plans[index],
                runtime=runtime, inputs=inputs, role="judge", pools=pools, fork=fork,
            )  # fmt: skip
        except JudgeError as exc:
            failures[index] = exc
        settle(index)

    def fail(index: int, exc: Exception) -> None:
        error = as_judge_error(specs[index].name, exc)
        error.__cause__ = exc
        _record_failure(runs[index], error, None)
        failures[index] = error
        settle(index)

    async def sequentially(indices: list[int]) -> None:
        for index in indices:
            await one(index)

    forked = [i for i, p in enumerate(plans) if p.fork and p.needs_runtime]
    with anyio.move_on_after(math.inf if deadline is None else deadline) as scope:
        try:
            if forked and runtime is not None:
                try:
                    fork = await take_fork(runtime)  # before any judge touches the sandbox
                except SandboxError as exc:
                    for index in forked:
                        fail(index, exc)
            async with anyio.create_task_group() as tg:
                tg.start_soon(sequentially, [i for i, p in enumerate(plans) if not p.own_sandbox])
                for index, plan in enumerate(plans):
                    if plan.own_sandbox and index not in settled:
                        tg.start_soon(one, index)
        finally:
            if fork is not None:
                with anyio.CancelScope(shield=True):
                    await drop_fork(fork)
    if scope.cancelled_caught:
        for index, run in enumerate(runs):
            if index not in settled:
                when = "while it ran" if run.started else "before it started"
                message = f"the scoring deadline of {deadline}s expired {when}"
                if run.trace is not None:
                    run.trace.fail("budget_time", message)
                failures[index] = JudgeBudgetExceeded(specs[index].name, message)
                _record_failure(run, failures[index], None)
                settle(index)
