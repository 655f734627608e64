"""The bash harness: scripted tool calls really run in the sandbox (subprocess and Docker)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from harnesses.base import Budget, ToolResult, for_policy
from harnesses.bash import (
    DEFAULT_SYSTEM_PROMPT,
    PERSISTENT_SYSTEM_PROMPT,
    BashConfig,
    BashHarness,
    truncate_for_model,
)
from harnesses.scripted import bash_call, http_error, reply, tool_calls
from runtimes import Runtime, SandboxUnavailableError, ShellSessionError, open_runtime

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
    assert trace.duration < 15  # not the command's 20 s (a loaded machine adds seconds)
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


# ---------------------------------------------------------------------- persistent_shell


def _persistent(**fields: object) -> BashHarness:
    return BashHarness(BashConfig(persistent_shell=True, **fields))  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_persistent_shell_keeps_state_and_says_so(
    scripted: ScriptedFactory, sandbox: Runtime
) -> None:
    server = scripted(
        [
            bash_call("mkdir -p sub && cd sub && export GREETING=hi && greet() { echo hey; }"),
            bash_call('pwd; echo "$GREETING"; greet; exit_early() { return 4; }; exit_early'),
            reply("done"),
        ]
    )
    trace = await _persistent().run("x", runtime=sandbox, model=server.endpoint())
    assert trace.ok, trace.error
    second = trace.turns[1].tool_results[0]
    assert second.exit_code == 4
    assert f"stdout:\n{sandbox.workdir}/sub\nhi\nhey\n" in second.output
    first_request = server.requests[0]
    assert first_request.messages[0]["content"] == PERSISTENT_SYSTEM_PROMPT
    description = first_request.body["tools"][0]["function"]["description"]
    assert "persists between calls" in description and "fresh shell" not in description


@pytest.mark.anyio
async def test_fresh_shells_by_default_and_say_so(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    server = scripted([bash_call("export GREETING=hi"), bash_call('echo "[$GREETING]"'), reply("")])
    trace = await BashHarness().run("x", runtime=local_sandbox, model=server.endpoint())
    assert "stdout:\n[]\n" in trace.turns[1].tool_results[0].output
    assert server.requests[0].messages[0]["content"] == DEFAULT_SYSTEM_PROMPT
    description = server.requests[0].body["tools"][0]["function"]["description"]
    assert "fresh shell" in description


@pytest.mark.anyio
async def test_persistent_shell_keeps_a_custom_prompt(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    server = scripted([reply("ok")])
    harness = _persistent(system_prompt="Be brief.")
    await harness.run("x", runtime=local_sandbox, model=server.endpoint())
    assert server.requests[0].messages[0]["content"] == "Be brief."


@pytest.mark.anyio
async def test_persistent_shell_timeout_interrupts_and_the_shell_goes_on(
    scripted: ScriptedFactory, sandbox: Runtime
) -> None:
    server = scripted(
        [
            bash_call("mkdir -p slow && cd slow && echo started && sleep 30; touch late.txt"),
            bash_call("pwd"),
            reply("gave up"),
        ]
    )
    trace = await _persistent(per_call_timeout=0.5).run(
        "wait", runtime=sandbox, model=server.endpoint()
    )
    assert trace.ok and trace.output == "gave up"
    timed_out, after = trace.turns[0].tool_results[0], trace.turns[1].tool_results[0]
    assert timed_out.timed_out and timed_out.exit_code is None
    assert "timed out after 0.5s; the command was interrupted" in timed_out.output
    assert "started" in timed_out.output and timed_out.duration < 10
    # Ctrl-C aborts the whole command line: `touch` never ran, the cd stayed
    assert after.exit_code == 0 and f"{sandbox.workdir}/slow\n" in after.output
    assert not await sandbox.exists("slow/late.txt")


@pytest.mark.anyio
async def test_persistent_shell_output_cap_interrupts(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    server = scripted([bash_call("cd /; yes"), bash_call("pwd"), reply("ok")])
    trace = await _persistent(exec_output_limit=64 * 1024).run(
        "x", runtime=local_sandbox, model=server.endpoint()
    )
    capped, after = trace.turns[0].tool_results[0], trace.turns[1].tool_results[0]
    assert capped.output.startswith("interrupted: output exceeded 65536 bytes"), capped.output
    assert after.output == "exit_code: 0\nstdout:\n/\n"


@pytest.mark.anyio
async def test_persistent_shell_that_exits_is_replaced_and_the_model_told(
    scripted: ScriptedFactory, sandbox: Runtime
) -> None:
    server = scripted(
        [
            bash_call("mkdir -p sub && cd sub && export X=1"),
            bash_call("echo bye; exit 3"),
            bash_call('pwd; echo "${X-unset}"'),
            reply("recovered"),
        ]
    )
    trace = await _persistent().run("x", runtime=sandbox, model=server.endpoint())
    assert trace.ok and trace.output == "recovered", trace.error
    died, fresh = trace.turns[1].tool_results[0], trace.turns[2].tool_results[0]
    assert died.exit_code is None
    assert died.output.startswith("the shell session ended (the shell exited with status 3)")
    assert "next command runs in a fresh shell" in died.output
    assert "stdout:\nbye\n" in died.output
    assert fresh.output == f"exit_code: 0\nstdout:\n{sandbox.workdir}\nunset\n"


@pytest.mark.anyio
async def test_persistent_shell_hooks_run_after_each_command_even_a_sweep(
    scripted: ScriptedFactory, sandbox: Runtime
) -> None:
    """A hook that stops every process the runtime's commands started (placement's judge
    guard does) kills the session too: each next command runs in a fresh one, and the
    model is told so every time rather than seeing a command silently not run."""
    server = scripted(
        [bash_call("cd /tmp && sleep 100 &"), bash_call("pwd"), bash_call("pwd"), reply("ok")]
    )
    seen: list[tuple[str, int | None, int]] = []

    async def sweep(runtime: Runtime, command: str, result: ToolResult) -> None:
        seen.append((command, result.exit_code, await runtime.stop_processes()))

    harness = _persistent()
    assert harness.add_command_hook(sweep) is True
    trace = await harness.run("x", runtime=sandbox, model=server.endpoint())
    assert trace.ok, trace.error
    assert [(c, code) for c, code, _ in seen] == [
        ("cd /tmp && sleep 100 &", 0),
        ("pwd", 0),
        ("pwd", 0),
    ]
    assert seen[0][2] >= 2  # at least the background sleep and the session itself
    for turn in trace.turns[1:3]:
        output = turn.tool_results[0].output
        assert output.startswith("note: the shell session had ended"), output
        assert output.endswith(f"exit_code: 0\nstdout:\n{sandbox.workdir}\n"), output


@pytest.mark.anyio
async def test_persistent_shell_keeps_shell_vars_unexported(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    server = scripted(
        [bash_call('echo "[$SECRET_SPOT]"; sh -c \'echo "<${SECRET_SPOT-unset}>"\''), reply("")]
    )
    harness = _persistent(shell_vars={"SECRET_SPOT": "/inputs/verdict.json"}, env={"A": "b"})
    trace = await harness.run("x", runtime=local_sandbox, model=server.endpoint())
    output = trace.turns[0].tool_results[0].output
    assert output == "exit_code: 0\nstdout:\n[/inputs/verdict.json]\n<unset>\n", output


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_persistent_shell_time_budget_cancels_and_closes_the_session(
    scripted: ScriptedFactory, sandbox: Runtime
) -> None:
    # its own sleep (a subprocess sandbox's ps lists the host's, other tests' included)
    server = scripted([bash_call("sleep 20.31345; touch late.txt"), reply("never")])
    trace = await _persistent().run(
        "slow", runtime=sandbox, model=server.endpoint(), budget=Budget(max_seconds=1.5)
    )
    assert trace.error is not None and trace.error.kind == "budget_time"
    assert trace.duration < 15  # not the command's 20 s (a loaded machine adds seconds)
    left = await sandbox.exec(["sh", "-c", "ps -eo args | grep -c '^sleep 20.31345$' || true"])
    tree = await sandbox.exec(["sh", "-c", "ps -eo pid,ppid,pgid,sid,stat,args"])
    assert left.stdout.strip() == "0", (left, tree.stdout)
    assert not await sandbox.exists("late.txt")


@pytest.mark.anyio
async def test_persistent_shell_that_cannot_start_ends_the_run(
    scripted: ScriptedFactory, tmp_path: Path
) -> None:
    """No python3 in the sandbox: the session cannot start, the run ends typed before the
    model is called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "bash"):
        target = next(
            p
            for d in os.environ["PATH"].split(":")
            if os.access(p := os.path.join(d, tool), os.X_OK)
        )
        (bin_dir / tool).symlink_to(target)
    server = scripted([bash_call("true"), reply("never")])
    async with open_runtime({"type": "subprocess", "env": {"PATH": str(bin_dir)}}) as runtime:
        trace = await _persistent().run("x", runtime=runtime, model=server.endpoint())
    assert trace.error is not None and trace.error.kind == "sandbox_error"
    assert trace.error.exception_type == "ShellSessionError"
    assert "no shell session" in trace.error.message
    assert server.requests == []
    with pytest.raises(ShellSessionError):
        trace.raise_for_error()


