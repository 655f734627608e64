"""The conformance suite on the docker runtime, against the real engine.

Containers come from ``vf-sandbox/base:bookworm`` (the offline base image; see
``images/build-base.sh``). The checks marked ``shares_sandbox`` share one container per class
and event loop; the others (closing the runtime, sweeping its processes) each start their own
(``docs/conformance.md``). Each sandbox kind runs twice: through the persistent channel (the
default; the witness proves the channel carried every call) and through the plain exec /
archive path (``channel=False``).
"""

import pytest

from runtimes.testing import RuntimeConformance

from .channel import ThroughTheChannel

pytestmark = pytest.mark.docker


class TestDockerConformance(ThroughTheChannel):
    config = {"type": "docker", "image": "vf-sandbox/base:bookworm"}
    anyio_backends = ("asyncio", "trio")


class TestDockerNonRootConformance(ThroughTheChannel):
    """A sandbox whose user is not root: the agent runs as that user (and the plain path
    moves files through exec as that user), so the permission checks (skipped for root)
    apply too."""

    user_variant = True  # see tests/conformance/conftest.py

    config = {"type": "docker", "image": "vf-sandbox/base:bookworm", "user": "nobody"}
    anyio_backends = ("asyncio",)


class TestDockerConformanceNoChannel(RuntimeConformance):
    config = {"type": "docker", "image": "vf-sandbox/base:bookworm", "channel": False}
    anyio_backends = ("asyncio",)
    share_sandbox = True


class TestDockerNonRootConformanceNoChannel(RuntimeConformance):
    user_variant = True  # see tests/conformance/conftest.py
    config = {
        "type": "docker",
        "image": "vf-sandbox/base:bookworm",
        "user": "nobody",
        "channel": False,
    }
    anyio_backends = ("asyncio",)
    share_sandbox = True
