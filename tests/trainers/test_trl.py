"""TRL's ``GRPOTrainer`` over vf-sandbox (``placement.trainers.trl``): real training steps on
the CPU with the tiny primed model, the tools running in real sandboxes (subprocess, Docker).

Each run checks what reached the sandbox, that rewards differ across a group, that the step
trained (finite loss and grad norm, changed parameters), that infrastructure failures are
unscored (``None``, never 0.0) without stopping the batch, and that no sandbox leaks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
)

from harnesses.base import Budget
from harnesses.bash import BASH_TOOL, DEFAULT_SYSTEM_PROMPT
from harnesses.session import VerifyContext
from placement.trainers.generation import TransformersGenerator
from placement.trainers.trl import (
    SandboxEnvironment,
    SandboxRollouts,
    sandbox_environment,
    sandbox_reward,
    sandbox_rollout_func,
)
from placement.verifier import CommandCheck
from runtimes import Runtime, live_runtimes
from runtimes.errors import SandboxUnavailableError
from tests.sessions.conftest import kill_runtime

from . import tiny_model

CHECK = "grep -qx 4 answer.txt"
MESSAGES = [{"role": "user", "content": tiny_model.TASK}]


@pytest.fixture(autouse=True)
def _silence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def config(tmp_path: Path, steps: int = 2) -> GRPOConfig:
    return GRPOConfig(
        use_cpu=True, max_steps=steps, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=64, learning_rate=1e-2, report_to="none", logging_steps=1,
        seed=0, beta=0.0, output_dir=str(tmp_path), save_strategy="no",
    )  # fmt: skip


def dataset() -> Dataset:
    return Dataset.from_list([{"prompt": MESSAGES}] * 8)


class Recorder:
    """A verify: records ``answer.txt`` as the sandbox holds it, kills the sandbox of the
    rollouts ``doomed`` picks, then runs the check."""

    def __init__(self, doomed: Callable[[str], bool] = lambda rollout_id: False):
        self.seen: dict[str, str] = {}
        self.messages: dict[str, list[Any]] = {}
        self.killed: list[str] = []
        self.doomed = doomed
        self.check = CommandCheck(CHECK)

    async def __call__(self, context: VerifyContext) -> Any:
        result = await context.runtime.exec(["cat", "answer.txt"], timeout=30)
        self.seen[context.rollout_id] = result.stdout.strip()
        self.messages[context.rollout_id] = list(context.record.messages)
        if self.doomed(context.rollout_id):
            self.killed.append(context.rollout_id)
            await kill_runtime(context.runtime)
        return await self.check(context)


def snapshot(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_trained(trainer: GRPOTrainer, before: list[torch.Tensor] | None) -> None:
    """Every step logged a finite loss and grad norm; the parameters moved (unless
    ``before`` is None: a batch whose scored rows all tie has no advantage to learn from)."""
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == trainer.args.max_steps, trainer.state.log_history
    for entry in logs:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"]), entry
    if before is None:
        return
    after = list(trainer.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def new_runtimes(before: set[int]) -> list[str]:
    return [rt.describe() for rt in live_runtimes() if id(rt) not in before]


# ---------------------------------------------------------------------- rollout_func


def harness_prompt(tokenizer: Any) -> list[int]:
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *MESSAGES]
    return tiny_model.prompt_ids(tokenizer, [BASH_TOOL], messages)


class Batches:
    """Wraps the rollout func, keeping each batch's output, results and samples."""

    def __init__(self, rollouts: SandboxRollouts):
        self.rollouts = rollouts
        self.batches: list[tuple[dict[str, Any], list[Any]]] = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        assert len(prompts) == 4 and all(p == MESSAGES for p in prompts)  # already repeated
        out = self.rollouts(prompts, trainer)
        self.batches.append((out, list(self.rollouts.last_results)))
        return out


def rollout_trainer(
    backend: dict[str, Any], tokenizer: Any, model: Any, tmp_path: Path, steps: int, **kw: Any
) -> tuple[GRPOTrainer, Batches]:
    rollouts = sandbox_rollout_func(backend, {"id": "bash"}, budget=Budget(max_turns=2), **kw)
    batches = Batches(rollouts)
    trainer = GRPOTrainer(
        model=model, reward_funcs=sandbox_reward, args=config(tmp_path, steps),
        train_dataset=dataset(), processing_class=tokenizer, rollout_func=batches,
    )  # fmt: skip
    return trainer, batches


