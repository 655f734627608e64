"""The rollout phase of one GRPO step through each trainer adapter, against the same work driven
directly (``placement/trainers/``, docs/trainers.md).

    python -m benchmarks.trainers [--rollouts 16] [--rounds 3] [--concurrency 8] [--no-grpo]

The work: ``--rollouts`` rollouts on Docker (``vf-sandbox/python``), each 4 ``bash`` tool calls
(``echo i >> log.txt``) and a check (``CommandCheck``: the log has 4 lines), 8 sandboxes at a
time. The model is scripted (no sampling), so what is timed is the sandboxes and the adapters.

- gated (a harness runs the loop): ``run_rollouts`` with the bash harness, directly (baseline),
  vs TRL's ``rollout_func`` (``sandbox_rollout_func``: the same, plus the host loop hop and
  ``build_sample`` into TRL's dict);
- white box (the trainer runs the loop): the runtime API directly (baseline: open, 4 ``exec``,
  ``grade``, close), vs OpenEnv's ``SandboxSession`` driven by OpenEnv's own
  ``MCPHarnessAdapter``, and TRL's ``SandboxEnvironment`` (``reset``, 4 ``bash``,
  ``get_reward``), both from 8 trainer threads as the trainers call them.

Each round runs every variant, in an order rotated round by round, after the engine finished
removing the previous variant's containers; medians per variant. With ``--grpo``
(default) it also times a real 1-step GRPO run (the tiny model of ``tests/trainers``, CPU) whose
``rollout_func`` is TRL's adapter over the same work, and reports the rollout phase's share of
the step: how much of a training step the sandboxes take at this model size.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

from harnesses.base import Budget
from harnesses.gate import Completion
from harnesses.session import AgentSessionFactory, call
from harnesses.trainer import run_rollouts
from placement.trainers.grading import grade
from placement.trainers.tools import DEFAULT_TOOLS, call_tool
from placement.verifier import CommandCheck
from runtimes import open_runtime
from runtimes.reaper import wait_for_removals_blocking

from .stats import table

IMAGE = "vf-sandbox/python:latest"
DOCKER = {"type": "docker", "image": IMAGE}
CALLS = 4
CHECK = CommandCheck(f'test "$(wc -l < log.txt)" -eq {CALLS}')
TASK = "Append four lines to log.txt."
TARGET = 1.1


def scripted_turn(turn: int, prompt_ids: list[int]) -> Completion:
    """Turn ``turn`` of the scripted policy, with made-up token ids that chain as a real
    sampler's do (each prompt extends the previous prompt and reply), so ``build_sample``
    and TRL get token-level rows."""
    reply = [20 + turn, 21 + turn]
    metadata = {"prompt_token_ids": prompt_ids, "token_ids": reply, "logprobs": [-0.5, -0.5]}
    if turn < CALLS:
        command = f"echo {turn} >> log.txt"
        return Completion(tool_calls=[call("bash", {"command": command})], metadata=metadata)
    return Completion(content="done", metadata=metadata)


class ScriptedGenerate:
    """A gated session's ``generate``: :func:`scripted_turn`, one id chain per rollout."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}

    async def __call__(
        self, rollout_id: str, turn: int, messages: Any, tools: Any, sampling: Any
    ) -> Completion:
        prompt = [*self.ids.get(rollout_id, [1, 2, 3]), 7]  # 7: the glue between turns
        completion = scripted_turn(turn, prompt)
        self.ids[rollout_id] = prompt + completion.metadata["token_ids"]
        return completion


# ---------------------------------------------------------------------- gated


async def direct_gated(rollouts: int, concurrency: int) -> float:
    async with AgentSessionFactory(
        DOCKER, {"id": "bash"}, verify=CHECK, budget=Budget(max_turns=CALLS + 2)
    ) as factory:
        start = time.perf_counter()
        results = await run_rollouts(
            factory,
            [(f"d{i}", TASK) for i in range(rollouts)],
            ScriptedGenerate(),
            concurrency=concurrency,
        )
        elapsed = time.perf_counter() - start
    _check([r.verification.reward if r.verification else None for r in results])
    return elapsed


