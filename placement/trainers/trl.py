"""vf-sandbox under TRL's ``GRPOTrainer``: a ``rollout_func`` and an ``environment_factory``.

Two ways in, both grading through the one verify contract (:mod:`~.grading`), and both
turning a failure of the machinery (a sandbox that died, a harness that could not start, a
check that could not run) into an *unscored* rollout: reward ``None``, which TRL leaves out
of the group's baseline and gives no advantage. Never ``0.0``.

**Gated sessions** (:func:`sandbox_rollout_func`): a real harness runs in each sandbox and
its model calls are answered by the trainer's model (:class:`~.generation.TransformersGenerator`
over ``trainer.model`` unless ``generate=`` is given, e.g. an
:class:`~harnesses.trainer.OpenAIGenerator` over vLLM)::

    rollouts = sandbox_rollout_func({"type": "docker", "image": "vf-sandbox/python"},
                                    {"id": "bash"}, verify=CommandCheck("pytest -q"))
    trainer = GRPOTrainer(model, reward_funcs=sandbox_reward, rollout_func=rollouts, ...)
    trainer.train()
    rollouts.close()

TRL hands ``rollout_func`` the prompts already repeated ``num_generations`` times (its
``RepeatSampler``), so each prompt is one rollout. ``env_mask`` is 1 exactly on the tokens
the model sampled (0 on tool output and the template's glue between turns).

**TRL's own tool loop** (:func:`sandbox_environment`): TRL generates and parses tool calls,
and each rollout's :class:`SandboxEnvironment` runs them in its own sandbox; ``get_reward``
grades the sandbox and releases it. Every public method of the environment class except
``reset`` and ``get_reward`` is a tool the model sees (TRL reads its signature and its
Google-style docstring), so a subclass adds a tool by adding a method; helpers must start
with ``_``.
"""

from __future__ import annotations

import collections
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

from harnesses.base import Budget
from harnesses.errors import SampleError
from harnesses.session import AgentSessionFactory, PrepareFn, VerifyFn
from harnesses.trainer import GenerateFn, RolloutResult, TrainingSample, build_sample, run_rollouts
from runtimes import Runtime
from runtimes.errors import SandboxError, SandboxTransportError, SandboxUnavailableError

from .generation import TransformersGenerator
from .grading import Graded, grade, unscored
from .host import RuntimeSpec, SandboxHost
from .tools import DEFAULT_TOOLS, SandboxTool, ToolLimits, call_tool

__all__ = [
    "SandboxEnvironment",
    "SandboxEnvironmentFactory",
    "SandboxRollouts",
    "sandbox_environment",
    "sandbox_reward",
    "sandbox_rollout_func",
]

log = logging.getLogger("placement.trainers")

T = TypeVar("T")
TaskFn = Callable[[Any], str | dict[str, Any]]
PROMPT_IDS = "prompt_token_ids"
_ROW_KEYS = ("prompt_ids", "completion_ids", "logprobs", "env_mask", "sandbox_reward")
_LIMITS = ToolLimits()
GRADED_KEPT = 4096
"""Gradings a factory keeps (:attr:`SandboxEnvironmentFactory.graded`): the latest ones."""
_STAGES = {"SessionStartError": "start", "SessionGenerateError": "generate"}


def task_from_prompt(prompt: Any) -> str | dict[str, Any]:
    """A harness task from a TRL prompt: the text itself, or the last user message's text."""
    if isinstance(prompt, str):
        return prompt
    for message in reversed(list(prompt)):
        if isinstance(message, Mapping) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            parts = [p.get("text", "") for p in content or [] if isinstance(p, Mapping)]
            return "".join(str(p) for p in parts)
    raise ValueError(f"the prompt has no user message to make a task of: {prompt!r:.200}")


def _tokenizer(trainer: Any) -> Any:
    processing = trainer.processing_class
    return getattr(processing, "tokenizer", processing)


def _unwrapped_model(trainer: Any) -> Any:
    accelerator = getattr(trainer, "accelerator", None)
    return trainer.model if accelerator is None else accelerator.unwrap_model(trainer.model)


