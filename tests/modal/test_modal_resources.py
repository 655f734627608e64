"""The common resource fields on Modal (``docs/resources.md``), through the fake service:
what ``Sandbox.create`` receives, read back through the SDK's own conversion to the
``Resources`` message the Modal server gets."""

from __future__ import annotations

import inspect
import types

import anyio
import pytest
from modal._resources import convert_fn_config_to_resources_config

from runtimes import RuntimeConfigError, open_runtime, resolve_runtime_config

from .fake_modal import FakeModalService
from .support import fake_config


def test_cpus_and_memory_are_hard_limits_in_modal_units(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    async def body() -> None:
        async with open_runtime(fake_config(cpus=0.5, memory="2GiB", gpu="T4")):
            pass

    anyio.run(body)
    call = fake_service.created[0]
    assert call.kwargs["cpu"] == (0.5, 0.5) and call.kwargs["memory"] == (2048, 2048)
    sent = convert_fn_config_to_resources_config(
        cpu=call.kwargs["cpu"], memory=call.kwargs["memory"], gpu=call.kwargs["gpu"]
    )
    assert (sent.milli_cpu, sent.milli_cpu_max) == (500, 500), "the request is also the limit"
    assert (sent.memory_mb, sent.memory_mb_max) == (2048, 2048), "MiB, request and limit"
    assert sent.gpu_config.gpu_type == "T4", "Modal's gpu passes through unchanged"


def test_no_limits_send_nothing(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    async def body() -> None:
        async with open_runtime(fake_config()):
            pass

    anyio.run(body)
    kwargs = fake_service.created[0].kwargs
    assert kwargs["cpu"] is None and kwargs["memory"] is None, "Modal's defaults apply"


@pytest.mark.parametrize(
    ("fields", "network", "block_network"),
    [
        ({}, "none", True),
        ({"network": "default"}, "default", False),
        ({"block_network": False}, "default", False),  # the old name still works
        ({"block_network": True}, "none", True),
    ],
)
def test_network_maps_to_block_network(
    fake_service: FakeModalService,
    fake_modal: types.ModuleType,
    fields: dict[str, object],
    network: str,
    block_network: bool,
) -> None:
    config = resolve_runtime_config(fake_config(**fields))
    assert config.network == network  # type: ignore[attr-defined]

    async def body() -> None:
        async with open_runtime(config):
            pass

    anyio.run(body)
    call = fake_service.created[0]
    assert call.kwargs["block_network"] is block_network
    assert call.network == ("BLOCKED" if block_network else "OPEN")


def test_the_old_cpu_name_still_works_and_pids_limit_is_refused() -> None:
    config = resolve_runtime_config(fake_config(cpu=2))
    assert config.cpus == 2
    with pytest.raises(RuntimeConfigError, match=r"pids_limit.*no per-sandbox process limit"):
        resolve_runtime_config(fake_config(pids_limit=64))


def test_a_sigkill_is_a_result_on_modal(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    """Modal's SDK does not say why a process died: 137 stays the command's exit code."""

    async def body() -> int:
        async with open_runtime(fake_config(memory=256)) as rt:
            return (await rt.exec(["sh", "-c", "kill -9 $$"])).exit_code

    assert anyio.run(body) == 137


def test_disk_is_refused_because_sandbox_create_takes_no_disk_size(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    """The installed SDK's ``Sandbox.create`` has no disk parameter (its definition sends
    ``ephemeral_disk=None``), and the fake binds the same signature: were ``disk`` mapped to
    anything, creation would fail with a ``TypeError`` instead of a config error up front."""
    import modal

    assert not {"ephemeral_disk", "disk"} & set(inspect.signature(modal.Sandbox.create).parameters)
    with pytest.raises(TypeError, match="unexpected keyword argument 'ephemeral_disk'"):
        fake_modal.Sandbox.create(app=None, ephemeral_disk=1024)
    with pytest.raises(RuntimeConfigError, match=r"disk.*Sandbox\.create takes no disk size"):
        resolve_runtime_config(fake_config(disk="1GiB"))
    assert fake_service.created == []
