"""The conformance suite on a third-party backend found only through its entry point.

`vf-sandbox-echo` (tests/plugins/vf_sandbox_echo) is installed into the test
environment by `make test`; it is a `runtimes.Backend` of five methods that declares no
capability, so this also proves the runtime's generic plain path over `spawn` (every file
operation) and its sweep of what commands leave running.
"""

from runtimes import Backend, load_runtime_class
from runtimes.composed import BackendRuntime
from runtimes.testing import RuntimeConformance


class TestEchoPluginConformance(RuntimeConformance):
    config = {"type": "echo"}


def test_the_registry_composes_a_runtime_around_a_backend_plugin() -> None:
    cls = load_runtime_class("echo")
    assert issubclass(cls, BackendRuntime)
    assert issubclass(cls.backend_class, Backend)
    assert cls.backend_class.__name__ == "EchoBackend"
    assert (cls.name, cls.config_model) == ("echo", cls.backend_class.config_model)
    assert load_runtime_class("echo") is cls  # one runtime class per backend
