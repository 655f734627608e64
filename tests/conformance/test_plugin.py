"""The conformance suite on a third-party backend found only through its entry point.

`vf-sandbox-echo` (tests/plugins/vf_sandbox_echo) is installed into the test
environment by `make test`; it is a `runtimes.Backend` of five methods that declares no
capability, so this also proves the runtime's generic plain path over `spawn` (every file
operation) and its sweep of what commands leave running. The checks marked ``shares_sandbox``
share one sandbox per class, each verified to leave nothing behind (``docs/conformance.md``).
"""

import pytest

from runtimes import Backend, load_runtime_class
from runtimes.composed import BackendRuntime
from runtimes.testing import RuntimeConformance


class TestEchoPluginConformance(RuntimeConformance):
    config = {"type": "echo"}
    share_sandbox = True


def test_the_registry_composes_a_runtime_around_a_backend_plugin() -> None:
    cls = load_runtime_class("echo")
    assert issubclass(cls, BackendRuntime)
    assert issubclass(cls.backend_class, Backend)
    assert cls.backend_class.__name__ == "EchoBackend"
    assert (cls.name, cls.config_model) == ("echo", cls.backend_class.config_model)
    assert load_runtime_class("echo") is cls  # one runtime class per backend


class TestEchoPluginChannelConformance(RuntimeConformance):
    """The same plugin with the channel on: the runtime runs the agent over the backend's
    `StreamSpawner` stream, with kills through `spawn` and `alive` as the death probe."""

    config = {"type": "echo", "channel": True}
    share_sandbox = True


@pytest.mark.anyio
async def test_the_channel_serves_a_stream_spawner_backend() -> None:
    from runtimes import open_runtime

    async with open_runtime({"type": "echo", "channel": True}) as rt:
        assert (await rt.exec(["echo", "hi"])).stdout == "hi\n"
        await rt.write("f", b"data")
        assert await rt.read("f") == b"data"
        info = rt.channel_info
        assert info.state == "running" and info.served >= 3 and info.fallbacks == 0, info
    async with open_runtime("echo") as rt:
        await rt.exec(["true"])
        assert rt.channel_info.state == "disabled"
