"""Running agents and judges where their spec places them.

:func:`run_agent` is a standalone executor: it provisions the harness per placement,
materialises the inputs, runs, collects the outputs before an owned sandbox is torn
down, and records a failure onto the run's own trace before raising.

:func:`run_judges` takes one input snapshot, stops what the policy left running in the
live sandbox, runs rollout-placed judges there one after another and clean-room judges
concurrently in fresh sandboxes of their own, and fails the rollout with
:class:`~placement.errors.JudgingFailed` when any judge fails.

A file-verdict judge's verdict is watched by a :class:`~placement.guard.VerdictGuard`:
processes are stopped before each rollout-placed judge, after each of its commands (for
harnesses that run commands one by one) and before its verdict is read; the verdict must
be a regular file last changed by a command of the judge's that names it.
"""

from __future__ import annotations

import contextlib
import json
import string
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationError

from harnesses.base import HarnessConfig, Trace, for_policy
from harnesses.models import ModelEndpoint, ModelTable
from harnesses.null import parse_reply_json
from harnesses.registry import load_harness_class, open_harness, resolve_harness_config
from runtimes import (
    Runtime,
    SandboxError,
    open_runtime,
)

from .errors import (
    InputTamperError,
    JudgeBudgetExceeded,
    JudgeError,
    JudgeInputsTampered,
    JudgeModelFailed,
    JudgeSandboxLost,
    JudgingFailed,
    PlacementConfigError,
    VerdictInvalid,
)
from .guard import VerdictGuard
from .inputs import VERDICT_FILE, Snapshot, materialise, new_agent_id
from .specs import AgentSpec, JudgeSpec

Role = Literal["policy", "judge", "agent"]


class AgentRun(BaseModel):
    """Provenance of one agent run: who, with which model, trainable or not, what it did."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: str
    role: Role
    model: str
    trainable: bool
    placement: str
    agent_id: str
    trace: Trace | None = None
    verdict: dict[str, Any] | None = None
    error: str | None = None
    error_type: str | None = None
    seconds: float = 0.0
    started: float = 0.0
    finished: float = 0.0

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
    config = spec.runtime_config()
    return "rollout" if config is None else f"clean-room:{config.type}"


def render_prompt(spec: JudgeSpec, snapshot: Snapshot, inputs_dir: str | None) -> str:
    """The judge's prompt with its inputs and the verdict instructions filled in."""
    schema = json.dumps(spec.verdict_schema.model_json_schema(), indent=2)
    verdict_path = f"{inputs_dir}/{VERDICT_FILE}" if inputs_dir else ""
    values = {
        "inputs_dir": inputs_dir or "",
        "verdict_path": verdict_path,
        "schema": schema,
        "task": snapshot.task_json.decode(),
        "transcript": snapshot.transcript_md.decode(),
    }
    body = string.Template(spec.prompt).safe_substitute(values)
    if spec.verdict_source() == "file":
        return (
            f"{body}\n\nYour inputs are in {inputs_dir}/: task.json (the task), transcript.md "
            f"(the policy's run, readable) and trace.json (the same, as data). The policy's "
            f"work is in the current directory. When you have decided, write your verdict as "
            f"JSON to {verdict_path} (also $VF_AGENT_VERDICT in your commands), matching this "
            f"JSON schema:\n{schema}\nWrite it with a command that names it, after running "
            f"any program you judge: a change to it made by a command that does not name it "
            f"is refused as tampering. Nothing you start outlives its command."
        )
    return (
        f"{body}\n\n## Task\n{values['task']}\n\n## Transcript\n{values['transcript']}\n\n"
        f"Reply with only your verdict as JSON (bare, or one ```json block), matching this "
        f"JSON schema:\n{schema}"
    )


