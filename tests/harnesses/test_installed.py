"""The installed-harness machinery with a tiny agent built here as a real wheel.

The agent (``vf-tiny-agent``) is a small OpenAI-compatible tool loop; it is packed into a
wheel on the host, installed into a venv inside a subprocess sandbox from that
wheelhouse (offline: ``--no-index``), and driven through the proxy against the scripted
endpoint. Everything but the Docker-only mini-swe-agent test runs here in seconds.
"""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import anyio
import pytest

from harnesses.base import Budget, Trace
from harnesses.installed import (
    AgentLaunch,
    InstalledConfig,
    InstalledHarness,
    SandboxPython,
)
from harnesses.scripted import bash_call, http_error, reply
from runtimes import ExecResult, Runtime, open_runtime

from .conftest import ScriptedFactory

AGENT_SOURCE = r"""
import json, os, subprocess, sys, urllib.error, urllib.request

def main():
    url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
    key = os.environ["OPENAI_API_KEY"]
    tool = {"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}}}}
    messages = [{"role": "user", "content": sys.argv[1]}]
    while True:
        body = json.dumps({"model": "tiny", "messages": messages, "tools": [tool]}).encode()
        request = urllib.request.Request(url, data=body, headers={
            "Authorization": "Bearer " + key, "Content-Type": "application/json"})
        try:
            answer = json.load(urllib.request.urlopen(request, timeout=60))
        except urllib.error.HTTPError as exc:
            print("model error", exc.code, exc.read().decode(), file=sys.stderr)
            sys.exit(2)
        message = answer["choices"][0]["message"]
        if not message.get("tool_calls"):
            print(message["content"])
            return
        messages.append(message)
        for call in message["tool_calls"]:
            command = json.loads(call["function"]["arguments"])["command"]
            done = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": f"exit {done.returncode}\n{done.stdout}{done.stderr}"})
"""


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_tiny_wheel(directory: Path, version: str = "0.1.0") -> Path:
    """A real, pip-installable wheel of vf-tiny-agent with a console script."""
    directory.mkdir(parents=True, exist_ok=True)
    info = f"vf_tiny_agent-{version}.dist-info"
    files = {
        "vf_tiny_agent/__init__.py": AGENT_SOURCE.encode(),
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: vf-tiny-agent\nVersion: {version}\n"
        ).encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{info}/entry_points.txt": b"[console_scripts]\nvf-tiny-agent = vf_tiny_agent:main\n",
    }
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = directory / f"vf_tiny_agent-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return wheel


class TinyConfig(InstalledConfig):
    id: Literal["tiny"] = "tiny"
    version: str = "0.1.0"


class TinyHarness(InstalledHarness):
    id = "tiny"
    package = "vf-tiny-agent"
    config_model = TinyConfig

    def launch(
        self, task: str, *, base_url: str, api_key: str, run_dir: str, budget: Budget
    ) -> AgentLaunch:
        env = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        return AgentLaunch(argv=[self.venv_bin("vf-tiny-agent"), task], env=env)

    async def collect(
        self, runtime: Runtime, run_dir: str, result: ExecResult | None, trace: Trace
    ) -> None:
        if result is not None and result.exit_code == 0:
            trace.output = result.stdout.strip()


@pytest.fixture
def wheelhouse(tmp_path: Path) -> Path:
    house = tmp_path / "wheelhouse"
    build_tiny_wheel(house)
    return house


@pytest.fixture
async def sandbox() -> AsyncIterator[Runtime]:
    async with open_runtime({"type": "subprocess"}) as runtime:
        yield runtime


def tiny(wheelhouse: Path, root: Path, **fields: object) -> TinyHarness:
    config = TinyConfig(wheelhouse=str(wheelhouse), install_root=str(root), **fields)  # type: ignore[arg-type]
    return TinyHarness(config)


async def install_log(runtime: Runtime, harness: InstalledHarness) -> list[str]:
    data = await runtime.read(f"{harness.agent_dir}/install.log")
    return data.decode().splitlines()


@pytest.mark.anyio
async def test_concurrent_setups_install_once(
    sandbox: Runtime, wheelhouse: Path, tmp_path: Path
) -> None:
    root = tmp_path / "agents"
    harnesses = [tiny(wheelhouse, root) for _ in range(3)]
    async with anyio.create_task_group() as group:
        for harness in harnesses:
            group.start_soon(harness.setup, sandbox)
    lines = await install_log(sandbox, harnesses[0])
    assert len(lines) == 1 and "installed vf-tiny-agent==0.1.0" in lines[0]
    assert await harnesses[0].installed_version(sandbox) == "0.1.0"
    await harnesses[1].setup(sandbox)  # the fast path: version present, nothing installed
    assert len(await install_log(sandbox, harnesses[0])) == 1


