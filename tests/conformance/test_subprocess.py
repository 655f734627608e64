"""The conformance suite on the subprocess runtime, under asyncio and trio.

The checks marked ``shares_sandbox`` run in one sandbox per event loop, each verified to leave
nothing a later check could see (``verify_sharing``): this class proves the kit's marks on
every run, for every backend's shared runs (tests/conformance/test_kit.py has the rest).
"""

from runtimes.testing import RuntimeConformance


class TestSubprocessConformance(RuntimeConformance):
    config = {"type": "subprocess"}
    anyio_backends = ("asyncio", "trio")
    share_sandbox = True
    verify_sharing = True
