"""The harness registry: entry points, config narrowing by id, broken plugins.

Third-party plugins are real distributions: a ``*.dist-info`` directory with an
``entry_points.txt`` on ``sys.path``, which ``importlib.metadata`` finds like any
installed package.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harnesses.bash import BashConfig, BashHarness
from harnesses.errors import HarnessConfigError, HarnessPluginError, UnknownHarnessError
from harnesses.null import NullConfig, NullHarness
from harnesses.registry import (
    HARNESSES,
    available_harnesses,
    load_harness_class,
    open_harness,
    resolve_harness_config,
)

PLUGIN_MODULE = """
from typing import Literal
from harnesses.base import Harness, HarnessConfig, Trace

class EchoConfig(HarnessConfig):
    id: Literal["echo-harness"] = "echo-harness"
    prefix: str = ">"

class EchoHarness(Harness):
    id = "echo-harness"
    config_model = EchoConfig
    needs_runtime = False

    async def run(self, task, *, runtime, model, budget=None):
        return self.new_trace(model).finish(f"{self.config.prefix} {task}")

class NotAHarness:
    pass
"""


def _dist_info(root: Path, name: str, entry_points: str) -> None:
    info = root / f"{name.replace('-', '_')}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[vf_sandbox.harnesses]\n{entry_points}\n")


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    (tmp_path / "vf_echo_harness.py").write_text(PLUGIN_MODULE)
    (tmp_path / "vf_broken_harness.py").write_text(
        "raise RuntimeError('simulated import failure')\n"
    )
    _dist_info(tmp_path, "vf-echo-harness", "echo-harness = vf_echo_harness:EchoHarness")
    _dist_info(
        tmp_path,
        "vf-broken-harness",
        "broken-harness = vf_broken_harness:Anything\nnot-a-harness = vf_echo_harness:NotAHarness",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    HARNESSES.clear_cache()
    yield
    HARNESSES.clear_cache()


def test_builtins_are_registered_through_entry_points() -> None:
    """Passes once pyproject.toml declares the built-ins (group ``vf_sandbox.harnesses``)."""
    found = available_harnesses()
    assert found["null"].value == "harnesses.null:NullHarness"
    assert found["bash"].value == "harnesses.bash:BashHarness"
    assert found["mini-swe-agent"].value == "harnesses.mini_swe_agent:MiniSweAgentHarness"
    assert found["null"].distribution == "vf-sandbox"
    assert isinstance(open_harness({"id": "bash", "per_call_timeout": 5}), BashHarness)
    assert isinstance(open_harness("null"), NullHarness)


def test_third_party_plugin_is_found_and_narrowed(plugins: None) -> None:
    found = available_harnesses()
    assert found["echo-harness"].distribution == "vf-echo-harness"
    config = resolve_harness_config({"id": "echo-harness", "prefix": "#"})
    assert type(config).__name__ == "EchoConfig"
    assert config.prefix == "#"  # type: ignore[attr-defined]
    harness = open_harness(config)
    assert type(harness).__name__ == "EchoHarness"
    assert resolve_harness_config("echo-harness").prefix == ">"  # type: ignore[attr-defined]


def test_invalid_config_names_the_fields(plugins: None) -> None:
    with pytest.raises(HarnessConfigError) as info:
        resolve_harness_config({"id": "echo-harness", "prefix": 3, "bogus": True})
    message = str(info.value)
    assert "prefix" in message and "bogus" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(HarnessConfigError, match="no 'id'"):
        resolve_harness_config({"prefix": "x"})
    with pytest.raises(HarnessConfigError):
        resolve_harness_config(42)  # type: ignore[arg-type]


def test_unknown_id_lists_what_is_registered(plugins: None) -> None:
    with pytest.raises(UnknownHarnessError, match=r"registered: .*echo-harness"):
        resolve_harness_config("no-such-harness")


def test_broken_plugin_is_named_and_breaks_nothing_else(plugins: None) -> None:
    assert "broken-harness" in available_harnesses()  # listing imports nothing
    with pytest.raises(HarnessPluginError) as info:
        open_harness("broken-harness")
    assert "vf-broken-harness" in str(info.value)
    assert "simulated import failure" in str(info.value)
    assert isinstance(info.value, ImportError)
    with pytest.raises(HarnessPluginError, match=r"not a harnesses\.Harness subclass"):
        load_harness_class("not-a-harness")
    assert type(open_harness("echo-harness")).__name__ == "EchoHarness"


def test_harness_refuses_a_foreign_config() -> None:
    with pytest.raises(HarnessConfigError, match="needs a BashConfig"):
        BashHarness(NullConfig())
    assert NullHarness().config == NullConfig()
    assert BashHarness(BashConfig(per_call_timeout=3)).config.per_call_timeout == 3
