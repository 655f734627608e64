"""mini-swe-agent end to end: installed into a Docker sandbox from a host-built wheelhouse,
driven against the scripted endpoint through the proxy, in a container with no network at
all (``network="none"``): its model calls reach the proxy through the channel relay. The
same run, once per backend, inside the SSH test host with reverse forwarding refused, and
inside the Modal fake (network blocked): the channel relay is the route there too.

The host wheelhouse is downloaded from the package index once and cached
(``~/.cache/vf-sandbox/wheelhouses``); the install is offline (``pip install --no-index``).
"""

from __future__ import annotations

import time
import types
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import harnesses.installed
from harnesses.base import Budget
from harnesses.mini_swe_agent import MiniSweAgentConfig, MiniSweAgentHarness
from harnesses.proxy import ProxyRoute
from harnesses.scripted import bash_call, http_error
from runtimes import Runtime, SandboxError, open_runtime
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures
from tests.ssh.sshd import SSHServer, image_present, venv_part_mounts

from .conftest import ScriptedFactory

pytestmark = [pytest.mark.docker, pytest.mark.slow]

SANDBOX = {"type": "docker", "image": "vf-sandbox/python:latest", "network": "none"}
DONE = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && echo the file is written"


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def sandbox() -> AsyncIterator[Runtime]:
    """One container for the module: installed once, then several sessions share it."""
    async with open_runtime(SANDBOX) as runtime:
        yield runtime


@pytest.mark.anyio
async def test_concurrent_installs_install_once(sandbox: Runtime) -> None:
    first, second = MiniSweAgentHarness(), MiniSweAgentHarness()
    started = time.monotonic()
    async with anyio.create_task_group() as group:
        group.start_soon(first.setup, sandbox)
        group.start_soon(second.setup, sandbox)
    cold = time.monotonic() - started
    log = (await sandbox.read(f"{first.agent_dir}/install.log")).decode().splitlines()
    assert len(log) == 1, log
    assert "installed mini-swe-agent==2.4.6 litellm==1.102.4" in log[0]
    assert await first.installed_version(sandbox) == "2.4.6"
    started = time.monotonic()
    await second.setup(sandbox)
    warm = time.monotonic() - started
    assert len((await sandbox.read(f"{first.agent_dir}/install.log")).splitlines()) == 1
    print(f"\nmini-swe-agent setup: first (two concurrent) {cold:.1f}s, second {warm:.2f}s")


@pytest.mark.anyio
async def test_scripted_session_completes_with_every_turn_on_the_trace(
    sandbox: Runtime, scripted: ScriptedFactory
) -> None:
    server = scripted(
        [bash_call("echo hello from mini > hello.txt && cat hello.txt"), bash_call(DONE)]
    )
    harness = MiniSweAgentHarness()
    trace = await harness.run("Write hello.txt.", runtime=sandbox, model=server.endpoint())
    assert trace.ok, (trace.error, trace.metadata.get("agent_log_tail"))
    assert server.failures == []
    assert trace.output == "the file is written\n"
    assert trace.metadata["exit_status"] == "Submitted"
    assert trace.metadata["api_calls"] == 2
    assert await sandbox.read("hello.txt") == b"hello from mini\n"
    assert [t.status_code for t in trace.turns] == [200, 200]
    assert "Write hello.txt." in trace.turns[0].request_messages[1]["content"]
    # the second request carries the tool result of the first command, run in the sandbox
    tool_message = trace.turns[1].request_messages[-1]
    assert tool_message["role"] == "tool" and "hello from mini" in tool_message["content"]
    # the agent named a placeholder model; the upstream saw its own
    assert all(r.body["model"] == "scripted-model" for r in server.requests)


@pytest.mark.anyio
async def test_turn_budget_stops_mini_at_once(sandbox: Runtime, scripted: ScriptedFactory) -> None:
    server = scripted([bash_call(f"echo {i} >> budget.txt") for i in range(4)])
    harness = MiniSweAgentHarness(MiniSweAgentConfig(model_retries=10))
    started = time.monotonic()
    trace = await harness.run(
        "Loop.", runtime=sandbox, model=server.endpoint(), budget=Budget(max_turns=1)
    )
    assert trace.error is not None and trace.error.kind == "budget_turns"
    assert len(server.requests) == 1 and len(trace.turns) == 1
    # mini would retry a 429 ten times with backoff; the harness stops it instead
    assert time.monotonic() - started < 60
    assert await sandbox.read("budget.txt") == b"0\n"


