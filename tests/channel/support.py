"""Helpers shared by the channel tests and the conformance modules.

:func:`channel_witness` records the channel state of every runtime closed while it is active,
so a conformance class that runs "with the channel" can prove the channel carried every call
(no silent fallback to the plain path would go unnoticed: the plain path passes the same
checks).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from runtimes.channel import ChannelInfo, ChannelSupervisor
from runtimes.channel.protocol import HALT_WAIT


@contextmanager
def channel_witness(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ChannelInfo]]:
    """Yield the list of :class:`ChannelInfo` of every runtime closed meanwhile, as it was
    when the runtime's use ended: at the ``HALT`` that kills the sandbox's processes (Docker's
    close: the agent is gone right after) or else at the channel's close."""
    seen: list[ChannelInfo] = []
    halted: set[int] = set()
    original_halt, original_close = ChannelSupervisor.halt, ChannelSupervisor.close

    async def halt(self: ChannelSupervisor, timeout: float = HALT_WAIT) -> bool:
        seen.append(self.info)
        halted.add(id(self))
        return await original_halt(self, timeout)

    async def close(self: ChannelSupervisor) -> None:
        if id(self) not in halted:
            seen.append(self.info)
        await original_close(self)

    monkeypatch.setattr(ChannelSupervisor, "halt", halt)
    monkeypatch.setattr(ChannelSupervisor, "close", close)
    yield seen


def assert_channel_carried_everything(seen: list[ChannelInfo]) -> None:
    """Every runtime closed had its channel running, never restarted, never fell back."""
    assert seen, "no runtime was closed while the witness watched"
    for info in seen:
        assert info.state == "running", info
        assert info.fallbacks == 0 and info.restarts == 0, info
