"""Attack class 7 against incremental stdin (``exec(stdin=<async iterable>)``): a hostile
channel agent (the real one with its stdin handling replaced) either never acknowledges what
the host sends, hoping the host reads the caller's iterable ahead into memory, or stops
reading its stream and acknowledges blindly, hoping the host piles the iterable up in its
outbox."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

import runtimes.channel.bootstrap as bootstrap
import runtimes.channel.core as core
from runtimes import ExecTimeoutError, open_runtime
from runtimes.channel.protocol import CHUNK, WINDOW
from runtimes.errors import ChannelTamperedError
from runtimes.models import KiB, MiB

from .conftest import Hostile

pytestmark = pytest.mark.anyio

_PUMPS = {
    # Takes every DATA frame and neither writes it nor acknowledges it.
    "no-ack": """
def _vf_pump_stdin(self, pipe):
    while self.stdin.get() is not None:
        pass
""",
}

_BLIND_ACK = """
def _vf_blind_acks(self):
    while not self.agent.out.broken:
        self.agent.out.send(ACK, self.rid, U32.pack(64 * 1024))
        time.sleep(0.0005)


def _vf_feed(self, data):
    # The first DATA: acknowledge blindly from now on, and stop reading the stream.
    threading.Thread(target=_vf_blind_acks, args=(self,), daemon=True).start()
    time.sleep(3600)


Exec.feed = _vf_feed
"""


def _hostile_source(mode: str) -> bytes:
    real = bootstrap.agent_source()[10:].decode()
    anchor = 'if __name__ in ("__main__", "__vf_sandbox_agent__"):'
    assert anchor in real
    if mode == "blind-ack":
        patch = _BLIND_ACK + "\n\n"
    else:
        patch = _PUMPS[mode] + "\nExec.pump_stdin = _vf_pump_stdin\n\n\n"
    source = real.replace(anchor, patch + anchor).encode()
    return b"%010d" % len(source) + source


def _endless(pulled: list[int]) -> AsyncIterator[bytes]:
    async def chunks() -> AsyncIterator[bytes]:
        while True:
            pulled[0] += 64 * KiB
            yield bytes(64 * KiB)

    return chunks()


@pytest.mark.attack(7)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
async def test_an_agent_that_never_acknowledges_stdin_cannot_make_the_host_read_ahead(
    hostile: Hostile, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _hostile_source("no-ack")
    monkeypatch.setattr(bootstrap, "agent_source", lambda: source)
    pulled = [0]
    async with open_runtime(hostile.config) as rt:
        with pytest.raises(ExecTimeoutError):
            await rt.exec(["cat"], stdin=_endless(pulled), timeout=2)
        # Control: the host did send a full window (the double really swallowed it) ...
        assert pulled[0] >= WINDOW, pulled
        # ... and not a chunk more than the window and the chunks being cut and sent.
        assert pulled[0] <= WINDOW + CHUNK + 64 * KiB, pulled
        assert (await rt.exec(["echo", "after"])).stdout == "after\n"
        assert rt.channel_info.state == "running", rt.channel_info


@pytest.mark.attack(7)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
async def test_an_agent_acknowledging_blindly_cannot_pile_stdin_up_on_the_host(
    hostile: Hostile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the outbox bound the host pulls ~200 MiB a second here (measured)."""
    source = _hostile_source("blind-ack")
    monkeypatch.setattr(bootstrap, "agent_source", lambda: source)
    acked = [0]
    real_acked = core.Channel._acked

    def counting(self: core.Channel, in_flight: int, payload: bytes) -> int:
        acked[0] += int.from_bytes(payload, "big")
        return real_acked(self, in_flight, payload)

    monkeypatch.setattr(core.Channel, "_acked", counting)
    pulled = [0]
    async with open_runtime(hostile.config) as rt:
        # Acknowledgements for more than the host sent (it stopped feeding a full outbox)
        # are tampering; else the timeout ends the call.
        with pytest.raises((ChannelTamperedError, ExecTimeoutError)):
            await rt.exec(["cat"], stdin=_endless(pulled), timeout=3)
        # Control: the double did acknowledge blindly, more than its stream took ...
        assert acked[0] >= MiB, acked
        # ... yet the iterable was not drained into host memory.
        assert pulled[0] < 64 * MiB, pulled
        assert (await rt.exec(["echo", "after"])).stdout == "after\n"
