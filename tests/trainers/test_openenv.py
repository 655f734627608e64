"""OpenEnv's harness contracts over vf-sandbox (``placement.trainers.openenv``): a real TRL
``GRPOTrainer`` run through upstream's ``build_harness_rollout_func``, the session
protocols, and what bad input and dying sandboxes give (typed errors, never a 0.0 reward)."""

from __future__ import annotations

import math
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import datasets
import pytest
import torch
from openenv.core.harness.rollout import (
    HarnessRunLimits,
    LoopOwningSession,
    MCPHarnessAdapter,
    ResourceSession,
    SessionMCPBridge,
    TrainableSession,
    build_harness_rollout_func,
)
from openenv.core.harness.training import TrainingTrace
from trl import GRPOConfig, GRPOTrainer

from harnesses.base import Budget
from harnesses.bash import BASH_TOOL, DEFAULT_SYSTEM_PROMPT
from harnesses.errors import SessionProtocolError, SessionVerifyError
from harnesses.gate import Completion
from harnesses.llm import ToolCall as HarnessToolCall
from harnesses.scripted import reply
from harnesses.session import AgentSession, VerifyContext
from placement.specs import JudgeSpec
from placement.trainers.generation import TransformersGenerator
from placement.trainers.openenv import (
    SandboxSession,
    SandboxSessionFactory,
    transformers_model_step,
)
from placement.trainers.openenv_harness import HarnessSession, HarnessSessionFactory
from placement.trainers.tools import (
    DEFAULT_TOOLS,
    ToolArgumentsError,
    ToolNotFoundError,
    tool_specs,
)
from placement.verifier import CommandCheck, JudgeVerifier
from runtimes import live_runtimes, ownership
from runtimes.errors import SandboxUnavailableError
from runtimes.reaper import drain_removals_blocking
from tests.placement import conftest as placement_fixtures
from tests.placement.conftest import ModelsFactory

from . import tiny_model

scripted_models = placement_fixtures.scripted_models

CHECK = "grep -qx 4 answer.txt"
USER = [{"role": "user", "content": tiny_model.TASK}]


def our_containers() -> set[str]:
    listing = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label={ownership.CREATOR}={ownership.CREATOR_ID}"],
        capture_output=True,
        text=True,
    )
    return set(listing.stdout.split())


@contextmanager
def no_leaks(backend: dict[str, Any]) -> Iterator[None]:
    """Nothing the block opened is left: no live runtime, no container of this session."""
    docker = backend["type"] == "docker"
    runtimes = set(map(id, live_runtimes()))
    containers = our_containers() if docker else set()
    yield
    assert [rt.describe() for rt in live_runtimes() if id(rt) not in runtimes] == []
    if docker:
        drain_removals_blocking()
        assert our_containers() - containers == set()


def kill(session: SandboxSession) -> None:
    """The sandbox dies under its session (subprocess: closed under it; Docker: killed)."""
    runtime = session.runtime
    if runtime.config.type == "docker":
        subprocess.run(["docker", "kill", str(runtime.sandbox_id)], check=True, capture_output=True)
    else:
        session._factory.host.call(runtime.close)


def white_box_model(primed_model: Callable[..., Any], tokenizer: Any) -> Any:
    return primed_model(tiny_model.prompt_ids(tokenizer, tool_specs(DEFAULT_TOOLS)))


# ---------------------------------------------------------------------- TRL end to end