async def run_agent(
    spec: AgentSpec,
    task: str | Sequence[dict[str, Any]],
    *,
    models: ModelTable,
    runtime: Runtime | None = None,
    policy: ModelEndpoint | None = None,
    snapshot: Snapshot | None = None,
    role: Role = "agent",
) -> AgentRun:
    """Run one agent (or judge) where its spec places it, and collect what it produced.

    For a :class:`JudgeSpec`, ``snapshot`` is required and the verdict is collected and
    validated; a failure is recorded on the run (``error``) and on its trace
    (``trace.metadata["failure"]``), then raised. With ``role="policy"`` the agent's
    commands run as the runtime's ``policy_user`` where it keeps one
    (:func:`harnesses.base.for_policy`).

    Raises:
        PlacementConfigError: rollout placement without a runtime for a harness that
            needs one; a judge without a snapshot.
        VerdictMissing / VerdictInvalid / JudgeSandboxLost / JudgeBudgetExceeded /
            JudgeModelFailed: the judge failed, for that cause.
        JudgeInputsTampered: the inputs dir was planted, or the verdict was changed by
            something other than the judge's own commands, or is a link it did not make.
        SandboxError / ProvisioningError: an agent's (non-judge) sandbox failed.
    """
    judge = spec if isinstance(spec, JudgeSpec) else None
    if judge is not None and snapshot is None:
        raise PlacementConfigError(f"judge {spec.name!r} needs the rollout snapshot")
    agent_id = new_agent_id(spec.name)
    run = AgentRun(
        name=spec.name,
        role="judge" if judge else role,
        model=spec.model,
        trainable=spec.trainable,
        placement=_placement_label(spec),
        agent_id=agent_id,
        started=time.time(),
    )
    harness_config = resolve_harness_config(spec.harness)
    needs_runtime = load_harness_class(harness_config.id).needs_runtime
    endpoint = models.resolve(spec.model, policy=policy)
    clean_room = spec.runtime_config()
    if clean_room is None and needs_runtime and runtime is None:
        raise PlacementConfigError(
            f"{spec.name!r} is placed in the rollout but no rollout runtime was given"
        )
    clock = time.monotonic()
    try:
        async with AsyncExitStack() as stack:
            target = runtime if needs_runtime else None
            if needs_runtime and clean_room is not None:
                target = await stack.enter_async_context(open_runtime(clean_room))
            inputs_dir = None
            if judge is not None and target is not None and clean_room is None:
                await target.stop_processes()  # nothing the policy or a judge left is alive
            if target is not None and snapshot is not None:
                inputs_dir = await materialise(target, agent_id, snapshot)
                stack.push_async_callback(_remove_inputs, target, inputs_dir)
            harness = open_harness(_with_input_env(harness_config, inputs_dir))
            if role == "policy" and target is not None:
                harness = for_policy(harness, target)
            guard = None
            if judge is not None and target is not None and inputs_dir is not None:
                guard = VerdictGuard(target, inputs_dir, spec.name, judge.verdict_max_bytes)
                await guard.start()
                harness.add_command_hook(guard.after_command)
            if target is not None:
                await harness.setup(target)
            prompt: str | Sequence[dict[str, Any]] = task
            if judge is not None:
                assert snapshot is not None
                prompt = render_prompt(judge, snapshot, inputs_dir)
            run.trace = await harness.run(
                prompt, runtime=target, model=endpoint, budget=spec.budget
            )
            if judge is not None:
                run.verdict = await _collect_verdict(judge, run.trace, guard)
    except JudgeError as exc:
        _record_failure(run, exc)
        raise
    except InputTamperError as exc:
        if judge is None:
            raise
        tampered = JudgeInputsTampered(spec.name, str(exc), run.trace)
        _record_failure(run, tampered)
        raise tampered from exc
    except SandboxError as exc:
        if judge is None:
            raise
        lost = JudgeSandboxLost(spec.name, f"sandbox failed: {exc}", run.trace)
        _record_failure(run, lost)
        raise lost from exc
    finally:
        run.seconds = time.monotonic() - clock
        run.finished = time.time()
    return run


INPUTS_ENV = "VF_AGENT_INPUTS"
VERDICT_ENV = "VF_AGENT_VERDICT"


def _with_input_env(config: HarnessConfig, inputs_dir: str | None) -> HarnessConfig:
    """Tell a tools harness where its inputs are: as shell variables its commands have
    but the programs they run do not inherit (``shell_vars``, the ``bash`` harness), or
    else through its commands' environment (``env``, installed agents)."""
    fields = type(config).model_fields
    if inputs_dir is None:
        return config
    values = {INPUTS_ENV: inputs_dir, VERDICT_ENV: f"{inputs_dir}/{VERDICT_FILE}"}
    for field in ("shell_vars", "env"):
        if field in fields:
            merged = {**(getattr(config, field, {}) or {}), **values}
            return config.model_copy(update={field: merged})
    return config


async def _remove_inputs(runtime: Runtime, inputs_dir: str) -> None:
    if not runtime.closed:
        with contextlib.suppress(SandboxError):  # the sandbox is gone; nothing to remove
            await runtime.remove(inputs_dir, missing_ok=True)


