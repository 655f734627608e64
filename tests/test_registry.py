"""Configs and the plugin registry: resolution, validation errors, broken plugins."""

import pathlib
import warnings
from importlib.metadata import EntryPoint

import anyio
import pytest

from runtimes import (
    RuntimeConfigError,
    RuntimePluginError,
    SubprocessConfig,
    UnknownRuntimeError,
    available_runtimes,
    open_runtime,
    plugins,
    resolve_runtime_config,
    runtime_is_local,
)
from runtimes.base import Runtime
from runtimes.models import ExecRequest, OutputSink
from runtimes.registry import ENTRY_POINT_GROUP, RUNTIMES, load_runtime_class
from runtimes.subprocess import SubprocessRuntime


def test_resolve_accepts_model_dict_and_type_name() -> None:
    model = SubprocessConfig(env={"A": "1"})
    assert resolve_runtime_config(model) is model
    from_dict = resolve_runtime_config({"type": "subprocess", "env": {"A": "1"}})
    assert from_dict == model
    assert resolve_runtime_config("subprocess") == SubprocessConfig()


def test_builtins_are_registered_through_entry_points() -> None:
    found = available_runtimes()
    assert found["subprocess"].value == "runtimes.subprocess:SubprocessRuntime"
    assert found["subprocess"].distribution == "vf-sandbox"
    assert found["echo"].distribution == "vf-sandbox-echo"


def test_malformed_config_names_the_field() -> None:
    with pytest.raises(RuntimeConfigError) as info:
        resolve_runtime_config({"type": "subprocess", "output_limit": "lots", "bogus": 1})
    message = str(info.value)
    assert "output_limit" in message and "bogus" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(RuntimeConfigError, match="no 'type'"):
        resolve_runtime_config({"image": "x"})
    with pytest.raises(RuntimeConfigError):
        resolve_runtime_config(42)  # type: ignore[arg-type]


def test_unknown_type_lists_what_is_registered() -> None:
    with pytest.raises(UnknownRuntimeError, match=r"registered: .*subprocess"):
        resolve_runtime_config("no-such-backend")


def test_broken_plugin_is_named_and_breaks_nothing_else() -> None:
    assert "broken" in available_runtimes()  # listing imports nothing
    with pytest.raises(RuntimePluginError) as info:
        open_runtime({"type": "broken"})
    assert "vf-sandbox-broken" in str(info.value)
    assert "simulated import failure" in str(info.value)
    assert isinstance(info.value, ImportError)
    # every other backend still resolves and runs
    assert resolve_runtime_config("echo").type == "echo"

    async def body() -> None:
        async with open_runtime("subprocess") as rt:
            assert (await rt.exec(["echo", "ok"])).stdout == "ok\n"

    anyio.run(body)


def test_runtime_is_local() -> None:
    assert runtime_is_local("subprocess") is True
    assert runtime_is_local({"type": "echo"}) is False


def test_open_runtime_returns_unstarted_runtime() -> None:
    rt = open_runtime("subprocess")
    assert isinstance(rt, SubprocessRuntime)
    assert not rt.closed


def test_a_plugin_that_is_neither_a_runtime_nor_a_backend_is_refused_by_name(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry point naming some other class: a typed error naming the distribution and
    both classes a runtime plugin may be, not a runtime that fails later."""
    import importlib

    from runtimes.registry import RUNTIMES, load_runtime_class

    dist = tmp_path / "vf_sandbox_stray-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vf-sandbox-stray\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[vf_sandbox.runtimes]\nstray = json:JSONDecoder\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    RUNTIMES.clear_cache()
    with pytest.raises(
        RuntimePluginError,
        match=r"'vf-sandbox-stray'.* is not a runtimes\.Runtime or "
        r"runtimes\.Backend subclass",
    ):
        load_runtime_class("stray")


class OldStyleRuntime(Runtime):
    """A plugin on the older seam: a Runtime subclass filling in the private hooks."""

    name = "oldstyle"

    async def _start(self) -> str:
        return "/"

    async def _close(self) -> None:
        return None

    async def _alive(self) -> bool:
        return True

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        return 0


def test_a_runtime_subclass_plugin_still_loads_with_a_deprecation_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ours = EntryPoint("oldstyle", f"{__name__}:OldStyleRuntime", ENTRY_POINT_GROUP)
    real = plugins.entry_points

    def with_ours(*, group: str) -> list[EntryPoint]:
        return [*real(group=group), ours] if group == ENTRY_POINT_GROUP else list(real(group=group))

    monkeypatch.setattr(plugins, "entry_points", with_ours)
    RUNTIMES.clear_cache()
    try:
        with pytest.warns(DeprecationWarning, match="make it a runtimes.Backend"):
            assert load_runtime_class("oldstyle") is OldStyleRuntime
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the built-in backends are Backends: no warning
            load_runtime_class("subprocess")
            load_runtime_class("echo")
    finally:
        RUNTIMES.clear_cache()
