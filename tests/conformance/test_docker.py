"""The conformance suite on the docker runtime, against the real engine.

Every check starts its own container from ``vf-sandbox/base:bookworm`` (the offline base
image; see ``images/build-base.sh``) and removes it afterwards. Each sandbox kind runs twice:
through the persistent channel (the default; the witness proves the channel carried every
call) and through the plain exec / archive path (``channel=False``).
"""

from collections.abc import Iterator

import pytest

from runtimes.testing import RuntimeConformance
from tests.channel.support import assert_channel_carried_everything, channel_witness

pytestmark = pytest.mark.docker


class _ThroughTheChannel(RuntimeConformance):
    @pytest.fixture(autouse=True)
    def _channel_carries_every_call(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        with channel_witness(monkeypatch) as seen:
            yield
        assert_channel_carried_everything(seen)


class TestDockerConformance(_ThroughTheChannel):
    config = {"type": "docker", "image": "vf-sandbox/base:bookworm"}
    anyio_backends = ("asyncio", "trio")


class TestDockerNonRootConformance(_ThroughTheChannel):
    """A sandbox whose user is not root: the agent runs as that user (and the plain path
    moves files through exec as that user), so the permission checks (skipped for root)
    apply too."""

    user_variant = True  # see tests/conformance/conftest.py

    config = {"type": "docker", "image": "vf-sandbox/base:bookworm", "user": "nobody"}
    anyio_backends = ("asyncio",)


class TestDockerConformanceNoChannel(RuntimeConformance):
    config = {"type": "docker", "image": "vf-sandbox/base:bookworm", "channel": False}
    anyio_backends = ("asyncio",)


class TestDockerNonRootConformanceNoChannel(RuntimeConformance):
    user_variant = True  # see tests/conformance/conftest.py
    config = {
        "type": "docker",
        "image": "vf-sandbox/base:bookworm",
        "user": "nobody",
        "channel": False,
    }
    anyio_backends = ("asyncio",)
