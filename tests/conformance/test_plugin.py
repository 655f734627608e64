"""The conformance suite on a third-party backend found only through its entry point.

`vf-sandbox-echo` (tests/plugins/vf_sandbox_echo) is installed into the test
environment by `make test`; it implements only the abstract primitives and moves files
through exec, so this also proves the base class's exec-based defaults.
"""

from runtimes.testing import RuntimeConformance


class TestEchoPluginConformance(RuntimeConformance):
    config = {"type": "echo"}