def test_grpo_trainer_on_sandbox_sessions(
    backend: dict[str, Any],
    tiny_tokenizer: Any,
    primed_model: Callable[..., Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model = white_box_model(primed_model, tiny_tokenizer)
    before = [p.detach().clone() for p in model.parameters()]
    seen: list[str] = []
    check = CommandCheck(CHECK)

    async def verify(context: VerifyContext) -> Any:
        shown = await context.runtime.exec(["sh", "-c", "cat answer.txt 2>/dev/null || true"])
        seen.append(shown.stdout.strip())
        return await check(context)

    holder: dict[str, Any] = {}
    generator = TransformersGenerator(
        lambda: holder["trainer"].model, tiny_tokenizer, max_tokens=64
    )
    rewards: list[float] = []

    def env_reward(completions: list[Any], env_reward: list[float], **_: Any) -> list[float]:
        rewards.extend(env_reward)
        return [float(r) for r in env_reward]

    with no_leaks(backend), SandboxSessionFactory(backend, verify=verify) as factory:
        rollout_func = build_harness_rollout_func(
            session_factory=factory,
            harness_adapter=MCPHarnessAdapter(),
            model_step_builder=transformers_model_step(generator),
            limits=HarnessRunLimits(max_turns=1),
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[env_reward],
            args=GRPOConfig(
                use_cpu=True,
                max_steps=2,
                per_device_train_batch_size=4,
                num_generations=4,
                max_completion_length=64,
                learning_rate=1e-2,
                report_to="none",
                logging_steps=1,
                seed=0,
                beta=0.0,
                output_dir=str(tmp_path),
                save_strategy="no",
            ),
            train_dataset=datasets.Dataset.from_list([{"prompt": USER}] * 8),
            processing_class=tiny_tokenizer,
            rollout_func=rollout_func,
        )
        holder["trainer"] = trainer
        trainer.train()
        assert factory.open_sessions() == []

    assert len(seen) == 8 and len(rewards) == 8
    assert set(seen) & set(tiny_model.ANSWERS), seen  # the tool calls ran in the sandboxes
    assert rewards == [1.0 if s == "4" else 0.0 for s in seen]
    assert len(set(rewards)) > 1, rewards
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    assert all(math.isfinite(e["loss"]) and math.isfinite(e["grad_norm"]) for e in logs), logs
    after = list(trainer.model.parameters())
    assert any(not torch.equal(a.detach(), b) for a, b in zip(after, before, strict=True))


# ---------------------------------------------------------------------- white-box sessions


def test_sandbox_session_tools_errors_and_reward(backend: dict[str, Any]) -> None:
    with (
        no_leaks(backend),
        SandboxSessionFactory(
            backend, verify=CommandCheck(CHECK), system_prompt="be brief"
        ) as factory,
    ):
        session = factory.create({"prompt": tiny_model.TASK, "id": "t1"}, episode_id="e-1")
        try:
            assert isinstance(session, ResourceSession)
            assert session.initial_messages() == [
                {"role": "system", "content": "be brief"},
                *USER,
            ]
            assert [t.name for t in session.list_tools()] == ["bash", "read_file", "write_file"]
            with pytest.raises(ToolNotFoundError) as missing:
                session.call_tool("nope", {})
            assert isinstance(missing.value, KeyError)
            with pytest.raises(ToolArgumentsError) as wrong:
                session.call_tool("bash", {"command": 3})
            assert isinstance(wrong.value, ValueError)
            bridge = SessionMCPBridge(session)
            codes = [
                bridge.handle_request(
                    {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}
                )["error"]["code"]
                for params in ({"name": "nope"}, {"name": "bash", "arguments": {"cmd": "ls"}})
            ]
            assert codes == [-32601, -32602]  # METHOD_NOT_FOUND, INVALID_PARAMS
            failed = session.call_tool("bash", {"command": "exit 3"})
            assert failed.error == "exit code 3" and failed.metadata == {"exit_code": 3}
            ran = session.call_tool("bash", {"command": "echo 4 > answer.txt && cat answer.txt"})
            assert ran.data.strip() == "4" and ran.error is None
            transcript = [*session.initial_messages(), {"role": "assistant", "content": "done"}]
            result = session.verify(transcript)
            assert result.env_reward == 1.0 and result.done
            assert result.metrics["tool_calls"] == 2 and result.metrics["scored"] is True
            assert session.verify(transcript) is result  # once
        finally:
            session.close()
            session.close()  # idempotent


def test_invalid_tasks_make_no_sandbox() -> None:
    backend = {"type": "subprocess"}
    with no_leaks(backend), SandboxSessionFactory(backend, verify=CommandCheck(CHECK)) as factory:
        for task in ({}, 42, "", {"prompt": []}, [{"content": "no role"}]):
            with pytest.raises(SessionProtocolError):
                factory.create(task)
        assert not factory.host.started  # refused before any sandbox was made


def test_dead_sandbox_and_failed_verifier_are_unscored(backend: dict[str, Any]) -> None:
    async def broken(context: VerifyContext) -> float:
        raise SessionVerifyError("the judge wrote no verdict")

    with no_leaks(backend):
        with SandboxSessionFactory(backend, verify=CommandCheck(CHECK)) as factory:
            session = factory.create(tiny_model.TASK)
            session.call_tool("bash", {"command": "echo 4 > answer.txt"})
            kill(session)
            with pytest.raises(SandboxUnavailableError):
                session.call_tool("bash", {"command": "true"})
            with pytest.raises(SandboxUnavailableError):  # remembered
                session.call_tool("bash", {"command": "true"})
            result = session.verify([])
            assert result.env_reward is None and result.metrics["scored"] is False
            assert result.metrics["error_type"] == "SandboxUnavailableError"
            session.close()  # never raises for a dead sandbox
            # the session closed by the factory, not by the caller
            factory.create(tiny_model.TASK)
        with SandboxSessionFactory(backend, verify=broken) as factory:
            session = factory.create(tiny_model.TASK)
            result = session.verify([])
            assert result.env_reward is None
            assert result.metrics["error_type"] == "SessionVerifyError"
            session.close()


def test_a_judge_that_writes_no_verdict_leaves_the_rollout_unscored(
    backend: dict[str, Any], scripted_models: ModelsFactory
) -> None:
    """A real bash judge whose model answers without writing verdict.json: VerdictMissing,
    so the rollout has no reward (None, never 0.0), the cause typed in the metrics."""
    spec = JudgeSpec(
        name="silent",
        harness={"id": "bash"},
        model="silent",
        budget=Budget(max_turns=2, max_seconds=60),
        prompt="Check that answer.txt holds 4.",
        verdict_schema={"score": {"type": "number"}},
    )
    verify = JudgeVerifier([spec], models=scripted_models({"silent": [reply("looks fine")]}))
    with no_leaks(backend), SandboxSessionFactory(backend, verify=verify) as factory:
        session = factory.create(tiny_model.TASK)
        session.call_tool("bash", {"command": "echo 4 > answer.txt"})
        result = session.verify([{"role": "assistant", "content": "done"}])
        assert result.env_reward is None, result.metrics
        assert result.metrics["scored"] is False and result.metrics["stage"] == "verify"
        assert result.metrics["error_type"] == "SessionVerifyError"
        assert "verdict" in result.metrics["error"]
        session.close()


# ---------------------------------------------------------------------- loop-owning sessions


@pytest.fixture
def bash_harness_model(tiny_tokenizer: Any, primed_model: Callable[..., Any]) -> Any:
    """Primed on the bash harness's first prompt (the gated TRL test primes the same one)."""
    messages = [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *USER]
    return primed_model(tiny_model.prompt_ids(tiny_tokenizer, [BASH_TOOL], messages))


def test_harness_session_is_trainable(
    backend: dict[str, Any], tiny_tokenizer: Any, bash_harness_model: Any
) -> None:
    generator = TransformersGenerator(bash_harness_model, tiny_tokenizer, max_tokens=64)
    with (
        no_leaks(backend),
        HarnessSessionFactory(
            backend,
            {"id": "bash"},
            generate=generator,
            verify=CommandCheck(CHECK),
            budget=Budget(max_turns=2),
        ) as factory,
    ):
        session = factory.create({"prompt": tiny_model.TASK}, episode_id="h-1")
        try:
            assert isinstance(session, TrainableSession)
            assert isinstance(session, LoopOwningSession)
            assert isinstance(session, ResourceSession)
            assert session.wait_for_completion(timeout_s=120) == 0
            trace = session.fetch_training_trace()
            assert isinstance(trace, TrainingTrace) and 1 <= len(trace.turns) <= 2
            first = trace.turns[0]
            assert first.prompt_token_ids == tiny_model.prompt_ids(
                tiny_tokenizer,
                [BASH_TOOL],
                [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, *USER],
            )
            for turn in trace.turns[1:]:  # the ids chain
                assert turn.prompt_token_ids[: len(first.prompt_token_ids)] == (
                    first.prompt_token_ids
                )
            result = session.verify()
            assert result.env_reward in (0.0, 1.0), result.metrics
            entries = session.fetch_proxy_trace()
            assert entries[0]["metadata"]["node_id"] == "h-1:0"
            assert entries[0]["reward"] == result.env_reward
            with pytest.raises(RuntimeError):
                session.call_tool("bash", {"command": "true"})
        finally:
            session.close()
            session.close()


def test_harness_session_whose_sandbox_dies_is_unscored() -> None:
    backend = {"type": "subprocess"}
    holder: dict[str, HarnessSession] = {}

    async def generate(rollout_id: str, turn: int, *_: Any) -> Completion:
        for _ in range(200):
            if "s" in holder:
                break
            await anyio.sleep(0.05)
        agent: AgentSession = holder["s"].session
        await agent.runtime.close()
        call = HarnessToolCall(id="c0", name="bash", arguments='{"command": "echo 4 > answer.txt"}')
        return Completion(tool_calls=[call])

    with (
        no_leaks(backend),
        HarnessSessionFactory(
            backend, {"id": "bash"}, generate=generate, verify=CommandCheck(CHECK)
        ) as factory,
    ):
        holder["s"] = session = factory.create(tiny_model.TASK)
        started = time.monotonic()
        assert session.wait_for_completion(timeout_s=60) == 1
        assert time.monotonic() - started < 60
        result = session.verify()
        assert result.env_reward is None and result.metrics["scored"] is False
        assert result.metrics["error_type"]
        session.close()