@pytest.mark.anyio
async def test_a_new_version_installs_next_to_the_old(
    sandbox: Runtime, wheelhouse: Path, tmp_path: Path
) -> None:
    root = tmp_path / "agents"
    await tiny(wheelhouse, root).setup(sandbox)
    build_tiny_wheel(wheelhouse, version="0.2.0")
    newer = tiny(wheelhouse, root, version="0.2.0")
    assert await newer.installed_version(sandbox) is None
    await newer.setup(sandbox)
    assert await newer.installed_version(sandbox) == "0.2.0"
    assert await tiny(wheelhouse, root).installed_version(sandbox) == "0.1.0"
    assert len(await install_log(sandbox, newer)) == 2


@pytest.mark.anyio
async def test_missing_package_is_an_install_error_on_the_trace(
    sandbox: Runtime, wheelhouse: Path, tmp_path: Path, scripted: ScriptedFactory
) -> None:
    server = scripted([reply("never")])
    harness = tiny(wheelhouse, tmp_path / "agents", version="9.9.9")
    trace = await harness.run("x", runtime=sandbox, model=server.endpoint())
    assert trace.error is not None and trace.error.kind == "install_error"
    assert "vf-tiny-agent==9.9.9" in trace.error.message
    assert server.requests == []


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_agent_session_runs_in_the_sandbox_through_the_proxy(
    sandbox: Runtime, wheelhouse: Path, tmp_path: Path, scripted: ScriptedFactory
) -> None:
    server = scripted([bash_call("echo made-by-agent > made.txt"), reply("finished")])
    harness = tiny(wheelhouse, tmp_path / "agents")
    trace = await harness.run("make a file", runtime=sandbox, model=server.endpoint())
    assert trace.ok, trace.error
    assert trace.output == "finished"
    assert await sandbox.read("made.txt") == b"made-by-agent\n"
    assert server.failures == []
    assert [t.status_code for t in trace.turns] == [200, 200]
    assert trace.turns[0].request_messages == [{"role": "user", "content": "make a file"}]
    assert trace.turns[1].request_messages[-1]["content"] == "exit 0\n"
    # the agent held only the run's secret; the upstream saw no key at all
    assert all(r.api_key is None for r in server.requests)
    json.loads(trace.model_dump_json())


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_budget_refusal_stops_the_agent(
    sandbox: Runtime, wheelhouse: Path, tmp_path: Path, scripted: ScriptedFactory
) -> None:
    server = scripted([bash_call(f"echo {i} >> turns.txt") for i in range(5)])
    harness = tiny(wheelhouse, tmp_path / "agents")
    trace = await harness.run(
        "loop", runtime=sandbox, model=server.endpoint(), budget=Budget(max_turns=2)
    )
    assert trace.error is not None and trace.error.kind == "budget_turns"
    assert len(server.requests) == 2 and len(trace.turns) == 2
    assert await sandbox.read("turns.txt") == b"0\n1\n"


@pytest.mark.anyio
async def test_time_budget_kills_the_agent(
    sandbox: Runtime, wheelhouse: Path, tmp_path: Path, scripted: ScriptedFactory
) -> None:
    harness = tiny(wheelhouse, tmp_path / "agents")
    await harness.setup(sandbox)  # install outside the timed run
    server = scripted([bash_call("sleep 30; touch late.txt"), reply("never")])
    trace = await harness.run(
        "slow", runtime=sandbox, model=server.endpoint(), budget=Budget(max_seconds=3)
    )
    assert trace.error is not None and trace.error.kind == "budget_time"
    assert trace.duration < 10
    await anyio.sleep(0.5)
    assert not await sandbox.exists("late.txt")


@pytest.mark.anyio
async def test_upstream_error_that_stops_the_agent_is_a_model_error(
    sandbox: Runtime, wheelhouse: Path, tmp_path: Path, scripted: ScriptedFactory
) -> None:
    server = scripted([http_error(500, "upstream down")])
    harness = tiny(wheelhouse, tmp_path / "agents")
    trace = await harness.run("x", runtime=sandbox, model=server.endpoint())
    assert trace.error is not None
    assert trace.error.kind == "model_error" and trace.error.status_code == 500
    assert trace.turns[0].status_code == 500


def test_pip_platforms_follow_the_sandbox_glibc() -> None:
    tags = SandboxPython("3.11", "x86_64", "2.36").pip_platforms()
    assert "manylinux_2_36_x86_64" in tags and "manylinux_2_17_x86_64" in tags
    assert "manylinux_2_37_x86_64" not in tags and "manylinux2014_x86_64" in tags
    assert SandboxPython("3.12", "aarch64", "none").pip_platforms() == ["linux_aarch64"]
    key = SandboxPython("3.11", "x86_64", "2.36").cache_key(["a==1", "b==2"])
    assert key != SandboxPython("3.11", "x86_64", "2.36").cache_key(["a==1"])