def scripted_rollouts(concurrency: int) -> Any:
    """TRL's ``rollout_func`` over the bash harness on Docker, answered by the script."""
    from placement.trainers.trl import sandbox_rollout_func

    return sandbox_rollout_func(
        DOCKER,
        {"id": "bash"},
        verify=CHECK,
        generate=ScriptedGenerate(),
        budget=Budget(max_turns=CALLS + 2),
        concurrency=concurrency,
    )


def trl_rollout_func(rollouts: int, concurrency: int) -> float:
    func = scripted_rollouts(concurrency)
    try:
        prompts = [[{"role": "user", "content": TASK}]] * rollouts
        start = time.perf_counter()
        output = func(prompts, _FakeTrainer())
        elapsed = time.perf_counter() - start
    finally:
        func.close()
    _check(output["sandbox_reward"])
    return elapsed


class _FakeTrainer:
    """What ``sandbox_rollout_func`` reads of a trainer when ``generate`` is given."""

    num_generations = 1
    processing_class = None
    model = None


# ---------------------------------------------------------------------- white box


async def direct_white_box(rollouts: int, concurrency: int) -> float:
    limiter = anyio.Semaphore(concurrency)
    rewards: list[float | None] = []

    async def one(index: int) -> None:
        async with limiter, open_runtime(DOCKER) as runtime:
            for turn in range(CALLS):
                await call_tool(
                    runtime, DEFAULT_TOOLS, "bash", {"command": f"echo {turn} >> log.txt"}
                )
            graded = await grade(
                CHECK, runtime=runtime, rollout_id=f"w{index}", task={"prompt": TASK}, messages=[]
            )
            rewards.append(graded.reward)

    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for index in range(rollouts):
            group.start_soon(one, index)
    elapsed = time.perf_counter() - start
    _check(rewards)
    return elapsed


def _threads(work: Callable[[int], float | None], rollouts: int, concurrency: int) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        rewards = list(pool.map(work, range(rollouts)))
    elapsed = time.perf_counter() - start
    _check(rewards)
    return elapsed


def openenv_sessions(rollouts: int, concurrency: int) -> float:
    from openenv.core.harness import HarnessRunLimits, MCPHarnessAdapter, ModelStepResult
    from openenv.core.llm_client import LLMResponse, ToolCall

    from placement.trainers.openenv import SandboxSessionFactory

    def step_for() -> Callable[..., ModelStepResult]:
        turns = iter(range(CALLS + 1))

        def step(messages: Any, tools: Any, sampling: Any) -> ModelStepResult:
            turn = next(turns)
            calls = (
                [ToolCall(id=f"c{turn}", name="bash", args={"command": f"echo {turn} >> log.txt"})]
                if turn < CALLS
                else []
            )
            return ModelStepResult(response=LLMResponse(content="", tool_calls=calls))

        return step

    adapter = MCPHarnessAdapter()
    limits = HarnessRunLimits(max_turns=CALLS + 1)
    with SandboxSessionFactory(DOCKER, verify=CHECK) as factory:

        def work(index: int) -> float | None:
            session = factory.create({"prompt": TASK}, episode_id=f"o{index}")
            try:
                result = adapter.run_white_box(step_for(), session, limits)
                return session.verify(result.messages).env_reward
            finally:
                session.close()

        return _threads(work, rollouts, concurrency)


def trl_environments(rollouts: int, concurrency: int) -> float:
    from placement.trainers.trl import sandbox_environment

    make = sandbox_environment(DOCKER, verify=CHECK)
    environments = [make() for _ in range(concurrency)]

    def work(index: int) -> float | None:
        env = environments[index % concurrency]
        env.reset(prompt=TASK)
        for turn in range(CALLS):
            env.bash(f"echo {turn} >> log.txt")
        return env.get_reward()

    try:
        # one environment per thread, as TRL uses one per concurrent rollout
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            rewards = list(
                pool.map(
                    lambda i: [work(j) for j in range(i, rollouts, concurrency)], range(concurrency)
                )
            )
        elapsed = time.perf_counter() - start
    finally:
        make.close()  # type: ignore[attr-defined]
    _check([r for batch in rewards for r in batch])
    return elapsed