@pytest.mark.anyio
async def test_upstream_error_is_passed_to_mini_and_typed(
    sandbox: Runtime, scripted: ScriptedFactory
) -> None:
    server = scripted([http_error(500, "provider exploded")])
    harness = MiniSweAgentHarness(MiniSweAgentConfig(model_retries=1))
    trace = await harness.run("Anything.", runtime=sandbox, model=server.endpoint())
    assert trace.error is not None
    assert trace.error.kind == "model_error" and trace.error.status_code == 500
    assert "provider exploded" in (trace.turns[0].error or "")


# ---------------------------------------------------------------------- other backends


@pytest.fixture
def routes_taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The route of every run to the model proxy (``harnesses.installed`` asks for it)."""
    taken: list[str] = []
    original = harnesses.installed.route_to_host

    async def recording(*args: Any, **kwargs: Any) -> ProxyRoute:
        route = await original(*args, **kwargs)
        taken.append(route.via)
        return route

    monkeypatch.setattr(harnesses.installed, "route_to_host", recording)
    return taken


@pytest.fixture
def venv_parts(tmp_path: Path) -> list[tuple[str, str, str]]:
    """Volume mappings giving the SSH test host ``ensurepip`` and pip's wheel."""
    return venv_part_mounts(tmp_path)


async def completes_and_keeps_to_its_budget(
    runtime: Runtime, scripted: ScriptedFactory, routes_taken: list[str]
) -> MiniSweAgentHarness:
    """One mini session that completes (every turn on the trace, its command run in the
    sandbox), then one stopped by its turn budget; both over the channel relay."""
    server = scripted(
        [bash_call("echo hello from mini > hello.txt && cat hello.txt"), bash_call(DONE)]
    )
    harness = MiniSweAgentHarness(MiniSweAgentConfig(model_retries=10))
    trace = await harness.run("Write hello.txt.", runtime=runtime, model=server.endpoint())
    assert trace.ok, (trace.error, trace.metadata.get("agent_log_tail"))
    assert server.failures == []
    assert trace.output == "the file is written\n"
    assert trace.metadata["exit_status"] == "Submitted"
    assert [t.status_code for t in trace.turns] == [200, 200]
    assert "Write hello.txt." in trace.turns[0].request_messages[1]["content"]
    tool_message = trace.turns[1].request_messages[-1]
    assert tool_message["role"] == "tool" and "hello from mini" in tool_message["content"]
    assert await runtime.read("hello.txt") == b"hello from mini\n"

    budgeted = scripted([bash_call(f"echo {i} >> budget.txt") for i in range(4)])
    trace = await harness.run(
        "Loop.", runtime=runtime, model=budgeted.endpoint(), budget=Budget(max_turns=1)
    )
    assert trace.error is not None and trace.error.kind == "budget_turns", trace.error
    assert len(budgeted.requests) == 1 and len(trace.turns) == 1
    assert await runtime.read("budget.txt") == b"0\n"
    assert routes_taken == ["channel", "channel"]
    return harness


@pytest.mark.ssh
@pytest.mark.anyio
async def test_mini_runs_in_the_ssh_host_without_a_reverse_forward(
    scripted: ScriptedFactory,
    routes_taken: list[str],
    venv_parts: list[tuple[str, str, str]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from runtimes.ssh import SSHBackend

    assert image_present(), "vf-sandbox/sshd is missing: build it with `make images`"
    forwards: list[int] = []

    async def no_forwarding(self: Any, port: int, *args: Any, **kwargs: Any) -> int:
        forwards.append(port)
        raise SandboxError("this test host allows no TCP forwarding")

    monkeypatch.setattr(SSHBackend, "forward_remote", no_forwarding)
    with SSHServer(tmp_path / "sshd", volumes=venv_parts) as sshd:
        async with open_runtime(sshd.config()) as runtime:
            await completes_and_keeps_to_its_budget(runtime, scripted, routes_taken)
    assert forwards == []


@pytest.mark.anyio
async def test_mini_runs_in_the_modal_fake(
    scripted: ScriptedFactory,
    routes_taken: list[str],
    fake_modal: types.ModuleType,  # noqa: F811 - the fixture
) -> None:
    config = fake_config(image="vf-sandbox/python:latest")  # the network blocked: the default
    async with open_runtime(config) as runtime:
        assert runtime.host_routes() == ("channel",)
        harness = await completes_and_keeps_to_its_budget(runtime, scripted, routes_taken)
        # The fake terminates a sandbox by removing its container, synchronously: with the
        # installed venv in it that outlasts the runtime's terminate deadline on a busy
        # machine (real Modal answers at once). Remove the venv first, within this test.
        removed = await runtime.exec(["rm", "-rf", harness.config.install_root], timeout=600)
        assert removed.exit_code == 0, removed.stderr
