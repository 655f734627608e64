"""The bash harness: scripted tool calls really run in the sandbox (subprocess and Docker)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harnesses.base import Budget
from harnesses.bash import BashConfig, BashHarness, truncate_for_model
from harnesses.scripted import bash_call, http_error, reply, tool_calls
from runtimes import Runtime, SandboxUnavailableError, open_runtime

from .conftest import ScriptedFactory

PYTHON_IMAGE = "vf-sandbox/python:latest"
SANDBOXES = [
    pytest.param({"type": "subprocess"}, id="subprocess"),
    pytest.param({"type": "docker", "image": PYTHON_IMAGE}, id="docker", marks=pytest.mark.docker),
]


@pytest.fixture(params=SANDBOXES)
async def sandbox(request: pytest.FixtureRequest) -> AsyncIterator[Runtime]:
    async with open_runtime(request.param) as runtime:
        yield runtime


@pytest.fixture
async def local_sandbox() -> AsyncIterator[Runtime]:
    async with open_runtime({"type": "subprocess"}) as runtime:
        yield runtime


@pytest.mark.anyio
async def test_judge_writes_a_file_in_the_sandbox(
    scripted: ScriptedFactory, sandbox: Runtime
) -> None:
    server = scripted(
        [
            bash_call("mkdir -p out && printf '{\"score\": 1}' > out/verdict.json"),
            bash_call("cat out/verdict.json; echo oops >&2; exit 3"),
            reply("verdict written"),
        ]
    )
    harness = BashHarness()
    await harness.setup(sandbox)
    await harness.setup(sandbox)  # idempotent
    trace = await harness.run("Judge the rollout.", runtime=sandbox, model=server.endpoint())
    assert server.failures == []
    assert trace.ok, trace.error
    assert trace.output == "verdict written"
    assert len(trace.turns) == 3
    assert await sandbox.read("out/verdict.json") == b'{"score": 1}'
    first, second = trace.turns[0].tool_results[0], trace.turns[1].tool_results[0]
    assert first.exit_code == 0 and first.output.startswith("exit_code: 0")
    assert second.exit_code == 3
    assert 'stdout:\n{"score": 1}' in second.output and "stderr:\noops" in second.output
    # the model saw the tool result, linked to its call
    last_request = server.requests[2].messages
    assert last_request[-1]["role"] == "tool"
    assert last_request[-1]["tool_call_id"] == second.call_id
    assert last_request[-1]["content"] == second.output
    tools = server.requests[0].body["tools"]
    assert tools[0]["function"]["name"] == "bash"


@pytest.mark.anyio
async def test_command_timeout_is_reported_to_the_model(
    scripted: ScriptedFactory, sandbox: Runtime
) -> None:
    server = scripted([bash_call("echo started; sleep 30"), reply("gave up")])
    harness = BashHarness(BashConfig(per_call_timeout=0.5))
    trace = await harness.run("wait", runtime=sandbox, model=server.endpoint())
    assert trace.ok and trace.output == "gave up"
    result = trace.turns[0].tool_results[0]
    assert result.timed_out and result.exit_code is None
    assert "timed out after 0.5s" in result.output and "started" in result.output
    assert result.duration < 10


@pytest.mark.anyio
async def test_long_output_is_truncated_with_a_marker(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    server = scripted([bash_call("seq 1 100000"), reply("ok")])
    harness = BashHarness(BashConfig(max_output_chars=1000))
    trace = await harness.run("count", runtime=local_sandbox, model=server.endpoint())
    output = trace.turns[0].tool_results[0].output
    assert "characters truncated" in output
    assert output.splitlines()[2] == "1" and output.endswith("100000\n")
    assert len(output) < 1200


def test_truncate_keeps_short_text() -> None:
    assert truncate_for_model("abc", 10) == "abc"
    cut = truncate_for_model("x" * 50 + "y" * 50, 20)
    assert cut.startswith("x" * 10) and cut.endswith("y" * 10) and "80 characters" in cut


@pytest.mark.anyio
async def test_bad_tool_calls_are_answered_not_fatal(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    server = scripted(
        [
            tool_calls(("python", {"code": "1"})),
            tool_calls(("bash", {"cmd": "ls"})),
            reply("sorry"),
        ]
    )
    trace = await BashHarness().run("x", runtime=local_sandbox, model=server.endpoint())
    assert trace.ok and trace.output == "sorry"
    assert "unknown tool 'python'" in trace.turns[0].tool_results[0].output
    assert "non-empty string 'command'" in trace.turns[1].tool_results[0].output


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_turn_budget_stops_the_run(scripted: ScriptedFactory, local_sandbox: Runtime) -> None:
    server = scripted([bash_call(f"echo {i} >> turns.txt") for i in range(5)])
    trace = await BashHarness().run(
        "loop", runtime=local_sandbox, model=server.endpoint(), budget=Budget(max_turns=2)
    )
    assert trace.error is not None and trace.error.kind == "budget_turns"
    assert len(trace.turns) == 2 and len(server.requests) == 2
    assert await local_sandbox.read("turns.txt") == b"0\n1\n"
    assert trace.output is None


@pytest.mark.anyio
async def test_token_budget_stops_the_run(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    server = scripted([bash_call("true", usage=(100, 50)) for _ in range(5)])
    trace = await BashHarness().run(
        "spend", runtime=local_sandbox, model=server.endpoint(), budget=Budget(max_tokens=250)
    )
    assert trace.error is not None and trace.error.kind == "budget_tokens"
    # 150 tokens after one turn is under 250; 300 after the second is over: no third call
    assert len(trace.turns) == 2 and trace.usage.total_tokens == 300
    assert "300 of 250" in trace.error.message


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_time_budget_cancels_a_running_command(
    scripted: ScriptedFactory, sandbox: Runtime
) -> None:
    server = scripted([bash_call("sleep 20; touch late.txt"), reply("never")])
    trace = await BashHarness().run(
        "slow", runtime=sandbox, model=server.endpoint(), budget=Budget(max_seconds=1.5)
    )
    assert trace.error is not None and trace.error.kind == "budget_time"
    assert trace.duration < 6
    assert not await sandbox.exists("late.txt")
    assert len(server.requests) == 1


@pytest.mark.anyio
async def test_model_error_mid_run_is_on_the_trace(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    server = scripted([bash_call("true"), http_error(500, "upstream exploded")])
    trace = await BashHarness().run("x", runtime=local_sandbox, model=server.endpoint())
    assert trace.error is not None
    assert trace.error.kind == "model_error" and trace.error.status_code == 500
    assert "upstream exploded" in trace.error.message
    assert [t.status_code for t in trace.turns] == [200, 500]


@pytest.mark.anyio
async def test_lost_sandbox_is_a_sandbox_error(scripted: ScriptedFactory) -> None:
    server = scripted([bash_call("true")])
    runtime = open_runtime({"type": "subprocess"})
    async with runtime:
        pass  # started and closed: the sandbox is gone
    trace = await BashHarness().run("x", runtime=runtime, model=server.endpoint())
    assert trace.error is not None and trace.error.kind == "sandbox_error"
    with pytest.raises(SandboxUnavailableError):
        trace.raise_for_error()


@pytest.mark.anyio
async def test_falls_back_to_sh_without_bash(scripted: ScriptedFactory, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "cat", "touch"):
        target = next(
            p
            for d in os.environ["PATH"].split(":")
            if os.access(p := os.path.join(d, tool), os.X_OK)
        )
        (bin_dir / tool).symlink_to(target)
    server = scripted([bash_call("echo $0"), reply("ok")])
    async with open_runtime({"type": "subprocess", "env": {"PATH": str(bin_dir)}}) as runtime:
        trace = await BashHarness().run("x", runtime=runtime, model=server.endpoint())
    assert trace.ok
    assert "stdout:\nsh\n" in trace.turns[0].tool_results[0].output