def _check(rewards: list[float | None]) -> None:
    if not rewards or any(r != 1.0 for r in rewards):
        raise SystemExit(f"the work went wrong: rewards {rewards}")


# ---------------------------------------------------------------------- GRPO step share


def grpo_share(rollouts: int, concurrency: int) -> tuple[float, float]:
    """(rollout phase seconds, step seconds) of one GRPO step on the tiny CPU model."""
    import tempfile
    from pathlib import Path

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from placement.trainers.trl import sandbox_reward
    from tests.trainers import tiny_model

    workdir = Path(tempfile.mkdtemp(prefix="vf-bench-grpo-"))
    tokenizer = tiny_model.build_tokenizer(workdir / "tok")
    torch.set_num_threads(1)  # a tiny model: OpenMP's spinning threads only slow it here
    model = tiny_model.build_model(tokenizer)
    func = scripted_rollouts(concurrency)
    phase: list[float] = []

    def timed_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return func(prompts, trainer)
        finally:
            phase.append(time.perf_counter() - start)

    steps: list[float] = []

    class StepTimer(TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps.append(time.perf_counter() - self.start)

    generations = 4
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[sandbox_reward],
        rollout_func=timed_func,
        args=GRPOConfig(
            output_dir=str(workdir / "out"),
            use_cpu=True,
            max_steps=1,
            per_device_train_batch_size=rollouts,
            num_generations=generations,
            max_completion_length=256,
            report_to="none",
            save_strategy="no",
            seed=0,
        ),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": TASK}]}] * 64),
        callbacks=[StepTimer()],
    )
    try:
        trainer.train()
    finally:
        func.close()
    return phase[0], steps[0]


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.trainers", description=__doc__)
    parser.add_argument("--rollouts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-grpo", action="store_true")
    args = parser.parse_args(argv)
    n, c = args.rollouts, args.concurrency

    variants: dict[str, Callable[[], float]] = {
        "gated, direct: run_rollouts": lambda: anyio.run(direct_gated, n, c),
        "gated, TRL rollout_func": lambda: trl_rollout_func(n, c),
        "white box, direct: runtime API": lambda: anyio.run(direct_white_box, n, c),
        "white box, OpenEnv SandboxSession": lambda: openenv_sessions(n, c),
        "white box, TRL SandboxEnvironment": lambda: trl_environments(n, c),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(args.rounds):
        # A different order each round, and the engine's removals of the previous variant's
        # containers finished before the next starts, so neither order nor cleanup favours one.
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            wait_for_removals_blocking()
            samples[name].append(variants[name]())
    medians = {name: statistics.median(values) for name, values in samples.items()}
    baselines = {
        "gated, TRL rollout_func": "gated, direct: run_rollouts",
        "white box, OpenEnv SandboxSession": "white box, direct: runtime API",
        "white box, TRL SandboxEnvironment": "white box, direct: runtime API",
    }
    rows = []
    for name, median in medians.items():
        base = baselines.get(name)
        ratio = median / medians[base] if base else None
        rows.append(
            [
                name,
                f"{median:.2f}",
                f"{median / n * 1000:.0f}",
                "baseline" if ratio is None else f"{ratio:.2f}x",
                "-" if ratio is None else ("met" if ratio <= TARGET else "**missed**"),
            ]
        )
    print(
        f"Rollout phase: {n} rollouts x {CALLS} tool calls + a check, Docker, {c} at a time, "
        f"median of {args.rounds} rounds"
    )
    print(
        table(
            ["variant", "phase (s)", "per rollout (ms)", "vs direct", f"target <= {TARGET}x"], rows
        )
    )
    if not args.no_grpo:
        phase, step = grpo_share(n, c)
        print()
        print(
            table(
                ["GRPO step (tiny model, CPU, rollout_func on Docker)", "seconds"],
                [
                    ["rollout phase (sandboxes + adapter)", f"{phase:.2f}"],
                    ["whole step", f"{step:.2f}"],
                    ["sandbox share of the step", f"{phase / step:.0%}"],
                ],
            )
        )


if __name__ == "__main__":
    main()
