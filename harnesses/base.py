"""The :class:`Harness` contract, budgets and the run :class:`Trace`.

A harness is who runs an agent. It knows how to provision itself into a runtime
(:meth:`Harness.setup`: idempotent, safe when several runs share one sandbox) and how to
run one agent session against a model endpoint under a :class:`Budget`
(:meth:`Harness.run`), producing a :class:`Trace`.

A run does not raise for what goes wrong *inside* the session: an exhausted budget, a
model error or a lost sandbox ends the run and is recorded, typed, on
``trace.error`` (see :data:`ErrorKind`); ``trace.raise_for_error()`` re-raises it when a
caller prefers exceptions. Cancelling the awaiting task still cancels the run.

Harness configs are pydantic models selected by ``id`` (``{"id": "bash", ...}``) and
narrowed to the harness's own ``config_model`` by :mod:`harnesses.registry`.
"""

from __future__ import annotations

import abc
import datetime as _dt
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, computed_field

from runtimes import Runtime

from .errors import HarnessConfigError, HarnessError, ModelError, ModelHTTPError
from .llm import ChatClient, ChatReply, Message, ModelEndpoint, Usage

__all__ = [
    "AgentRecord",
    "Budget",
    "BudgetClock",
    "CommandHook",
    "ErrorKind",
    "Harness",
    "HarnessConfig",
    "ToolResult",
    "Trace",
    "TraceError",
    "Turn",
    "TurnRecorder",
    "call_model",
    "for_policy",
    "task_messages",
]

ErrorKind = Literal[
    "budget_turns",
    "budget_tokens",
    "budget_time",
    "model_error",
    "sandbox_error",
    "agent_error",
    "install_error",
]
"""Why a run ended early. ``budget_*``: a budget was exhausted; ``model_error``: the
model endpoint failed (``status_code`` set for HTTP errors); ``sandbox_error``: the
sandbox died or its channel failed; ``agent_error``: an installed agent exited
abnormally; ``install_error``: provisioning the agent failed."""