def _record_failure(run: AgentRun, exc: JudgeError) -> None:
    exc.trace = run.trace
    exc.run = run
    run.error = str(exc)
    run.error_type = type(exc).__name__
    run._exception = exc
    if run.trace is not None:
        run.trace.metadata["failure"] = {"type": type(exc).__name__, "message": str(exc)}


async def _collect_verdict(
    spec: JudgeSpec, trace: Trace, guard: VerdictGuard | None
) -> dict[str, Any]:
    if trace.error is not None:
        kind, message = trace.error.kind, trace.error.message
        if kind.startswith("budget_"):
            raise JudgeBudgetExceeded(spec.name, message, trace)
        if kind == "sandbox_error":
            raise JudgeSandboxLost(spec.name, message, trace)
        raise JudgeModelFailed(spec.name, f"{kind}: {message}", trace)
    if spec.verdict_source() == "reply":
        size = len((trace.output or "").encode("utf-8", "surrogateescape"))
        if size > spec.verdict_max_bytes:
            raise VerdictInvalid(
                spec.name, f"the reply is larger than {spec.verdict_max_bytes} bytes", trace
            )
        try:
            data = parse_reply_json(trace.output)
        except ValueError as exc:
            raise VerdictInvalid(spec.name, str(exc), trace) from exc
        return _validate(spec, data, trace)
    assert guard is not None
    raw = await guard.collect(trace)
    path = guard.path
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerdictInvalid(spec.name, f"{path} is not JSON: {exc}", trace) from exc
    except RecursionError:
        raise VerdictInvalid(spec.name, f"{path} is nested too deeply to parse", trace) from None
    return _validate(spec, data, trace)


def _validate(spec: JudgeSpec, data: Any, trace: Trace) -> dict[str, Any]:
    try:
        return spec.verdict_schema.model_validate(data).model_dump(mode="json")
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(verdict)'}: {e['msg']}" for e in exc.errors()
        )
        message = f"verdict does not match the schema: {problems}"
        raise VerdictInvalid(spec.name, message, trace) from None


async def run_judges(
    judges: Sequence[JudgeSpec],
    *,
    task: dict[str, Any],
    trace: Trace,
    models: ModelTable,
    runtime: Runtime | None = None,
    policy: ModelEndpoint | None = None,
    strict: bool = True,
    on_done: Callable[[AgentRun], None] | None = None,
) -> list[AgentRun]:
    """Judge one finished rollout. Runs come back in the order of ``judges``.

    Raises:
        JudgingFailed: (when ``strict``) one or more judges failed; ``err.runs`` has all
            runs and ``err.exceptions`` the typed :class:`JudgeError` of each failure.
        PlacementConfigError: a rollout-placed judge needs a runtime and none was given.

    Each rollout-placed judge first stops what the policy (or an earlier judge) left
    running (:func:`run_agent`); a sweep that fails is that judge's ``JudgeSandboxLost``.
    """
    snapshot = Snapshot.take(task, trace)
    in_rollout = [j for j in judges if j.runtime_config() is None]
    runs: dict[str, AgentRun] = {}
    failures: dict[str, JudgeError] = {}

    async def one(spec: JudgeSpec) -> None:
        try:
            runs[spec.name] = await run_agent(
                spec, "", models=models, runtime=runtime, policy=policy, snapshot=snapshot
            )
        except JudgeError as exc:
            failures[spec.name] = exc
            runs[spec.name] = exc.run or _failed_run(spec, exc)
        if on_done is not None:
            on_done(runs[spec.name])

    async def sequentially(specs: list[JudgeSpec]) -> None:
        for spec in specs:
            await one(spec)

    async with anyio.create_task_group() as tg:
        tg.start_soon(sequentially, in_rollout)
        for spec in judges:
            if spec.runtime_config() is not None:
                tg.start_soon(one, spec)
    ordered = [runs[j.name] for j in judges]
    if strict and failures:
        errors = [failures[j.name] for j in judges if j.name in failures]
        raise JudgingFailed(f"{len(errors)} of {len(judges)} judges failed", errors, ordered)
    return ordered


def _failed_run(spec: JudgeSpec, exc: JudgeError) -> AgentRun:
    run = AgentRun(
        name=spec.name,
        role="judge",
        model=spec.model,
        trainable=spec.trainable,
        placement=_placement_label(spec),
        agent_id="",
        trace=exc.trace,
        error=str(exc),
        error_type=type(exc).__name__,
    )
    run._exception = exc
    return run
