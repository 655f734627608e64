"""Secrets never leak: SSH passwords, private keys and passphrases, model API keys and the
proxy's per-run secrets appear in no log line, repr, exception, traceback, trace,
transcript, agent-runs JSON or command output.

One test runs a scenario per secret, succeeding and failing (wrong password, wrong
passphrase, wrong API key, wrong proxy secret, bad configs), with every logger at DEBUG
(paramiko, httpx and httpcore included) written to a file. Everything the scenarios
produced is then collected and searched for every secret value.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import subprocess
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from cryptography.hazmat.primitives import serialization

from harnesses.base import Trace
from harnesses.llm import ModelTable
from harnesses.proxy import ModelProxy, ProxyRun
from harnesses.scripted import ScriptedEndpoint, bash_call, reply
from placement.inputs import JudgeInputs
from placement.run import run_judges
from placement.specs import JudgeSpec
from runtimes import SandboxError, open_runtime, resolve_runtime_config
from runtimes.ssh import SSHRuntime
from tests.harnesses.test_installed import TinyConfig, TinyHarness, build_tiny_wheel
from tests.ssh.sshd import PASSWORD, SSHServer

from .conftest import REPO, TALLY

pytestmark = [pytest.mark.anyio, pytest.mark.ssh, pytest.mark.docker]

LOGGERS = ("", "paramiko", "httpx", "httpcore", "runtimes", "harnesses", "placement", "asyncio")


class Evidence:
    """Everything a scenario produced that a user or an operator could end up reading."""

    def __init__(self, log_file: Path) -> None:
        self.log_file = log_file
        self.texts: list[tuple[str, str]] = []

    def add(self, what: str, value: Any) -> None:
        self.texts.append((what, value if isinstance(value, str) else repr(value)))

    def error(self, what: str, exc: BaseException) -> None:
        self.add(f"{what}: str", str(exc))
        self.add(f"{what}: repr", repr(exc))
        self.add(f"{what}: traceback", "".join(traceback.format_exception(exc)))

    def everything(self) -> list[tuple[str, str]]:
        for handler in logging.getLogger().handlers:
            handler.flush()
        return [*self.texts, ("DEBUG log", self.log_file.read_text(errors="replace"))]


@pytest.fixture
def evidence(tmp_path: Path) -> Iterator[Evidence]:
    log_file = tmp_path / "debug.log"
    handler = logging.FileHandler(log_file)
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    saved = {name: logging.getLogger(name).level for name in LOGGERS}
    root = logging.getLogger()
    root.addHandler(handler)
    for name in LOGGERS:
        logging.getLogger(name).setLevel(logging.DEBUG)
    try:
        yield Evidence(log_file)
    finally:
        root.removeHandler(handler)
        handler.close()
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


async def _cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    """The real ``vf-sandbox`` command line, in a child process (its output is evidence)."""
    argv = [sys.executable, "-m", "placement.cli", *args]
    run = functools.partial(
        subprocess.run, argv, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    return await anyio.to_thread.run_sync(run)


def _encrypted_copy(key_path: Path, passphrase: str, target: Path) -> Path:
    key = serialization.load_ssh_private_key(key_path.read_bytes(), password=None)
    target.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.BestAvailableEncryption(passphrase.encode()),
        )
    )
    target.chmod(0o600)
    return target


def _key_fragments(private_text: str) -> list[str]:
    """Distinctive pieces of a private key's base64 body (any one of them is a leak)."""
    body = "".join(line for line in private_text.splitlines() if "-----" not in line)
    return [body[i : i + 24] for i in range(40, len(body) - 24, 97)]


