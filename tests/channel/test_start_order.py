"""An agent that says "ready" before the host sends its source still gets the source first.

A restarted agent's interpreter can be up (and have written ``ready``) before the host's
``start()`` runs: the host's reply to ``ready`` (the per-start key) must never overtake the
agent's source on the stream, or the bootstrap reads key bytes as the source's length.
"""

from __future__ import annotations

import os
import select
import subprocess

import pytest

from runtimes.channel import Channel, ChannelTransport, agent_command

pytestmark = pytest.mark.anyio


class PipeTransport(ChannelTransport):
    """The agent as a local child process, over its stdin/stdout pipes."""

    def __init__(self, argv: list[str]) -> None:
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert self.process.stdin and self.process.stdout
        self._stdin = self.process.stdin.fileno()
        self._stdout = self.process.stdout.fileno()

    def recv(self) -> bytes:
        """From the channel's reader thread only; it closes stdout once the stream ended."""
        try:
            data = os.read(self._stdout, 1 << 16)
        except OSError:
            data = b""
        if not data and self.process.stdout is not None:
            self.process.stdout.close()
        return data

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._stdin, view) :]

    def close(self) -> None:
        """Kill the agent: its stdout ends, which unblocks the reader. stdout itself is
        closed by the reader (:meth:`recv`), never here: closing it under a reader about to
        call ``os.read`` would let that read take the bytes of whatever descriptor reuses
        the number next (this test's next agent's ``ready``: seen under load)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.process.stdin, self.process.stderr):
            if stream is not None:
                stream.close()

    def diagnostics(self) -> str:
        return ""


def started_and_ready() -> PipeTransport:
    """An agent whose ``ready`` already waits, unread, in the pipe."""
    transport = PipeTransport(agent_command())
    readable, _, _ = select.select([transport.process.stdout.fileno()], [], [], 60)
    assert readable, "the agent never said ready"
    return transport


async def test_a_ready_agent_receives_its_source_before_the_key() -> None:
    for attempt in range(5):
        channel = Channel(started_and_ready(), f"local agent {attempt}")
        try:
            await channel.start(timeout=10)
            assert channel.hello, f"attempt {attempt}: the agent ended before it started"
        finally:
            channel.close()