def test_rollout_func_trains_on_gated_sessions(
    backend: dict[str, Any], tiny_tokenizer: Any, primed_model: Any, tmp_path: Path
) -> None:
    live = {id(rt) for rt in live_runtimes()}
    model = primed_model(harness_prompt(tiny_tokenizer))
    verify = Recorder()
    # One rollout at a time: the sampler's random draws come in a fixed order (seed 0).
    trainer, batches = rollout_trainer(
        backend, tiny_tokenizer, model, tmp_path, 2, verify=verify, concurrency=1
    )
    before = snapshot(trainer.model)
    with batches.rollouts:
        trainer.train()
        assert new_runtimes(live) == []  # each session closed its sandbox
    assert not batches.rollouts._host.started

    assert len(batches.batches) == 2
    assert set(verify.seen.values()) <= {"", *tiny_model.ANSWERS}  # the tool calls ran there
    assert len({v for v in verify.seen.values() if v}) >= 2, verify.seen
    rewards = [r for out, _ in batches.batches for r in out["sandbox_reward"]]
    assert None not in rewards and len(set(rewards)) == 2, rewards
    for out, results in batches.batches:
        for i, result in enumerate(results):
            assert result.ok, result
            turns = result.record.turns
            prompt, completion = out["prompt_ids"][i], out["completion_ids"][i]
            mask, logprobs = out["env_mask"][i], out["logprobs"][i]
            assert prompt == turns[0].completion.metadata["prompt_token_ids"]
            assert len(completion) == len(mask) == len(logprobs)
            sampled = [t for turn in turns for t in turn.completion.metadata["token_ids"]]
            assert [t for t, m in zip(completion, mask, strict=True) if m] == sampled
            for turn in turns:  # every turn's prompt is the sequence up to it
                ids = turn.completion.metadata["prompt_token_ids"]
                assert (prompt + completion)[: len(ids)] == ids
                assert all(
                    mask[len(ids) - len(prompt) + k]
                    for k in range(len(turn.completion.metadata["token_ids"]))
                )
            assert all(lp == 0.0 for lp, m in zip(logprobs, mask, strict=True) if not m)
            assert out["sandbox_metrics"][i]["scored"] is True
    assert_trained(trainer, before)


def test_rollout_func_failures_are_unscored(
    backend: dict[str, Any], tiny_tokenizer: Any, primed_model: Any, tmp_path: Path
) -> None:
    live = {id(rt) for rt in live_runtimes()}
    model = primed_model(harness_prompt(tiny_tokenizer))
    verify = Recorder(doomed=lambda rollout_id: rollout_id.endswith("-0-1"))
    prepared: list[Runtime] = []
    sampler = TransformersGenerator(model, tiny_tokenizer, max_tokens=64)

    async def prepare(runtime: Runtime, task: dict[str, Any]) -> None:
        prepared.append(runtime)
        if len(prepared) == 1:
            raise RuntimeError("the task's setup failed")

    async def generate(rollout_id: str, turn: int, *args: Any) -> Any:
        """Rollout 2's sandbox dies under its agent, on its first model call (one rollout
        at a time: the sandbox prepared last is this rollout's)."""
        if rollout_id.endswith("-0-2") and turn == 0:
            await kill_runtime(prepared[-1])
        return await sampler(rollout_id, turn, *args)

    trainer, batches = rollout_trainer(
        backend, tiny_tokenizer, model, tmp_path, 1, verify=verify, prepare=prepare,
        generate=generate, concurrency=1,
    )  # fmt: skip
    with batches.rollouts:
        trainer.train()
    assert new_runtimes(live) == []

    ((out, _),) = batches.batches
    rewards, metrics = out["sandbox_reward"], out["sandbox_metrics"]
    failed = [i for i, r in enumerate(rewards) if r is None]
    assert failed == [0, 1, 2], (rewards, metrics)
    assert metrics[0]["stage"] == "start", metrics[0]  # prepare failed: no agent ran
    # killed while verifying, and killed under the running agent: both the sandbox lost
    assert [metrics[i]["error_type"] for i in (1, 2)] == ["SessionSandboxLost"] * 2, metrics
    for i in failed:
        assert metrics[i]["scored"] is False and metrics[i]["error"]
        assert out["completion_ids"][i] == [tiny_tokenizer.eos_token_id]
        assert out["env_mask"][i] == [0] and out["logprobs"][i] == [0.0]
        assert out["prompt_ids"][i]
    assert all(r is not None for i, r in enumerate(rewards) if i not in failed)
    assert_trained(trainer, None)  # a step over the batch ran


@pytest.mark.docker
def test_rollout_func_missing_image_is_unscored(tiny_tokenizer: Any) -> None:
    live = {id(rt) for rt in live_runtimes()}
    missing = {"type": "docker", "image": "vf-sandbox/no-such-image:missing"}
    trainer = type("Stub", (), {"model": None, "processing_class": tiny_tokenizer})()
    with sandbox_rollout_func(missing, {"id": "bash"}, verify=CommandCheck(CHECK)) as rollouts:
        out = rollouts([MESSAGES, MESSAGES], trainer)
    assert out["sandbox_reward"] == [None, None]
    assert [m["error_type"] for m in out["sandbox_metrics"]] == ["SessionStartError"] * 2
    assert all(m["stage"] == "start" and m["scored"] is False for m in out["sandbox_metrics"])
    assert out["env_mask"] == [[0], [0]]
    assert out["prompt_ids"][0] == tiny_model.prompt_ids(tiny_tokenizer, None, MESSAGES)
    assert new_runtimes(live) == []


# ---------------------------------------------------------------------- environment_factory


