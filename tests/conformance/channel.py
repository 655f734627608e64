"""The channel witness for conformance classes that run through the persistent channel."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtimes.testing import RuntimeConformance
from tests.channel.support import assert_channel_carried_everything, channel_witness


class ThroughTheChannel(RuntimeConformance):
    """Every runtime the class closed had its channel running, never restarted, never fell
    back. The witness watches the whole class: its shared sandboxes close at the class's end
    (this autouse fixture is set up before them, so it is torn down after them)."""

    share_sandbox = True

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _channel_carries_every_call(cls) -> Iterator[None]:
        with pytest.MonkeyPatch.context() as monkeypatch, channel_witness(monkeypatch) as seen:
            yield
        assert_channel_carried_everything(seen)
