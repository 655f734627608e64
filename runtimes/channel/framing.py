"""The channel's frame stream: one transport to one agent, authenticated frame by frame, read
and written by two threads of its own, each frame handed to its request on the event loop."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import queue
import secrets
import struct
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from . import bootstrap
from .agent import wire
from .agent.wire import HEADER, SEQ, TAG, Hello
from .bootstrap import NO_PYTHON, READY
from .protocol import (
    CHUNK,
    KILL_WAIT,
    MAX_BACKLOG,
    MAX_FRAME,
    START_TIMEOUT,
    ChannelLost,
    ChannelTransport,
    ChannelUnsupported,
)
from .relay import Relay

log = logging.getLogger("runtimes.channel")

DATA_KINDS = frozenset((wire.STDOUT, wire.STDERR, wire.CHUNK))
"""Frames whose payload counts against a request's budget."""
LOST = -1
"""Pseudo frame type delivered to every open request when the stream ends."""


def loop_handle() -> tuple[object, Callable[[Callable[[], None]], object]]:
    """The running event loop and a thread-safe "call this soon on it"."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio

        token = trio.lowlevel.current_trio_token()
        return token, token.run_sync_soon
    return loop, loop.call_soon_threadsafe


def current_loop() -> object | None:
    """The running event loop (asyncio's loop or trio's token), ``None`` outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:
        import trio

        return trio.lowlevel.current_trio_token()
    except (ImportError, RuntimeError):
        return None


Frame = tuple[int, bytes]


@dataclass
class PendingRequest:
    """A request in flight: its id and the frames the reader thread handed it."""

    rid: int
    inbox: MemoryObjectSendStream[Frame]
    frames: MemoryObjectReceiveStream[Frame]
    budget: int | None = None
    """The most output / content bytes the real agent may send for this request."""
    received: int = 0