def environment_prompt(tokenizer: Any) -> list[int]:
    """The first prompt TRL renders for a SandboxEnvironment: its tool methods, with the
    training chat template TRL swaps in when the template is not prefix-preserving."""
    env = SandboxEnvironment()
    tools = [env.bash, env.read_file, env.write_file]
    tokenizer = add_response_schema(tokenizer)
    template = None
    if not is_chat_template_prefix_preserving(tokenizer):
        template = get_training_chat_template(tokenizer)
    ids = tokenizer.apply_chat_template(
        conversation=[MESSAGES], tools=tools, chat_template=template,
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"][0]  # fmt: skip
    return list(ids)


def test_environment_class_exposes_only_its_tools() -> None:
    import inspect

    names = [n for n, _ in inspect.getmembers(SandboxEnvironment, predicate=inspect.isfunction)]
    public = [n for n in names if not n.startswith("_")]
    assert sorted(public) == ["bash", "get_reward", "read_file", "reset", "write_file"]


def environment_trainer(
    backend: dict[str, Any], tokenizer: Any, model: Any, tmp_path: Path, steps: int, **kw: Any
) -> tuple[GRPOTrainer, Any]:
    factory = sandbox_environment(backend, **kw)
    trainer = GRPOTrainer(
        model=model, args=config(tmp_path, steps), train_dataset=dataset(),
        processing_class=tokenizer, environment_factory=factory,
    )  # fmt: skip
    return trainer, factory


def test_environment_factory_trains(
    backend: dict[str, Any], tiny_tokenizer: Any, primed_model: Any, tmp_path: Path
) -> None:
    live = {id(rt) for rt in live_runtimes()}
    model = primed_model(environment_prompt(tiny_tokenizer))
    verify = Recorder()
    trainer, factory = environment_trainer(
        backend, tiny_tokenizer, model, tmp_path, 2, verify=verify
    )
    before = snapshot(trainer.model)
    with factory:
        trainer.train()
        assert new_runtimes(live) == []  # get_reward released each sandbox
    assert not factory.host.started

    assert len(factory.graded) == 8
    assert set(verify.seen.values()) <= {"", *tiny_model.ANSWERS}
    assert len({v for v in verify.seen.values() if v}) >= 2, verify.seen
    rewards = [g.reward for g in factory.graded]
    assert None not in rewards and len(set(rewards)) == 2, rewards
    seen_by_verify = [m for ms in verify.messages.values() for m in ms]
    assert any(m["role"] == "tool" for m in seen_by_verify)  # what the judges see
    assert any(m["role"] == "assistant" and m.get("tool_calls") for m in seen_by_verify)
    assert_trained(trainer, before)


def test_environment_failures_are_unscored(
    backend: dict[str, Any], tiny_tokenizer: Any, primed_model: Any, tmp_path: Path
) -> None:
    live = {id(rt) for rt in live_runtimes()}
    model = primed_model(environment_prompt(tiny_tokenizer))
    killed: list[str] = []
    verify = Recorder(doomed=lambda rollout_id: not killed and not killed.append(rollout_id))
    prepared: list[str] = []

    async def prepare(runtime: Runtime, row: dict[str, Any]) -> None:
        assert row["prompt"] == MESSAGES
        prepared.append("x")
        if len(prepared) == 2:
            raise RuntimeError("the task's setup failed")

    trainer, factory = environment_trainer(
        backend, tiny_tokenizer, model, tmp_path, 1, verify=verify, prepare=prepare
    )
    with factory:
        trainer.train()
    assert new_runtimes(live) == []

    rewards = [g.reward for g in factory.graded]
    assert len(rewards) == 4 and rewards.count(None) == 2, factory.graded
    causes = {
        g.metrics["stage"]: g.metrics["error_type"] for g in factory.graded if g.reward is None
    }
    assert causes["start"] == "RuntimeError" and causes["verify"] == "SessionSandboxLost", causes
    assert_trained(trainer, None)  # a step over the batch ran


def test_environment_sandbox_dies_mid_rollout(backend: dict[str, Any]) -> None:
    live = {id(rt) for rt in live_runtimes()}
    with sandbox_environment(backend, verify=CommandCheck(CHECK)) as factory:
        env = factory()
        assert env.reset(prompt=MESSAGES) is None
        assert env.bash("echo 4 > answer.txt") == ""
        assert "exit code 3" in env.bash("echo oops; exit 3")
        assert env.read_file("answer.txt") == "4\n"
        assert env.get_reward() == 1.0  # and the sandbox is released
        assert new_runtimes(live) == []

        env.reset(prompt=MESSAGES)
        env.bash("echo 4 > answer.txt")
        factory.host.call(kill_runtime, env._runtime)
        with pytest.raises(SandboxUnavailableError):
            env.bash("cat answer.txt")
        assert env.get_reward() is None
        graded = factory.graded[-1]
        assert graded.metrics["stage"] == "tools" and graded.metrics["scored"] is False
        assert graded.metrics["error_type"] == "SandboxUnavailableError"

        env.reset(prompt=MESSAGES)  # the pooled instance is usable again
        env.write_file("answer.txt", "4\n")
        assert env.get_reward() == 1.0
    assert not factory.host.started
    assert new_runtimes(live) == []
