"""The conformance suite on the subprocess runtime, under asyncio and trio."""

from runtimes.testing import RuntimeConformance


class TestSubprocessConformance(RuntimeConformance):
    config = {"type": "subprocess"}
    anyio_backends = ("asyncio", "trio")