@pytest.mark.anyio
async def test_persistent_shell_refused_command_is_answered(
    scripted: ScriptedFactory, local_sandbox: Runtime
) -> None:
    """A command the session refuses (a NUL byte) is a tool error; the session goes on."""
    server = scripted(
        [tool_calls(("bash", {"command": "echo a\u0000b"})), bash_call("echo fine"), reply("")]
    )
    trace = await _persistent().run("x", runtime=local_sandbox, model=server.endpoint())
    refused, fine = trace.turns[0].tool_results[0], trace.turns[1].tool_results[0]
    assert refused.output.startswith("error: the command could not be run:"), refused.output
    assert "NUL" in refused.output
    assert fine.output == "exit_code: 0\nstdout:\nfine\n"


@pytest.mark.anyio
@pytest.mark.docker
async def test_persistent_shell_of_a_policy_runs_as_the_policy_user(
    scripted: ScriptedFactory,
) -> None:
    """Privilege separation holds: a policy's session (``for_policy``) is the policy's user."""
    server = scripted([bash_call("id -un; touch mine; stat -c %U mine"), reply("")])
    async with open_runtime({"type": "docker", "image": PYTHON_IMAGE}) as runtime:
        assert runtime.policy_user == "vf-policy"
        harness = for_policy(_persistent(), runtime)
        trace = await harness.run("x", runtime=runtime, model=server.endpoint())
    assert trace.turns[0].tool_results[0].output == (
        "exit_code: 0\nstdout:\nvf-policy\nvf-policy\n"
    )