class FramedStream:
    """The authenticated frame stream to one agent: the transport's reader and writer
    threads, the key, every frame's tag, and each frame handed to the request it answers on
    the event loop that started it. :class:`~runtimes.channel.core.Channel` adds the
    requests."""

    def __init__(
        self,
        transport: ChannelTransport,
        label: str,
        *,
        probe_dead: Callable[[], Awaitable[bool]] | None = None,
        kill_group: Callable[[int], Awaitable[None]] | None = None,
        stall_timeout: float | None = None,
        kill_wait: float = KILL_WAIT,
        want_digests: bool = False,
    ) -> None:
        self.label = label
        self._key = secrets.token_bytes(wire.KEY)
        """Authenticates every frame, both directions; sent once, over the stream itself,
        after the bootstrap made the agent non-dumpable. Never in argv, env or a file."""
        self._want_digests = want_digests
        self._seq_out = 0
        self._seq_in = 0
        self.tampered: str | None = None
        """Why the stream is not trusted any more (a forged frame...): set once, never reset."""
        self.refused: str | None = None
        """Why the agent that answered may not serve (it could not protect itself)."""
        self.digests: dict[str, bytes] | None = None
        self._digests_ready: anyio.Event | None = None
        self._flow = threading.Condition()
        self._backlog = 0
        self._stall_timeout = stall_timeout
        self._kill_wait = kill_wait
        self.hello: Hello | None = None
        self._transport = transport
        self._probe_dead = probe_dead
        self._kill_group = kill_group
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._queued = 0
        """Frames handed to the writer thread and not yet written: while there are any,
        nothing may be written directly (it would overtake them)."""
        self._requests: dict[int, PendingRequest] = {}
        self._last_id = 0
        self._broken = threading.Event()
        self._closed = threading.Event()
        self._lost = False
        self._ready: anyio.Event | None = None
        self._unsupported = False
        self._loop: object | None = None
        self._call_soon: Callable[[Callable[[], None]], object] | None = None
        self._seq_lock = threading.Lock()
        """Frames are sent from the event loop and from relay threads: a frame's sequence
        number and its place in the stream must agree."""
        self.relay = Relay(self)
        """The host side of the relays (:mod:`.relay`), which sends and finishes through
        this stream's :meth:`relay_send`, :meth:`send_frame` and :meth:`finish`."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self, timeout: float = START_TIMEOUT) -> None:
        """Send the agent's source, start the threads, wait for the agent's hello.

        Raises:
            ChannelUnsupported: the sandbox has no usable python3.
            ChannelLost: the stream ended before the agent said hello.
            TimeoutError: no hello within ``timeout``.
        """
        self._loop, self._call_soon = loop_handle()
        self._ready = anyio.Event()
        self._digests_ready = anyio.Event()
        # The source goes first: the reader answers the agent's "ready" with the key, which
        # must not overtake it (a restarted agent can say "ready" before we get here).
        self._emit(bootstrap.agent_source())
        for name, target in (("reader", self._read_loop), ("writer", self._write_loop)):
            threading.Thread(target=target, name=f"vf-channel-{name}", daemon=True).start()
        with anyio.fail_after(timeout):
            await self._ready.wait()
        if self._unsupported:
            raise ChannelUnsupported(f"{self.label}: no python3 >= 3.8 in the sandbox")
        if self.hello is None:
            said = self._transport.diagnostics()
            raise ChannelLost(f"{self.label}: the agent ended before it started: {said or '-'}")
        if self.refused is not None:
            raise ChannelUnsupported(f"{self.label}: {self.refused}")

    async def wait_digests(self, timeout: float) -> dict[str, bytes] | None:
        """The digests of the files the agent runs from (asked for at its start), once it
        reported them; ``None`` if it did not within ``timeout`` or the channel died."""
        if not self._want_digests or self._digests_ready is None:
            return None
        with anyio.move_on_after(timeout):
            await self._digests_ready.wait()
        return self.digests

    @property
    def usable(self) -> bool:
        """Alive, and called from the event loop it belongs to."""
        return (
            self.tampered is None
            and not self._lost
            and not self._broken.is_set()
            and not self._closed.is_set()
            and self._loop is not None
            and current_loop() is self._loop
        )

    @property
    def running(self) -> bool:
        """The agent said hello and its stream has not ended (whatever the event loop)."""
        return self.hello is not None and not self._lost and not self._broken.is_set()

    def diagnostics(self) -> str:
        """What the agent said on stderr (its last lines), for failure messages."""
        return self._transport.diagnostics()

    @property
    def foreign_loop(self) -> bool:
        """Called from another event loop than the one that started it."""
        return self._loop is not None and current_loop() is not self._loop

    @property
    def agent_pid(self) -> int | None:
        return self.hello.pid if self.hello is not None else None

    def close(self, *, wait: bool = True) -> None:
        """Close the stream (from any thread; idempotent). The agent kills what it still
        runs and exits; open requests get :class:`ChannelLost`. With ``wait=False`` the
        transport is closed by a thread of its own (closing an SSH channel to a frozen
        server can block)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.relay.shutdown(self.tampered or "the channel to the sandbox was closed")
        self._outbox.put(None)
        if wait:
            self._close_transport()
        else:
            threading.Thread(
                target=self._close_transport, name="vf-channel-close", daemon=True
            ).start()

    def _close_transport(self) -> None:
        try:
            self._transport.close()
        except Exception as exc:  # noqa: BLE001 - closing a broken stream may fail too
            log.debug("%s: closing the stream failed: %r", self.label, exc)

    async def aclose(self) -> None:
        """Close without blocking the event loop (see :meth:`close`)."""
        self.close(wait=False)
        await anyio.lowlevel.checkpoint()

    # ------------------------------------------------------------------ threads

    def _write_loop(self) -> None:
        outbox = self._outbox
        while True:
            item = outbox.get()
            if item is None:
                return
            batch = [item]
            size = len(item)
            stop = False
            while size < CHUNK * 4:
                try:
                    more = outbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
                size += len(more)
            try:
                self._transport.send(batch[0] if len(batch) == 1 else b"".join(batch))
            except Exception as exc:  # noqa: BLE001 - any failure of the stream ends the channel
                log.debug("%s: writing to the agent failed: %r", self.label, exc)
                self._broken.set()
                self.close()
                return
            with self._send_lock:
                self._queued -= len(batch)
            if stop:
                return

    def _emit(self, data: bytes) -> None:
        """Send whole frames: directly when nothing is queued and the stream takes them
        without blocking (no thread hop), else through the writer thread."""
        broken = False
        with self._send_lock:
            if self._queued == 0:
                try:
                    sent = self._transport.try_send(data)
                except Exception as exc:  # noqa: BLE001 - any failure of the stream ends the channel
                    log.debug("%s: writing to the agent failed: %r", self.label, exc)
                    broken = True
                    sent = len(data)
                if sent == len(data):
                    data = b""
                else:
                    data = data[sent:]
                    self._queued += 1
            else:
                self._queued += 1
        if broken:
            self._broken.set()
            self.close()
        elif data:
            self._outbox.put(data)

    def _read_loop(self) -> None:
        buf = bytearray()
        greeted = False
        try:
            while True:
                with self._flow:
                    while self._backlog > MAX_BACKLOG and not self._closed.is_set():
                        self._flow.wait(0.5)
                if self._closed.is_set():
                    return  # never read a stream close() may have released already
                data = self._transport.recv()
                if not data:
                    if not greeted and bytes(buf).startswith(NO_PYTHON):
                        self._unsupported = True
                    return
                buf += data
                if not greeted:
                    head = bytes(buf[: len(NO_PYTHON)])
                    if buf.startswith(NO_PYTHON) or NO_PYTHON.startswith(head):
                        continue  # no python3 (its EOF follows), or not all of the word yet
                    if len(buf) < len(READY) and READY.startswith(head):
                        continue
                    if not buf.startswith(READY):
                        log.warning("%s: the agent began with %r", self.label, head)
                        return
                    del buf[: len(READY)]
                    greeted = True
                    self._send_key()
                frames, tampered = self._parse(buf)
                if frames and tampered is None:
                    frames, tampered = self.relay.take(frames)
                if frames:
                    self._deliver_soon(frames)
                if tampered is not None:
                    self._tamper(tampered)
                    return
        except Exception as exc:  # noqa: BLE001 - any failure of the stream ends the channel
            if not self._closed.is_set():
                log.debug("%s: reading from the agent failed: %r", self.label, exc)
        finally:
            self._broken.set()
            self.relay.shutdown(self.tampered or "the channel to the sandbox ended")
            self._soon(self._on_lost)

    def _send_key(self) -> None:
        """The key (and whether to report digests), from the reader thread: before any frame."""
        with self._send_lock:
            self._queued += 1
        self._outbox.put(self._key + bytes([1 if self._want_digests else 0]))

    def _tamper(self, reason: str) -> None:
        """The stream cannot be trusted any more: close it (open requests fail typed)."""
        if self.tampered is None:
            self.tampered = reason
            log.error("%s: %s; the channel is closed for good", self.label, reason)
        self._broken.set()
        self.close(wait=False)

    def _parse(self, buf: bytearray) -> tuple[list[tuple[int, int, bytes]], str | None]:
        """Whole authenticated frames off the front of ``buf``, and why the stream is
        tampered with if it is (the frames before that one are authentic)."""
        frames = []
        pos = 0
        end = len(buf)
        key = self._key
        tampered = None
        size_total = 0
        while end - pos >= HEADER.size:
            kind, rid, size = HEADER.unpack_from(buf, pos)
            if size > MAX_FRAME:
                tampered = f"the agent's stream announced a frame of {size} bytes"
                break
            stop = pos + HEADER.size + size
            if stop + TAG > end:
                break
            header = bytes(buf[pos : pos + HEADER.size])
            payload = bytes(buf[pos + HEADER.size : stop])
            expected = wire.mac(key, self._seq_in, header, payload)
            if not hmac.compare_digest(expected, bytes(buf[stop : stop + TAG])):
                tampered = (
                    f"a frame on the agent's stream failed authentication (#{self._seq_in}): "
                    "something in the sandbox wrote to it"
                )
                break
            self._seq_in += 1
            frames.append((kind, rid, payload))
            size_total += size + HEADER.size
            pos = stop + TAG
        del buf[:pos]
        if size_total:
            with self._flow:
                self._backlog += size_total
        return frames, tampered

    def release_backlog(self, size: int) -> None:
        """A request took ``size`` bytes off its inbox: the reader may read on."""
        with self._flow:
            self._backlog -= size + HEADER.size
            if self._backlog <= MAX_BACKLOG:
                self._flow.notify()

    async def _receive(self, request: PendingRequest) -> Frame:
        kind, payload = await request.frames.receive()
        if kind != LOST:
            self.release_backlog(len(payload))
        return kind, payload

    def _deliver_soon(self, frames: list[tuple[int, int, bytes]]) -> None:
        self._soon(lambda: self._deliver(frames))

    def _soon(self, fn: Callable[[], None]) -> None:
        call = self._call_soon
        if call is None:
            return
        try:
            call(fn)
        except RuntimeError:  # the event loop is gone: nobody waits for these frames
            self._broken.set()

    # ------------------------------------------------------------------ on the event loop

    def _deliver(self, frames: list[tuple[int, int, bytes]]) -> None:
        for kind, rid, payload in frames:
            request = self._requests.get(rid) if rid else None
            if request is not None:
                request.inbox.send_nowait((kind, payload))
                if request.budget is not None and kind in DATA_KINDS:
                    request.received += len(payload)
                    if request.received > request.budget:
                        self._tamper(
                            f"the agent sent {request.received} bytes for a request allowed "
                            f"{request.budget}: it is not the agent the host started"
                        )
                continue
            self.release_backlog(len(payload))
            if rid != 0:
                continue  # a request that finished meanwhile: late frames are dropped
            if kind == wire.HELLO and self.hello is None:
                self._greeted(payload)
            elif kind == wire.DIGEST and self.digests is None:
                self._digested(payload)
            elif kind == wire.ALERT:
                try:
                    reason = wire.Fields(payload).text()
                except struct.error:
                    reason = f"(a malformed alert: {payload[:80]!r})"
                self._tamper(f"the agent received frames it did not get from the host: {reason}")

    def _greeted(self, payload: bytes) -> None:
        try:
            self.hello = Hello.from_wire(payload)
        except (struct.error, ValueError, IndexError) as exc:  # struct.error is no ValueError
            self._tamper(f"the agent's hello is malformed: {exc}")
            return
        if self.hello.version != wire.VERSION:
            self.refused = f"the agent speaks version {self.hello.version}, not {wire.VERSION}"
        elif not self.hello.flags & wire.NON_DUMPABLE:
            self.refused = (
                "the agent could not make itself non-dumpable (no ctypes or prctl?): "
                "code in the sandbox could open its stream"
            )
        if self._ready is not None:
            self._ready.set()

    def _digested(self, payload: bytes) -> None:
        """The agent's ``DIGEST`` frame: the digests, or a tampered channel when it is not
        ``(text path, 32-byte sha256)`` repeated."""
        try:
            digests: dict[str, bytes] | None = wire.digests_from_wire(payload)
        except (struct.error, ValueError, IndexError):
            digests = None
        if digests is None or any(len(d) != wire.DIGEST_SIZE for d in digests.values()):
            self._tamper(f"the agent's DIGEST frame is malformed ({len(payload)} bytes)")
            return
        self.digests = digests
        if self._digests_ready is not None:
            self._digests_ready.set()

    def _on_lost(self) -> None:
        self._lost = True
        if self._ready is not None:
            self._ready.set()
        if self._digests_ready is not None:
            self._digests_ready.set()  # nothing more will come
        for request in list(self._requests.values()):
            request.inbox.send_nowait((LOST, b""))

    def _open(self, budget: int | None = None) -> PendingRequest:
        if not self.usable:
            raise ChannelLost(f"{self.label}: the channel is closed", sent=False)
        rid = self._last_id
        while True:
            rid = rid % (wire.RELAY_BIT - 1) + 1  # the relay bit marks the agent's ids
            if rid not in self._requests:
                break
        self._last_id = rid
        inbox, frames = anyio.create_memory_object_stream[Frame](math.inf)
        request = PendingRequest(rid, inbox, frames, budget)
        self._requests[rid] = request
        return request

    def finish(self, request: PendingRequest) -> None:
        """Forget ``request``: its inbox closed, what is still queued for it released."""
        self._requests.pop(request.rid, None)
        request.inbox.close()
        while True:
            try:
                kind, payload = request.frames.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if kind != LOST:
                self.release_backlog(len(payload))
        request.frames.close()

    def send_frame(self, kind: int, rid: int, payload: bytes = b"") -> None:
        """One authenticated frame to the agent (from the event loop or a relay thread)."""
        header = HEADER.pack(kind, rid, len(payload))
        with self._seq_lock:
            tag = wire.mac(self._key, self._seq_out, header, payload)
            self._seq_out += 1
            self._emit(header + payload + tag)

    def relay_send(self, kind: int, rid: int, payload: bytes = b"") -> None:
        """A relay frame, from a relay thread: dropped once the stream is gone."""
        if self.tampered is None and not self._broken.is_set() and not self._closed.is_set():
            self.send_frame(kind, rid, payload)

    def _send_with_header(
        self, kind: int, rid: int, header: bytes, inline: bytes | memoryview
    ) -> None:
        prefix = wire.prefixed(header)
        frame = HEADER.pack(kind, rid, len(prefix) + len(inline))
        with self._seq_lock:
            if len(inline) < 4096:
                body = prefix + bytes(inline)
                tag = wire.mac(self._key, self._seq_out, frame, body)
                self._seq_out += 1
                self._emit(frame + body + tag)
                return
            digest = hmac.new(self._key, SEQ.pack(self._seq_out) + frame, hashlib.sha256)
            digest.update(prefix)
            digest.update(inline)
            self._seq_out += 1
            self._emit(frame + prefix + inline + digest.digest()[:TAG])
