"""Malformed configs and broken plugins: a typed error naming what is wrong, never a
traceback, never the other plugins broken.

Every backend's config, the model table, judges files and recorded rollouts, through the
Python API and through the ``vf-sandbox`` command line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harnesses.errors import ModelConfigError
from harnesses.llm import ModelTable
from placement.errors import PlacementConfigError
from placement.rollout import load_rollout
from placement.specs import JudgeSpec, load_judges
from runtimes import open_runtime, resolve_runtime_config
from runtimes.config import RuntimeConfigError
from runtimes.registry import (
    RuntimePluginError,
    UnknownRuntimeError,
    available_runtimes,
    load_runtime_class,
)

from .conftest import REPO, TALLY

SSH_BASE = {"type": "ssh", "host": "h", "username": "u", "password": "pw-not-shown"}

# (config, the fields the error must name)
BAD_CONFIGS: list[tuple[dict[str, Any], list[str]]] = [
    ({"type": "subprocess", "root": 5}, ["root"]),
    ({"type": "subprocess", "inherit_env": "maybe"}, ["inherit_env"]),
    ({"type": "subprocess", "output_limit": 0, "read_limit": -1}, ["output_limit", "read_limit"]),
    ({"type": "subprocess", "bogus": 1}, ["bogus"]),
    ({"type": "subprocess", "env": {"K": 5}}, ["env.K"]),
    ({"type": "subprocess", "labels": ["not", "a", "dict"]}, ["labels"]),
    ({"type": "docker", "cpus": -1}, ["cpus"]),
    ({"type": "docker", "memory": "lots"}, ["memory"]),
    ({"type": "docker", "memory": 536870912}, ["memory", "512MiB"]),
    ({"type": "docker", "workdir": "relative/dir"}, ["workdir"]),
    ({"type": "docker", "base_url": "ftp://engine"}, ["base_url"]),
    ({"type": "docker", "max_live": 0, "api_timeout": 0}, ["max_live", "api_timeout"]),
    ({"type": "docker", "network": 5, "retries": -1}, ["network", "retries"]),
    ({"type": "docker", "channel": "sometimes"}, ["channel"]),
    ({"type": "ssh"}, ["host", "username"]),
    ({**SSH_BASE, "port": 70000}, ["port"]),
    ({**SSH_BASE, "password": None}, ["no authentication method"]),
    ({**SSH_BASE, "host_key": "not a key"}, ["host_key"]),
    ({**SSH_BASE, "connect_timeout": 0, "max_channels": 1}, ["connect_timeout", "max_channels"]),
    ({**SSH_BASE, "password": 12345}, ["password"]),
    ({**SSH_BASE, "disk": 512, "cpus": 1}, ["disk", "cpus", "cannot enforce"]),
    ({"type": "modal", "workdir": "rel"}, ["workdir"]),
    ({"type": "modal", "timeout": 1}, ["timeout"]),
    ({"type": "modal", "cidr_allowlist": ["not-a-cidr"]}, ["cidr_allowlist"]),
    ({"type": "modal", "memory": -5, "app_name": ""}, ["memory", "app_name"]),
    ({"type": "modal", "pids_limit": 64}, ["pids_limit", "cannot enforce"]),
]


@pytest.mark.parametrize(
    ("config", "fields"),
    BAD_CONFIGS,
    ids=[f"{c['type']}-{i}" for i, (c, _) in enumerate(BAD_CONFIGS)],
)
def test_malformed_runtime_config_names_the_field(
    config: dict[str, Any], fields: list[str]
) -> None:
    with pytest.raises(RuntimeConfigError) as info:
        resolve_runtime_config(config)
    message = str(info.value)
    for field in fields:
        assert field in message, f"{field!r} not named in: {message}"
    assert "pw-not-shown" not in message and "12345" not in message, "a secret was echoed"
    assert isinstance(info.value, ValueError)
    TALLY.add("bad input: malformed runtime configs")


@pytest.mark.parametrize(
    "config",
    [{"type": "nope"}, {}, {"type": ""}, {"type": 5}, ["type", "docker"], 42, "no-such-type"],
    ids=["unknown", "no-type", "empty-type", "int-type", "list", "int", "unknown-name"],
)
def test_malformed_config_shapes(config: Any) -> None:
    with pytest.raises(RuntimeConfigError):
        open_runtime(config)
    TALLY.add("bad input: malformed runtime configs")


def test_broken_plugin_breaks_nothing_else() -> None:
    assert "broken" in available_runtimes(), "the broken test plugin must be installed"
    with pytest.raises(RuntimePluginError) as info:
        open_runtime("broken")
    assert "vf-sandbox-broken" in str(info.value), "the error names the package"
    assert isinstance(info.value, ImportError)
    with pytest.raises(RuntimePluginError):
        load_runtime_class("broken")  # again: the same clear error, not a cached crash
    for name in ("subprocess", "docker", "ssh", "modal", "echo"):
        assert load_runtime_class(name).name in (name, "echo")
    with pytest.raises(UnknownRuntimeError):
        open_runtime("definitely-not-registered")
    with pytest.raises((PlacementConfigError, RuntimePluginError)) as spec_error:
        JudgeSpec.model_validate(
            {
                "name": "j",
                "prompt": "p",
                "verdict_schema": {"ok": "boolean"},
                "placement": {"type": "broken"},
            }
        )
    assert "vf-sandbox-broken" in str(spec_error.value)
    TALLY.add("bad input: broken plugin", 5)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "placement.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "needle", "code"),
    [
        (["exec", "--runtime", '{"type": "docker", "cpus": -1}', "--", "true"], "cpus", 2),
        (["exec", "--runtime", '{"type": "docker", "cpu"', "--", "true"], "not valid JSON", 2),
        (["exec", "--runtime", json.dumps({**SSH_BASE, "port": 0}), "--", "true"], "port", 2),
        # a plugin that cannot load is an error of the installation, not of the command line
        (["exec", "--runtime", "broken", "--", "true"], "vf-sandbox-broken", 1),
        # what a shell does: 127, once
        (["exec", "--runtime", "subprocess", "--", "/no/such/program"], "program not found", 127),
        (["exec", "--runtime", "subprocess", "--"], "argv", 2),
        (["cleanup", "--runtime", '{"type": "modal", "timeout": 1}'], "timeout", 2),
    ],
    ids=[
        "bad-field",
        "bad-json",
        "ssh-port",
        "broken-plugin",
        "missing-program",
        "no-argv",
        "cleanup",
    ],
)
def test_cli_reports_bad_input_without_a_traceback(args: list[str], needle: str, code: int) -> None:
    run = _cli(*args)
    assert run.returncode == code, (run.returncode, run.stdout, run.stderr)
    assert needle in run.stderr, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert "pw-not-shown" not in run.stdout + run.stderr
    TALLY.add("bad input: command lines")


def test_cli_listing_and_sweeping_survive_the_broken_plugin() -> None:
    listing = _cli("ls")
    assert listing.returncode == 0, listing.stderr
    assert "broken" in listing.stderr and "vf-sandbox-broken" in listing.stderr
    dry = _cli("cleanup", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "Traceback" not in listing.stderr + dry.stderr
    TALLY.add("bad input: command lines", 2)


# ---------------------------------------------------------------------- models, judges, rollouts


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("models: [1, 2]", "models"),
        ("models:\n  g: {base_url: 'ftp://x', model: m}", "base_url"),
        (
            "models:\n  g: {base_url: 'http://x', model: m, api_key_env: 'sk-live-abc'}",
            "api_key_env",
        ),
        ("models:\n  g: {base_url: 'http://x', model: m, max_retries: 99}", "max_retries"),
        ("models:\n  policy: {base_url: 'http://x', model: m}", "policy"),
        ("models: {g: {", "not valid"),
        ("\xff\xfe not text", "model table"),
    ],
    ids=["list", "base-url", "key-pasted", "retries", "policy", "syntax", "bytes"],
)
def test_malformed_model_table(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "models.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape") if "\xff" not in text else b"\xff\xfe")
    with pytest.raises(ModelConfigError) as info:
        ModelTable.from_file(path)
    assert needle in str(info.value), info.value
    assert "sk-live-abc" not in str(info.value), "a key pasted into api_key_env was echoed"
    TALLY.add("bad input: model tables")


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"[]", "non-empty list"),
        (b"- {name: j, prompt: p}", "verdict_schema"),
        (b"- {name: '../../etc', prompt: p, verdict_schema: {ok: boolean}}", "name"),
        (b"- {name: j, prompt: p, verdict_schema: {ok: floaty}}", "ok"),
        (b"- {name: j, prompt: p, verdict_schema: 'no.such.module:Model'}", "no.such.module"),
        (
            b"- {name: j, prompt: p, verdict_schema: {ok: boolean},"
            b" placement: {type: docker, cpus: -1}}",
            "cpus",
        ),
        (
            b"- {name: j, prompt: p, verdict_schema: {ok: boolean}}\n"
            b"- {name: j, prompt: q, verdict_schema: {ok: boolean}}",
            "unique",
        ),
        (b"\xff\xfe\x00garbage", "judges file"),
        (b"- [unclosed", "judges file"),
    ],
    ids=[
        "empty",
        "no-schema",
        "bad-name",
        "bad-type",
        "bad-import",
        "bad-placement",
        "dupe",
        "bytes",
        "syntax",
    ],
)
def test_malformed_judges_file(tmp_path: Path, content: bytes, needle: str) -> None:
    path = tmp_path / "judges.yaml"
    path.write_bytes(content)
    with pytest.raises(PlacementConfigError) as info:
        load_judges(path)
    assert needle in str(info.value), info.value
    TALLY.add("bad input: judges files")


@pytest.mark.parametrize(
    ("task", "trace"),
    [
        (b"not json", b"{}"),
        (b"[1, 2]", b"{}"),
        (b'{"id": "t"}', b'{"harness": 5}'),
        (b"\xff\xfe{}", b"{}"),
        (b"[" * 100_000, b"{}"),
        (b'{"id": "t"}', b"\xc3\x28"),
    ],
    ids=["not-json", "not-object", "bad-trace", "bytes", "nested", "trace-bytes"],
)
def test_malformed_rollout(tmp_path: Path, task: bytes, trace: bytes) -> None:
    (tmp_path / "task.json").write_bytes(task)
    (tmp_path / "trace.json").write_bytes(trace)
    with pytest.raises(PlacementConfigError):
        load_rollout(tmp_path)
    TALLY.add("bad input: rollout directories")
