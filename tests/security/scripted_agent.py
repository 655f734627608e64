"""A channel agent played by a test (attack class 21, ``test_fuzz_channel.py``): it holds the
per-start key the host sends, so it can send correctly tagged frames with any content, and a
supervisor that makes one public call against it, recording what failed untyped."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

from runtimes.channel import bootstrap
from runtimes.channel.agent import wire
from runtimes.channel.protocol import ChannelTransport
from runtimes.channel.relay import RelayListener
from runtimes.channel.supervisor import ChannelHooks, ChannelSupervisor
from runtimes.models import ExecRequest, OutputSink

from .fuzzing import cut

HEADER = wire.HEADER


def tagged(key: bytes, seq: int, kind: int, rid: int, payload: bytes) -> bytes:
    """One frame as the agent writes it: header, payload, tag."""
    header = HEADER.pack(kind, rid, len(payload))
    return header + payload + wire.mac(key, seq, header, payload)


class NoTransport(ChannelTransport):
    """For a stream that is never started: its parser is driven by the test."""

    def recv(self) -> bytes:
        return b""

    def send(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class ScriptedAgent(ChannelTransport):
    """The agent's end of the stream, played by the test: it says ``ready``, reads the source
    and the key the host sends, greets with a ``HELLO`` tagged with that key, waits for the
    host's request, answers with ``answer(key, rid)`` cut at ``sizes``, then ends the stream."""

    def __init__(
        self,
        answer: Callable[[bytes, int], bytes],
        sizes: list[int],
        greeting: bytes = bootstrap.READY,
        hello: bytes | None = None,
    ) -> None:
        self.answer = answer
        self.sizes = sizes
        self.greeting = greeting
        self.hello = hello
        self.cond = threading.Condition()
        self.received = bytearray()
        self.closed = False
        self.pending: list[bytes] = []
        self.phase = "greeting"
        self.answered = 0
        """Bytes of the answer sent (for the allocation bound)."""

    def send(self, data: bytes) -> None:
        with self.cond:
            self.received += data
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def _wait_for(self, size: int) -> bool:
        """Until the host sent ``size`` bytes (False: closed, or 10 s passed)."""
        with self.cond:
            return self.cond.wait_for(lambda: self.closed or len(self.received) >= size, 10) and (
                not self.closed
            )

    def recv(self) -> bytes:
        if self.pending:
            return self.pending.pop(0)
        if self.phase == "greeting":
            self.phase = "hello"
            self.pending = cut(self.greeting, self.sizes)
            return self.pending.pop(0) if self.pending else b""
        source = len(bootstrap.agent_source())
        if self.phase == "hello":
            self.phase = "request"
            if not self.greeting.startswith(bootstrap.READY):
                return b""  # the host sends no key to an agent that did not say ready
            if not self._wait_for(source + wire.KEY + 1):
                return b""
            self.key = bytes(self.received[source : source + wire.KEY])
            hello = self.hello
            if hello is None:
                hello = wire.Hello(
                    wire.VERSION, 7, 7, 0, 0, wire.NON_DUMPABLE, "3.11", "/p"
                ).to_wire()
            self.pending = cut(tagged(self.key, 0, wire.HELLO, 0, hello), self.sizes)
            return self.pending.pop(0)
        if self.phase == "request":
            self.phase = "end"
            start = source + wire.KEY + 1
            if not self._wait_for(start + HEADER.size):
                return b""
            _, rid, _ = HEADER.unpack_from(self.received, start)
            answer = self.answer(self.key, rid)
            self.answered = len(answer)
            self.pending = cut(answer, self.sizes)
            if self.pending:
                return self.pending.pop(0)
        return b""


@dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    state: str = ""
    """The channel's state after the call (``ChannelInfo.state``)."""


class Watch(logging.Handler):
    """Records the reader thread's unexpected failures (it ends the channel on any exception:
    a parser's crash would pass for a lost stream, restartable, instead of a tampered one)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.failures: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "reading from the agent failed" in message:
            self.failures.append(message)


async def plain_result() -> Any:
    return "plain"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


REQUESTS = [
    "exec",
    "read",
    "write",
    "exists",
    "remove",
    "halt",
    "sweep",
    "listen",
    "lstat",
    "mkdir",
]


async def _call(sup: ChannelSupervisor, what: str) -> Any:
    """One public call through the supervisor (as a runtime makes it)."""
    if what == "exec":
        request = ExecRequest(("prog",), "/", {}, b"in", None, None, 1 << 20)
        sink = OutputSink(limit=1 << 20)
        code = await sup.exec(request, sink, plain_result)
        return code, bytes(sink.stdout), bytes(sink.stderr)
    if what == "read":
        return await sup.read("/f", 4096, plain_result)
    if what == "write":
        return await sup.write("/f", b"content", plain_result)
    if what == "exists":
        return await sup.exists("/f", plain_result)
    if what == "remove":
        return await sup.remove("/f", plain_result)
    if what == "lstat":
        return await sup.lstat("/f", 64, plain_result)
    if what == "mkdir":
        return await sup.mkdir("/d", 0o700, 0, 0, plain_result)
    if what == "halt":
        return await sup.halt(timeout=5)
    if what == "sweep":
        header = wire.SweepHeader("all", "")
        return await sup.file_call(
            lambda c: c.sweep(header), plain_result, "a sweep", idempotent=True
        )
    listener: RelayListener = await sup.listen(("127.0.0.1", _free_port()))
    await listener.aclose()
    return listener.sandbox_port


def converse(what: str, agent: ScriptedAgent) -> tuple[Outcome, list[str]]:
    """Start a supervisor on ``agent``, make one ``what`` call, close; the call's outcome and
    whatever failed untyped (on the event loop, in the reader thread)."""
    untyped: list[str] = []
    watch = Watch()
    logger = logging.getLogger("runtimes.channel")
    logger.addHandler(watch)
    level = logger.level
    logger.setLevel(logging.DEBUG)

    async def open_transport(interpreter: str | None) -> ChannelTransport:
        return agent

    async def nothing(*args: Any) -> None:
        return None

    async def not_dead() -> bool:
        return False

    async def main() -> Outcome:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: untyped.append(str(context)))
        hooks = ChannelHooks(open_transport, nothing, not_dead)
        sup = ChannelSupervisor(True, lambda: "fuzz", hooks, start_timeout=10, kill_wait=0.2)
        outcome = Outcome()
        with anyio.fail_after(20):  # a hang is a failure
            await sup.start()
            try:
                outcome.value = await _call(sup, what)
            except Exception as exc:  # noqa: BLE001 - classified below
                outcome.error = exc
            finally:
                outcome.state = sup.info.state
                await sup.close()
            await anyio.lowlevel.checkpoint()  # let the callbacks the reader queued run
        return outcome

    try:
        outcome = anyio.run(main)
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)
    return outcome, untyped + watch.failures