class Budget(BaseModel):
    """Limits of one run. ``None`` means unlimited.

    ``max_turns`` counts model calls; ``max_tokens`` counts total tokens (prompt plus
    completion, as reported by the endpoint) over the run; ``max_seconds`` is wall time.
    Turns and tokens are checked before each model call, so a run can end one turn past
    ``max_tokens`` (the call that crossed it); wall time is also a hard deadline that
    cancels a model call or command in flight.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int | None = Field(default=50, ge=0)
    max_tokens: int | None = Field(default=None, ge=0)
    max_seconds: float | None = Field(default=None, gt=0)


TurnRecorder = Literal["harness", "proxy"]
"""Who recorded a :class:`Turn`. ``harness``: a host-side harness loop built the request and
ran the tools itself, so the messages are what was sent (their *content* still came from the
model and the sandbox). ``proxy``: the model proxy relayed an installed agent's request; the
request's messages are the agent's claim about the conversation so far, only the reply (and
the fact that a request was made) is what the host itself saw."""


class TraceError(BaseModel):
    """A typed reason why a run ended early."""

    kind: ErrorKind
    message: str
    exception_type: str | None = None
    status_code: int | None = None


class ToolResult(BaseModel):
    """One tool call executed by the harness, and what the model was shown."""

    call_id: str
    name: str
    arguments: str
    output: str
    exit_code: int | None = None
    timed_out: bool = False
    duration: float = 0.0


class Turn(BaseModel):
    """One model call: the messages sent, the reply, the tools it triggered."""

    index: int
    started_at: _dt.datetime
    request_messages: list[Message]
    reply: ChatReply | None = None
    tool_results: list[ToolResult] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    latency: float = 0.0
    status_code: int | None = None
    error: str | None = None
    recorded_by: TurnRecorder = Field(
        default="harness",
        description=(
            "who recorded this turn: 'harness' (the host-side harness loop sent the request "
            "itself), or 'proxy' (the model proxy saw an installed agent's request: its "
            "`request_messages` are the history the agent *claims*, only the reply is seen)"
        ),
    )
    dropped_params: list[str] = Field(
        default_factory=list,
        description="request fields the model proxy dropped (not on its allowlist for the mode)",
    )
    proxy_notes: list[str] = Field(
        default_factory=list,
        description="what else the model proxy changed: a clamped max_tokens, content cut "
        "from this record, a reply cut at the budget",
    )


def utc_now() -> _dt.datetime:
    return _dt.datetime.now(_dt.UTC)


class Trace(BaseModel):
    """Everything one run did. JSON-serialisable (``trace.model_dump_json()``)."""

    harness: str
    model: str | None = None
    turns: list[Turn] = Field(default_factory=list)
    started_at: _dt.datetime = Field(default_factory=utc_now)
    finished_at: _dt.datetime | None = None
    duration: float = 0.0
    output: str | None = None
    error: TraceError | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    agents: list[AgentRecord] = Field(
        default_factory=list,
        description="other agents run on this rollout (its judges), in the order they ran",
    )
    extra_usage: dict[str, Usage] = Field(
        default_factory=dict,
        description="usage of those agents, summed per role ('judges'); never in `usage`",
    )

    _clock: float = PrivateAttr(default_factory=time.monotonic)
    _exception: BaseException | None = PrivateAttr(default=None)

    @property
    def exception(self) -> BaseException | None:
        """The exception :meth:`fail` recorded (not serialised; ``error`` describes it)."""
        return self._exception

    @computed_field  # type: ignore[prop-decorator]
    @property
    def usage(self) -> Usage:
        """This run's own model usage (its turns): what its budget counts."""
        total = Usage()
        for turn in self.turns:
            total = total + turn.usage
        return total

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_usage(self) -> Usage:
        """:attr:`usage` plus every entry of :attr:`extra_usage`: the rollout's whole spend."""
        total = self.usage
        for spent in self.extra_usage.values():
            total = total + spent
        return total

    def attach_agents(self, records: Sequence[AgentRecord]) -> None:
        """Keep ``records`` (e.g. a rollout's judge runs) on this trace: appended to
        :attr:`agents`, and each one's usage added to :attr:`extra_usage` under its role's
        key (:func:`usage_key`). Calling it again (a second judging) appends, it does not
        replace: every run that spent tokens stays on the record."""
        for record in records:
            self.agents.append(record)
            key = usage_key(record.role)
            spent = record.trace.usage if record.trace is not None else Usage()
            self.extra_usage[key] = self.extra_usage.get(key, Usage()) + spent

    @property
    def ok(self) -> bool:
        return self.error is None

    def elapsed(self) -> float:
        """Seconds since the trace was created (monotonic)."""
        return time.monotonic() - self._clock

    def fail(
        self,
        kind: ErrorKind,
        message: str,
        exception: BaseException | None = None,
        *,
        status_code: int | None = None,
    ) -> TraceError:
        """Record why the run ended early. The first reason wins; later ones are ignored.

        ``status_code`` defaults to the exception's, for a :class:`ModelHTTPError`.
        """
        if self.error is not None:
            return self.error
        status = status_code
        if status is None and isinstance(exception, ModelHTTPError):
            status = exception.status_code
        self.error = TraceError(
            kind=kind,
            message=message,
            exception_type=type(exception).__name__ if exception is not None else None,
            status_code=status,
        )
        self._exception = exception
        return self.error

    def finish(self, output: str | None = None) -> Trace:
        """Stamp the end time (and the output, if given); returns ``self``."""
        if output is not None:
            self.output = output
        self.finished_at = utc_now()
        self.duration = self.elapsed()
        return self

    def raise_for_error(self) -> None:
        """Re-raise what ended the run, if anything.

        Raises:
            ModelError / SandboxError: the original typed exception of a model or sandbox
                failure.
            HarnessError: a budget was exhausted, or another recorded reason.
        """
        if self.error is None:
            return
        if self._exception is not None:
            raise self._exception
        raise HarnessError(
            f"{self.harness} run ended early ({self.error.kind}): {self.error.message}"
        )


AgentRole = Literal["policy", "judge", "agent"]
"""What an agent run was for: the rollout's ``policy``, a ``judge`` of it, another ``agent``."""

_USAGE_KEYS: dict[str, str] = {"judge": "judges", "agent": "agents", "policy": "policy"}


def usage_key(role: str) -> str:
    """The :attr:`Trace.extra_usage` key of a role: ``"judge"`` -> ``"judges"``."""
    return _USAGE_KEYS.get(role, role)


class AgentRecord(BaseModel):
    """Provenance of one agent run, as kept on the rollout's trace (:attr:`Trace.agents`).

    The fields of :class:`placement.run.AgentRun` (``harnesses`` does not import
    ``placement``): who ran, in which role, with which logical model, whether its turns
    may be trained on, where it was placed, its own trace (turns and usage), its verdict
    and, for a failed run, the error's message and type name.
    """

    name: str
    role: AgentRole
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

    @classmethod
    def of(cls, run: BaseModel) -> AgentRecord:
        """The record of a run model that has these fields (an ``AgentRun``); its trace
        is shared, not copied."""
        return cls(**{name: getattr(run, name) for name in cls.model_fields if hasattr(run, name)})


