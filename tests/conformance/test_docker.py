"""The conformance suite on the docker runtime, against the real engine, under asyncio and trio.

Every check starts its own container from ``vf-sandbox/base:bookworm`` (the offline base
image; see ``images/build-base.sh``) and removes it afterwards.
"""

import pytest

from runtimes.testing import RuntimeConformance

pytestmark = pytest.mark.docker


class TestDockerConformance(RuntimeConformance):
    config = {"type": "docker", "image": "vf-sandbox/base:bookworm"}
    anyio_backends = ("asyncio", "trio")


class TestDockerNonRootConformance(RuntimeConformance):
    """A sandbox whose user is not root: files go through exec as that user, so the
    permission checks (skipped for root) apply too."""

    config = {"type": "docker", "image": "vf-sandbox/base:bookworm", "user": "nobody"}
    anyio_backends = ("asyncio",)