async def _ssh_scenarios(
    server: SSHServer, tmp_path: Path, ev: Evidence, found: dict[str, str]
) -> None:
    passphrase = "pp-" + secrets.token_hex(12)
    wrong = "wrong-" + secrets.token_hex(12)
    found.update(
        {"ssh password": PASSWORD, "wrong ssh password": wrong, "key passphrase": passphrase}
    )
    for n, fragment in enumerate(_key_fragments(server.key.private_text)):
        found[f"private key fragment {n}"] = fragment

    password_config = server.password_config()
    ev.add("password config repr", password_config)
    ev.add("password config str", str(password_config))
    ev.add("password config json", password_config.model_dump_json())
    async with open_runtime(password_config) as rt:
        ev.add("runtime repr", rt)
        ev.add("runtime describe", rt.describe())
        ev.add("exec", await rt.exec(["sh", "-c", "echo out; echo err >&2"]))
        await rt.write("f.txt", b"x")
        try:
            await rt.exec(["/no/such/program"])
        except SandboxError as exc:
            ev.error("missing program", exc)
        ev.add("listing", await SSHRuntime.list_sandboxes(password_config))

    for config in (
        server.password_config(password=wrong),
        server.config(
            key_file=str(_encrypted_copy(server.key.private_path, passphrase, tmp_path / "enc")),
            key_passphrase="not-" + passphrase,
        ),
    ):
        try:
            async with open_runtime(config):
                pass
        except SandboxError as exc:
            ev.error("refused login", exc)
    encrypted = _encrypted_copy(server.key.private_path, passphrase, tmp_path / "enc2")
    async with open_runtime(
        server.config(key_file=str(encrypted), key_passphrase=passphrase)
    ) as rt:
        ev.add("passphrase runtime", rt.describe())
        ev.add("passphrase config", rt.config)

    os.environ["VF_TEST_SSH_KEY"] = server.key.private_text
    try:
        env_config = server.config(key_file=None, key_env="VF_TEST_SSH_KEY")
        async with open_runtime(env_config) as rt:
            ev.add("key_env exec", await rt.exec(["true"]))
            ev.add("key_env config", env_config)
    finally:
        del os.environ["VF_TEST_SSH_KEY"]

    for bad in (
        {"type": "ssh", "host": "h", "username": "u", "password": PASSWORD, "port": "x"},
        {"type": "ssh", "host": "h", "username": "u", "password": wrong, "bogus": wrong},
        {"type": "ssh", "host": "h", "username": "u", "key_passphrase": passphrase, "key_file": 5},
    ):
        try:
            resolve_runtime_config(bad)
        except SandboxError as exc:
            ev.error("bad ssh config", exc)
    cli = await _cli(
        [
            "exec",
            "--runtime",
            json.dumps(
                {
                    "type": "ssh",
                    "host": "127.0.0.1",
                    "port": server.port,
                    "username": "sandbox",
                    "password": wrong,
                    "known_hosts": str(server.known_hosts),
                    "connect_timeout": 5,
                }
            ),
            "--",
            "true",
        ]
    )
    assert cli.returncode == 1, cli.stderr  # refused login: a runtime error, not usage
    ev.add("cli stdout", cli.stdout)
    ev.add("cli stderr", cli.stderr)


async def _model_scenarios(tmp_path: Path, ev: Evidence, found: dict[str, str]) -> None:
    key = "sk-live-" + secrets.token_hex(20)
    wrong = "sk-wrong-" + secrets.token_hex(20)
    found.update({"model API key": key, "wrong model API key": wrong})
    os.environ["VF_TEST_MODEL_KEY"] = key
    os.environ["VF_TEST_WRONG_KEY"] = wrong
    try:
        write = 'printf \'{"passed": true}\' > "$VF_AGENT_VERDICT"'
        with (
            ScriptedEndpoint([bash_call(write), reply("done")], api_key=key) as good,
            ScriptedEndpoint([reply("never")], api_key=key) as guarded,
        ):
            table = ModelTable(
                models={
                    "grader": good.endpoint(api_key_env="VF_TEST_MODEL_KEY"),
                    "wrong": guarded.endpoint(api_key_env="VF_TEST_WRONG_KEY"),
                }
            )
            ev.add("model table", table)
            ev.add("model table json", table.model_dump_json())
            judges = [
                JudgeSpec(
                    name="ok",
                    harness="bash",
                    model="grader",
                    prompt="p",
                    verdict_schema={"passed": "boolean"},
                ),
                JudgeSpec(
                    name="refused",
                    harness="null",
                    model="wrong",
                    prompt="p",
                    verdict_schema={"passed": "boolean"},
                ),
            ]
            trace = Trace(harness="bash").finish("policy done")
            async with open_runtime({"type": "subprocess"}) as rt:
                runs = await run_judges(
                    judges, task={"id": "t"}, trace=trace, models=table, runtime=rt, strict=False
                )
            for run in runs:
                ev.add(f"agent run {run.name}", run.model_dump_json())
                if run.trace is not None:
                    ev.add(f"trace {run.name}", run.trace.model_dump_json())
                    ev.add(
                        f"transcript {run.name}",
                        JudgeInputs.take({"id": "t"}, run.trace).transcript_md.decode(),
                    )
                if run.error:
                    ev.add(f"error {run.name}", run.error)
            assert runs[0].ok and runs[1].error_type == "JudgeModelFailed", [r.error for r in runs]

            models_file = tmp_path / "models.yaml"
            models_file.write_text(
                json.dumps(
                    {
                        "models": {
                            "grader": good.endpoint(api_key_env="VF_TEST_MODEL_KEY").model_dump(
                                mode="json"
                            )
                        }
                    }
                )
            )
            judges_file = tmp_path / "judges.yaml"
            judges_file.write_text(
                json.dumps(
                    [
                        {
                            "name": "cli",
                            "harness": "bash",
                            "model": "grader",
                            "prompt": "p",
                            "verdict_schema": {"passed": "boolean"},
                        }
                    ]
                )
            )
            good.extend([bash_call(write), reply("done")])
            out = tmp_path / "agent-runs.json"
            cli = await _cli(
                [
                    "judge",
                    str(REPO / "examples" / "rollout"),
                    "--judges",
                    str(judges_file),
                    "--models",
                    str(models_file),
                    "--out",
                    str(out),
                ]
            )
            ev.add("judge cli stdout", cli.stdout)
            ev.add("judge cli stderr", cli.stderr)
            assert cli.returncode == 0, cli.stderr
            ev.add("agent-runs.json", out.read_text())
    finally:
        del os.environ["VF_TEST_MODEL_KEY"], os.environ["VF_TEST_WRONG_KEY"]