Trace.model_rebuild()


class BudgetClock:
    """Checks a :class:`Budget` against a :class:`Trace` between turns."""

    def __init__(self, budget: Budget, trace: Trace):
        self.budget = budget
        self.trace = trace

    def exhausted(self) -> tuple[ErrorKind, str] | None:
        """The budget that forbids another model call, with a message; ``None`` if none."""
        budget, trace = self.budget, self.trace
        if budget.max_turns is not None and len(trace.turns) >= budget.max_turns:
            return "budget_turns", f"turn budget of {budget.max_turns} exhausted"
        used = trace.usage.total_tokens
        if budget.max_tokens is not None and used >= budget.max_tokens:
            return "budget_tokens", f"token budget exhausted: {used} of {budget.max_tokens} used"
        if budget.max_seconds is not None and trace.elapsed() >= budget.max_seconds:
            return "budget_time", f"time budget of {budget.max_seconds}s exhausted"
        return None

    def remaining_seconds(self) -> float:
        """Seconds left of the wall-time budget (``inf`` when unlimited)."""
        if self.budget.max_seconds is None:
            return float("inf")
        return max(0.0, self.budget.max_seconds - self.trace.elapsed())

    def record_time_out(self) -> None:
        """Record that the wall-time deadline cancelled the run (and the turn in flight)."""
        if self.trace.turns and self.trace.turns[-1].reply is None:
            self.trace.turns[-1].error = (
                self.trace.turns[-1].error or "cancelled by the time budget"
            )
        self.trace.fail("budget_time", f"time budget of {self.budget.max_seconds}s exhausted")

    def record_exhaustion(self) -> bool:
        """Record the exhausted budget on the trace, if any; whether one was."""
        reason = self.exhausted()
        if reason is None:
            return False
        self.trace.fail(*reason)
        return True


async def call_model(
    client: ChatClient,
    messages: Sequence[Message],
    trace: Trace,
    *,
    tools: Sequence[dict[str, Any]] | None = None,
) -> Turn:
    """One model call recorded as a new turn on ``trace``.

    A model failure is recorded on the turn and on the trace (``model_error``) and the
    turn's ``reply`` is ``None``; nothing is raised.
    """
    turn = Turn(index=len(trace.turns), started_at=utc_now(), request_messages=list(messages))
    trace.turns.append(turn)
    started = time.monotonic()
    try:
        reply = await client.chat(messages, tools)
    except ModelError as exc:
        turn.latency = time.monotonic() - started
        turn.error = str(exc)
        turn.status_code = exc.status_code if isinstance(exc, ModelHTTPError) else None
        trace.fail("model_error", str(exc), exc)
        return turn
    turn.reply = reply
    turn.usage = reply.usage
    turn.latency = reply.latency
    turn.status_code = 200
    return turn


class HarnessConfig(BaseModel):
    """Fields every harness understands. Each harness subclasses it with ``id: Literal[...]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str


def task_messages(task: str | Sequence[Message], system_prompt: str | None = None) -> list[Message]:
    """The opening conversation: a task string becomes ``[system?, user]``; messages are kept.

    Raises:
        HarnessConfigError: ``task`` is empty, or a message is not a dict with a role.
    """
    if isinstance(task, str):
        if not task.strip():
            raise HarnessConfigError("the task is empty")
        messages: list[Message] = []
        if system_prompt:
            messages.append({"role": "system", "content": system_prompt})
        messages.append({"role": "user", "content": task})
        return messages
    copied = [dict(m) for m in task]
    if not copied or any(not isinstance(m.get("role"), str) for m in copied):
        raise HarnessConfigError(
            "a task given as messages needs at least one message, each with a role"
        )
    if system_prompt and copied[0]["role"] != "system":
        copied.insert(0, {"role": "system", "content": system_prompt})
    return copied


CommandHook = Callable[[Runtime, str, ToolResult], Awaitable[None]]
"""A hook run after each of an agent's commands: ``(runtime, command, result)``."""


def for_policy(harness: Harness, runtime: Runtime) -> Harness:
    """The harness that runs a rollout's policy in ``runtime``: the same, with its commands
    run as the runtime's :attr:`~runtimes.base.Runtime.policy_user` when the runtime keeps
    one and the harness has a ``user`` setting left unset (``bash``, installed harnesses).
    Its installs still run as the sandbox's default user.

    Raises:
        HarnessConfigError: the runtime keeps a policy account and the harness runs
            commands (``needs_runtime``) but has no ``user`` setting: its commands would run
            as the sandbox's default user (root), with more privilege than the policy has.
    """
    return run_as(harness, runtime.policy_user, "the policy account")