class SandboxRollouts:
    """TRL's ``rollout_func`` over gated sessions: each prompt a gated rollout of ``harness``
    in a fresh sandbox of ``runtime``, scored by ``verify`` (pass :func:`sandbox_reward` as
    ``reward_funcs``). Nothing starts before the first call; :meth:`close` (or ``with``)
    closes the sessions' factory, the warm pool and the host's loop.

    Args:
        generate: answers the harness's model calls with token ids (default: a
            :class:`~.generation.TransformersGenerator` over the first caller's
            ``trainer.model``; with vLLM, an :class:`~harnesses.trainer.OpenAIGenerator`).
        budget: the agent's budget per rollout.
        concurrency: sandboxes alive at once.
        pool_size, pool_options: keep sandboxes started ahead (a
            :class:`~runtimes.pool.RuntimePool`; 0: start each when needed).
        sampling: overrides each request's sampling (default: TRL's ``temperature`` and
            ``top_p``, and ``max_completion_length`` as each *turn's* ``max_tokens``).
        task: a TRL prompt -> the harness's task (default: the last user message).
        factory_options: more :class:`~harnesses.session.AgentSessionFactory` arguments
            (``prepare``, ``setup_timeout``, ``model``, ...).

    After each call :attr:`last_results` and :attr:`last_samples` hold that batch's
    :class:`~harnesses.trainer.RolloutResult` and :class:`~harnesses.trainer.TrainingSample`
    (``None``: unscored), in the order of the prompts.
    """

    def __init__(
        self,
        runtime: RuntimeSpec,
        harness: Any,
        *,
        verify: VerifyFn,
        generate: GenerateFn | None = None,
        budget: Budget | None = None,
        concurrency: int = 8,
        pool_size: int = 0,
        pool_options: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        task: TaskFn = task_from_prompt,
        **factory_options: Any,
    ):
        self._host = SandboxHost(runtime, pool_size=pool_size, pool_options=pool_options)
        self._harness = harness
        self._options = {"verify": verify, "budget": budget, **factory_options}
        self._generate, self._concurrency, self._task = generate, concurrency, task
        self._sampling = dict(sampling) if sampling is not None else None
        self._factory: AgentSessionFactory | None = None
        self._prefix, self._calls = f"trl-{uuid.uuid4().hex[:8]}", 0
        self.last_results: list[RolloutResult] = []
        self.last_samples: list[TrainingSample | None] = []

    def _open(self) -> AgentSessionFactory:
        if self._factory is None:
            self._host.start()
            pool = self._host.pool
            pools = [pool] if pool is not None else None
            factory = AgentSessionFactory(
                self._host.config, self._harness, pools=pools, **self._options
            )
            self._factory = self._host.hold(factory)
        return self._factory

    def _generator(self, trainer: Any) -> tuple[GenerateFn, dict[str, Any]]:
        if self._generate is None:
            self._generate = TransformersGenerator(
                lambda: _unwrapped_model(trainer), _tokenizer(trainer)
            )
        sampling = self._sampling
        if sampling is None:  # TRL's own sampling settings, per turn
            sampling = {
                "max_tokens": getattr(trainer, "max_completion_length", None),
                "temperature": getattr(trainer, "temperature", None),
                "top_p": getattr(trainer, "top_p", None),
            }
            sampling = {k: v for k, v in sampling.items() if v is not None}
        return self._generate, sampling

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """One completion per prompt (TRL has already repeated each ``num_generations``
        times): ``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask``, and the extra
        fields ``sandbox_reward`` (``None``: unscored) and ``sandbox_metrics``."""
        factory = self._open()
        generate, sampling = self._generator(trainer)
        batch, self._calls = self._calls, self._calls + 1
        jobs = [(f"{self._prefix}-{batch}-{i}", self._task(p)) for i, p in enumerate(prompts)]
        try:
            results = self._host.call(
                run_rollouts, factory, jobs, generate, concurrency=self._concurrency,
                sampling=sampling,
            )  # fmt: skip
        finally:
            if isinstance(generate, TransformersGenerator):
                for rollout_id, _ in jobs:
                    generate.forget(rollout_id)
        out: dict[str, list[Any]] = {k: [] for k in (*_ROW_KEYS, "sandbox_metrics")}
        self.last_samples = []
        for prompt, result in zip(prompts, results, strict=True):
            sample, metrics = self._sample(result)
            self.last_samples.append(sample)
            if sample is None:
                eos = _tokenizer(trainer).eos_token_id
                ids = self._failed_prompt_ids(result, prompt, trainer)
                row: tuple[Any, ...] = (ids, [eos if isinstance(eos, int) else 0], [0.0], [0], None)
            else:
                assert sample.token_ids is not None and sample.loss_mask is not None
                start = len(result.record.turns[0].completion.metadata[PROMPT_IDS])  # type: ignore[union-attr]
                unknown = [0.0 if m == 0 else float("nan") for m in sample.loss_mask]
                logprobs = sample.logprobs or unknown  # NaN: TRL applies no correction there
                ids, mask = sample.token_ids, sample.loss_mask
                row = (ids[:start], ids[start:], logprobs[start:], mask[start:], sample.reward)
            for key, value in zip(_ROW_KEYS, row, strict=True):
                out[key].append(value)
            out["sandbox_metrics"].append(metrics)
        self.last_results = results
        return out

    @staticmethod
    def _sample(result: RolloutResult) -> tuple[TrainingSample | None, dict[str, Any]]:
        """The rollout's sample with its reward (``None``: unscored), and its metrics."""
        base = {"rollout_id": result.rollout_id}
        if not result.ok or result.record is None or result.verification is None:
            error_type = result.error_type or "SessionVerifyError"
            error = result.error or "the rollout was not verified"
            stage = _STAGES.get(error_type, "rollout")
            failed = {"scored": False, "stage": stage, "error_type": error_type}
            return None, {**base, **failed, "error": error}
        try:
            sample = build_sample(result.record)
            if sample.token_ids is None:
                raise SampleError("the turns carry no token ids (use a token-level generate)")
        except SampleError as exc:
            return None, {**base, **unscored(exc, "sample").metrics}
        verification = result.verification
        sample.reward = verification.reward
        details = {"scored": True, "reward": verification.reward, **dict(verification.details)}
        return sample, {**base, **details}

    @staticmethod
    def _failed_prompt_ids(result: RolloutResult, prompt: Any, trainer: Any) -> list[int]:
        record = result.record
        if record is not None and record.turns:
            ids = record.turns[0].completion.metadata.get(PROMPT_IDS)
            if isinstance(ids, list) and ids:
                return list(ids)
        tokenizer = _tokenizer(trainer)
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt, add_special_tokens=False)) or [0]
        ids = tokenizer.apply_chat_template(
            list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return list(ids)

    def close(self) -> None:
        """Close the sessions' factory, the pool and the host; idempotent."""
        self._factory = None
        self._host.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def sandbox_rollout_func(
    runtime: RuntimeSpec, harness: Any, *, verify: VerifyFn, **options: Any
) -> SandboxRollouts:
    """TRL's ``rollout_func`` running ``harness`` in sandboxes of ``runtime``, rewarded by
    ``verify``: a :class:`SandboxRollouts` (its doc lists ``options``)."""
    return SandboxRollouts(runtime, harness, verify=verify, **options)


def sandbox_reward(
    completions: list[Any], sandbox_reward: list[float | None] | None = None, **kwargs: Any
) -> list[float | None]:
    """TRL reward function of :func:`sandbox_rollout_func`: the sandbox's rewards, ``None``
    for an unscored rollout (TRL excludes it from the baseline; its advantage is 0)."""
    if sandbox_reward is None:
        raise ValueError("sandbox_reward needs the `sandbox_reward` field of sandbox_rollout_func")
    rewards = list(sandbox_reward)
    log_metric = kwargs.get("log_metric")
    if callable(log_metric) and rewards:
        log_metric("sandbox/unscored_ratio", sum(r is None for r in rewards) / len(rewards))
    return rewards


# ---------------------------------------------------------------------- environment_factory


@dataclass
class _Shared:
    """What every environment of one factory shares: the host and the configuration."""

    host: SandboxHost
    verify: VerifyFn
    tools: Sequence[SandboxTool]
    prepare: PrepareFn | None
    limits: ToolLimits
    verify_timeout: float | None
    environments: list[SandboxEnvironment] = field(default_factory=list)
    graded: collections.deque[Graded] = field(
        default_factory=lambda: collections.deque(maxlen=GRADED_KEPT)
    )


class SandboxEnvironment:
    """One rollout's sandbox under TRL's tool loop (made by :func:`sandbox_environment`).

    TRL pools the instances: ``reset(**row)`` before each rollout (a fresh sandbox),
    the tool methods during it, ``get_reward()`` once after it (grades, then releases the
    sandbox). Every public method but ``reset`` and ``get_reward`` is a tool: subclasses add
    tools as methods with type hints and a Google-style docstring, calling
    ``self._tool(name, **arguments)`` or using ``self._runtime`` through ``self._call``.
    """

    def __init__(self) -> None:
        self._shared: _Shared | None = None
        self._runtime: Runtime | None = None
        self._failure: Graded | None = None
        self._task: dict[str, Any] = {}
        self._messages: list[dict[str, Any]] = []
        self._rollout_id = ""

    def _attach(self, shared: _Shared) -> None:
        self._shared = shared
        shared.environments.append(self)

    def _host(self) -> _Shared:
        if self._shared is None:
            raise SandboxUnavailableError("make environments with sandbox_environment(...)()")
        return self._shared

    def _call(self, func: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        return self._host().host.call(func, *args, **kwargs)

    def _release(self) -> None:
        runtime, self._runtime = self._runtime, None
        if runtime is not None:
            try:
                self._call(runtime.close)
            except SandboxError as exc:
                log.warning("closing the sandbox of %s failed: %s", self._rollout_id, exc)

    def reset(self, **kwargs: Any) -> str | None:
        """Start a rollout: the previous sandbox is closed, a fresh one opened and prepared.
        A sandbox that cannot start makes the rollout unscored (its tools then raise)."""
        shared = self._host()
        self._release()
        self._failure = None
        self._task = dict(kwargs)
        self._rollout_id = f"trl-env-{uuid.uuid4().hex[:12]}"
        prompt = kwargs.get("prompt")
        self._messages = [dict(m) for m in prompt] if isinstance(prompt, list) else []
        try:
            self._runtime = self._call(shared.host.open_sandbox)
            if shared.prepare is not None:
                self._call(shared.prepare, self._runtime, self._task)
        except Exception as exc:  # noqa: BLE001 - the rollout is unscored, the batch goes on
            self._failure = unscored(exc, "start")
            self._release()
        return None

    def _tool(self, name: str, **arguments: Any) -> str:
        """Run sandbox tool ``name``; its output, with the error the model should see.

        Raises:
            SandboxUnavailableError / SandboxTransportError: no sandbox, or it died (the
                rollout is then unscored).
            ToolNotFoundError / ToolArgumentsError: an unknown tool, or bad arguments.
        """
        shared = self._host()
        call_id = f"call_{len(self._messages)}"
        function = {"name": name, "arguments": arguments}
        call = {"id": call_id, "type": "function", "function": function}
        self._messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        if self._runtime is None:
            cause = self._failure.metrics["error"] if self._failure else "reset() was not called"
            raise SandboxUnavailableError(f"this rollout has no sandbox: {cause}")
        try:
            outcome = self._call(
                call_tool, self._runtime, shared.tools, name, arguments, shared.limits
            )
        except (SandboxUnavailableError, SandboxTransportError) as exc:
            self._failure = unscored(exc, "tools")
            self._messages.append({"role": "tool", "tool_call_id": call_id, "content": str(exc)})
            raise
        text = outcome.output
        if outcome.error:
            text = f"{text.rstrip()}\n{outcome.error}" if text.strip() else outcome.error
        self._messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        return text

    def bash(self, command: str) -> str:
        """Run a shell command in the sandbox and return its output.

        Args:
            command: the shell command to run.

        Returns:
            The command's output (stdout and stderr), and its exit code when it failed.
        """
        return self._tool("bash", command=command)

    def read_file(self, path: str) -> str:
        """Read a text file in the sandbox.

        Args:
            path: the file to read, relative to the working directory.

        Returns:
            The file's text, or why it could not be read.
        """
        return self._tool("read_file", path=path)

    def write_file(self, path: str, content: str) -> str:
        """Write a text file in the sandbox (parent directories are made).

        Args:
            path: the file to write, relative to the working directory.
            content: the text to write.

        Returns:
            What was written, or why it could not be.
        """
        return self._tool("write_file", path=path, content=content)

    def get_reward(self) -> float | None:
        """Grade the rollout's sandbox with the configured verify, then release it;
        ``None`` when unscored (the sandbox died or never started, the check failed)."""
        shared = self._host()
        try:
            if self._failure is not None:
                graded = self._failure
            elif self._runtime is None:
                graded = unscored(SandboxUnavailableError("reset() was not called"), "verify")
            else:
                graded = self._call(
                    grade, shared.verify, runtime=self._runtime, rollout_id=self._rollout_id,
                    task=self._task, messages=self._messages, timeout=shared.verify_timeout,
                )  # fmt: skip
        except SandboxUnavailableError as exc:  # the host was closed under us
            graded = unscored(exc, "verify")
        finally:
            self._release()
        metrics = {**graded.metrics, "rollout_id": self._rollout_id}
        graded = Graded(graded.reward, metrics, graded.artifacts)
        shared.graded.append(graded)
        return graded.reward


class SandboxEnvironmentFactory:
    """The zero-argument ``environment_factory`` TRL calls; every environment it makes
    shares one :class:`~.host.SandboxHost`. :meth:`close` (or ``with``) releases every
    sandbox still open and stops the host. :attr:`graded` lists the latest gradings
    (at most :data:`GRADED_KEPT`), in order."""

    def __init__(self, environment: type[SandboxEnvironment], shared: _Shared):
        self._environment = environment
        self._shared = shared

    @property
    def host(self) -> SandboxHost:
        return self._shared.host

    @property
    def graded(self) -> list[Graded]:
        return list(self._shared.graded)

    def __call__(self) -> SandboxEnvironment:
        self._shared.host.start()
        instance = self._environment()
        instance._attach(self._shared)
        return instance

    def close(self) -> None:
        """Close every environment's sandbox, then the host; idempotent."""
        if self._shared.host.started:
            for environment in self._shared.environments:
                environment._release()
        self._shared.host.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def sandbox_environment(
    runtime: RuntimeSpec,
    *,
    verify: VerifyFn,
    tools: Sequence[SandboxTool] = DEFAULT_TOOLS,
    pool_size: int = 0,
    pool_options: Mapping[str, Any] | None = None,
    prepare: PrepareFn | None = None,
    limits: ToolLimits = _LIMITS,
    verify_timeout: float | None = 900.0,
    environment: type[SandboxEnvironment] = SandboxEnvironment,
) -> SandboxEnvironmentFactory:
    """TRL's ``environment_factory``: ``environment`` instances (a
    :class:`SandboxEnvironment` subclass) each running its tools in its own sandbox of
    ``runtime``, rewarded by ``verify`` on the live sandbox.

    Args:
        tools: the sandbox tools the methods may call (``self._tool(name, ...)``).
        pool_size: keep this many sandboxes started ahead (0: start each in ``reset``).
        prepare: ``async (runtime, row)``, run on each fresh sandbox (``row``: the
            dataset row ``reset`` got); a failure makes that rollout unscored.
        limits: bounds on each tool call.
    """
    host = SandboxHost(runtime, pool_size=pool_size, pool_options=pool_options)
    shared = _Shared(host, verify, tools, prepare, limits, verify_timeout)
    return SandboxEnvironmentFactory(environment, shared)
