"""The conformance suite on the docker runtime, against the real engine.

Containers come from ``vf-sandbox/base:bookworm`` (the offline base image; see
``images/build-base.sh``). The checks marked ``shares_sandbox`` share one container per class
and event loop; the others (closing the runtime, sweeping its processes) each start their own
(``docs/conformance.md``). Each sandbox kind runs twice: through the persistent channel (the
default; the witness proves the channel carried every call) and through the plain exec /
archive path (``channel=False``).

Event loops: the root sandbox through the channel runs under trio, the ``nobody`` one under
asyncio. The two axes touch different sides: the user is what the sandbox-side agent and commands
run as, the event loop is what the host side runs in, and nothing in ``runtimes/docker`` depends
on the loop, so one class per loop covers both without running the root sandbox's 98 checks a
second time. The root class is the trio one because the user variants skip the streaming checks
(conftest.py): this is where the channel's hand-over of streamed output from its reader thread
runs under trio (SSH's and the Modal fake's channel classes run it under asyncio).
"""

import pytest

from runtimes.testing import RuntimeConformance

from .channel import ThroughTheChannel

pytestmark = pytest.mark.docker


class TestDockerConformance(ThroughTheChannel):
    config = {"type": "docker", "image": "vf-sandbox/base:bookworm"}
    anyio_backends = ("trio",)  # asyncio: TestDockerNonRootConformance (see the module doc)


class TestDockerNonRootConformance(ThroughTheChannel):
    """A sandbox whose user is not root: the agent runs as that user (and the plain path
    moves files through exec as that user), so the permission checks (skipped for root)
    apply too."""

    user_variant = True  # see tests/conformance/conftest.py

    config = {"type": "docker", "image": "vf-sandbox/base:bookworm", "user": "nobody"}
    anyio_backends = ("asyncio",)  # trio: TestDockerConformance (see the module doc)


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