def for_judge(harness: Harness, runtime: Runtime) -> Harness:
    """The harness that runs a judge in ``runtime``: its commands run as the runtime's
    :attr:`~runtimes.base.Runtime.judge_user` where there is one (the judges' own account:
    neither root nor the policy's), as :func:`for_policy` does for the policy.

    Raises:
        HarnessConfigError: as :func:`for_policy`, for the judges' account.
    """
    return run_as(harness, runtime.judge_user, "the judges' account")


def run_as(harness: Harness, user: str | None, account: str = "the account") -> Harness:
    """``harness`` with its commands run as ``user``, unless ``user`` is ``None`` or the
    caller set one (which wins).

    Raises:
        HarnessConfigError: ``user`` is given and the harness runs commands
            (``needs_runtime``) but has no ``user`` setting: its commands would run as the
            sandbox's default user (root), with more privilege than ``account`` has.
    """
    config = harness.config
    settable = "user" in type(config).model_fields
    if user is not None and harness.needs_runtime and not settable:
        raise HarnessConfigError(
            f"the {harness.id!r} harness has no 'user' setting, so its commands cannot run as "
            f"{account} {user!r}: add a 'user' field to its config, or set policy_user=None "
            "in the runtime config to run the policy (and judges) as the default user"
        )
    if user is None or not settable or getattr(config, "user", None):
        return harness
    return type(harness)(config.model_copy(update={"user": user}))


class Harness(abc.ABC):
    """Runs one kind of agent. Subclass it, set ``id`` and ``config_model``, implement :meth:`run`.

    ``needs_runtime`` says whether :meth:`run` needs a sandbox (the ``null`` harness
    does not).
    """

    id: ClassVar[str] = "harness"
    config_model: ClassVar[type[HarnessConfig]] = HarnessConfig
    needs_runtime: ClassVar[bool] = True
    current_trace: Trace | None = None
    """The trace of this harness's run in progress (or last run), from :meth:`new_trace`."""

    def __init__(self, config: HarnessConfig | None = None):
        """Raises: HarnessConfigError: ``config`` is not this harness's config model."""
        if config is None:
            config = self.config_model.model_validate({"id": self.id})
        if not isinstance(config, self.config_model):
            raise HarnessConfigError(
                f"{type(self).__name__} needs a {self.config_model.__name__}, "
                f"got {type(config).__name__}"
            )
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    async def setup(self, runtime: Runtime | None) -> None:
        """Provision the harness into ``runtime``. Idempotent; safe to call concurrently
        from several runs sharing one sandbox. The default does nothing.

        Raises:
            HarnessInstallError: provisioning failed (installed harnesses).
            SandboxError: the sandbox failed (typed, from :mod:`runtimes.errors`).
        """
        return None

    @abc.abstractmethod
    async def run(
        self,
        task: str | Sequence[Message],
        *,
        runtime: Runtime | None,
        model: ModelEndpoint,
        budget: Budget | None = None,
    ) -> Trace:
        """Run one agent session on ``task`` and return its trace.

        Budget exhaustion, model errors and sandbox failures end the run and are
        recorded on ``trace.error``; they are not raised.

        Raises:
            HarnessConfigError: an empty task, or ``runtime`` is ``None`` for a harness
                that needs one.
            ModelConfigError: the endpoint's API key variable is not set.
        """

    def add_command_hook(self, hook: CommandHook) -> bool:
        """Ask for ``await hook(runtime, command, result)`` after each command the agent
        runs in the sandbox, before the model sees its result. Returns whether this
        harness can: one that runs its agent as a single process (an installed agent)
        cannot, and the default says so (``False``). A hook may raise ``SandboxError``;
        the run then ends with ``sandbox_error`` on its trace.
        """
        del hook
        return False

    def set_command_user(self, user_for: Callable[[str], str | None]) -> bool:
        """Ask that each command the agent runs in the sandbox run as ``user_for(command)``.
        Returns whether this harness can: one that runs its agent as a single process (an
        installed agent) cannot, and the default says so (``False``).
        """
        del user_for
        return False

    def _require_runtime(self, runtime: Runtime | None) -> Runtime:
        if runtime is None:
            raise HarnessConfigError(f"the {self.id!r} harness needs a runtime; got None")
        return runtime

    def new_trace(self, model: ModelEndpoint) -> Trace:
        """A fresh trace for a run; also kept as :attr:`current_trace`, so a caller whose
        run was cancelled still has the turns recorded so far."""
        self.current_trace = Trace(harness=self.id, model=model.model)
        return self.current_trace