async def _proxy_scenarios(
    tmp_path: Path, ev: Evidence, found: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    upstream_key = "sk-upstream-" + secrets.token_hex(20)
    found["proxy upstream key"] = upstream_key
    issued: list[ProxyRun] = []
    original = ProxyRun.__init__

    def recording(self: ProxyRun, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        issued.append(self)

    monkeypatch.setattr(ProxyRun, "__init__", recording)
    monkeypatch.setenv("VF_TEST_UPSTREAM", upstream_key)
    wheelhouse = tmp_path / "wheelhouse"
    build_tiny_wheel(wheelhouse)
    harness = TinyHarness(
        TinyConfig(wheelhouse=str(wheelhouse), install_root=str(tmp_path / "agents"))
    )
    with ScriptedEndpoint(
        [bash_call("echo hi"), reply("finished")], api_key=upstream_key
    ) as upstream:
        endpoint = upstream.endpoint(api_key_env="VF_TEST_UPSTREAM")
        async with open_runtime({"type": "subprocess"}) as rt:
            trace = await harness.run("do it", runtime=rt, model=endpoint)
            ev.add("installed trace", trace.model_dump_json())
            ev.add(
                "installed transcript", JudgeInputs.take({"id": "t"}, trace).transcript_md.decode()
            )
            assert trace.ok, trace.error
            upstream.extend([reply("x")] * 3)
            budget_trace = await harness.run("again", runtime=rt, model=endpoint, budget=None)
            ev.add("second trace", budget_trace.model_dump_json())
        with ModelProxy() as proxy:
            run = proxy.open_run(endpoint, Trace(harness="test"))
            ev.add("proxy run repr", run)
            ev.add("proxy repr", proxy)
            for bearer in (None, "guess-" + secrets.token_hex(8), upstream_key):
                headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
                refused = await anyio.to_thread.run_sync(
                    functools.partial(
                        httpx.post,
                        f"{proxy.base_url}/chat/completions",
                        json={"messages": []},
                        headers=headers,
                        timeout=30,
                    )
                )
                ev.add("proxy refusal", f"{refused.status_code} {refused.text}")
            run.close()
    assert issued, "the proxy issued no secret: the scenario did not run"
    for n, run in enumerate(issued):
        found[f"proxy secret {n}"] = run.secret


async def test_no_secret_appears_anywhere(
    evidence: Evidence, shared_sshd: SSHServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found: dict[str, str] = {}
    await _ssh_scenarios(shared_sshd, tmp_path, evidence, found)
    await _model_scenarios(tmp_path, evidence, found)
    await _proxy_scenarios(tmp_path, evidence, found, monkeypatch)

    control = "control-" + secrets.token_hex(12)  # logged on purpose: the scan must see it
    logging.getLogger("runtimes.ssh").debug("control value %s", control)
    everything = evidence.everything()
    log_text = everything[-1][1]
    assert any(control in text for _, text in everything), "the scan cannot see the DEBUG log"
    # The scan is live: it sees paramiko's DEBUG log, the proxy and the sandboxes.
    assert "paramiko.transport" in log_text and "Authentication (password) successful" in log_text
    assert "runtimes" in log_text
    leaks = [
        f"{name} in {what}"
        for name, value in found.items()
        for what, text in everything
        if value in text
    ]
    assert not leaks, leaks
    TALLY.add("secrets: values searched", len(found))
    TALLY.add("secrets: artefacts searched", len(everything))
    TALLY.add("secrets: bytes searched", sum(len(text) for _, text in everything))
    TALLY.add("secrets: leaks", len(leaks))
