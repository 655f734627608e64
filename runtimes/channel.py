"""The persistent channel: one long-lived stream to a small agent inside the sandbox.

Starting a process through a backend's own exec API costs a full API round trip (Docker's
``exec_create`` + ``exec_start`` + ``exec_inspect``: ~50 ms; an SSH channel; a Modal exec).
A :class:`Channel` pays that once per sandbox: it starts the agent
(:mod:`runtimes._channel_agent`, standard library only) over ONE exec stream with stdin
attached, sends the agent's source through that stream (so nothing is installed and no
request costs an extra round trip), and then multiplexes every exec, read, write, stat and
remove over it as binary frames. See ``docs/channel.md``.

Host side, per channel: one reader thread (blocking reads of the stream, frames parsed and
handed to the event loop in batches), one writer thread (frames queued by the event loop,
written in batches), and per request an anyio memory stream. It works the same under asyncio
and trio; a channel is bound to the event loop that started it.

:class:`ChannelSupervisor` is what a backend holds: it starts the channel at ``start()``,
routes each call through it, and falls back to the backend's plain path when the sandbox has
no ``python3`` (probed once), when the channel died (restarted on the next call, at most
:data:`MAX_RESTARTS` times per :data:`RESTART_WINDOW` seconds), or when the agent cannot serve
a request (switching users without root). A request in flight on a channel that died is
retried through the plain path only when it is idempotent (read, exists); otherwise it fails
with :class:`~runtimes.errors.SandboxTransportError`, or
:class:`~runtimes.errors.SandboxUnavailableError` when the sandbox itself is gone.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import errno
import hashlib
import hmac
import logging
import math
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from . import _channel_agent as agent
from .errors import (
    ChannelTamperedError,
    HostRouteError,
    OutputLimitExceededError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxPermissionError,
    SandboxTransportError,
    SandboxUnavailableError,
    error_for_errno,
)
from .models import ExecRequest, OutputSink

log = logging.getLogger("runtimes.channel")

T = TypeVar("T")

__all__ = [
    "BOOTSTRAP",
    "PROBE",
    "Channel",
    "ChannelHooks",
    "ChannelInfo",
    "ChannelSupervisor",
    "ChannelTransport",
    "RelayListener",
    "agent_command",
    "agent_source",
]

FRAME = agent.HEADER
U32 = agent.U32
I32 = agent.I32
TAG = agent.TAG
SEQ = agent.SEQ

CHUNK = 256 * 1024
"""Bytes of stdin or file content per frame."""
INLINE = 64 * 1024
"""Stdin or file content up to this size travels inside the request's own frame."""
WINDOW = 4 * 1024 * 1024
"""Unacknowledged stdin / write bytes per request: bounds the agent's memory."""
MAX_FRAME = 1024 * 1024
"""The longest frame the agent may send (its largest is a 256 KiB chunk): a header announcing
more is refused before anything of it is buffered, and the channel is dropped as tampered."""
MAX_BACKLOG = 16 * 1024 * 1024
"""Bytes received from the agent and not yet taken by their request: past this the reader
thread stops reading (the stream pushes back), so a flood cannot grow the host's memory."""
START_TIMEOUT = 20.0
"""Seconds for the agent to say hello after its stream opened."""
KILL_WAIT = 10.0
"""Seconds to wait for the agent to confirm a kill before the plain path kills instead."""
FIRST_PROBE = 1.0
NEXT_PROBE = 5.0
"""A request that hears nothing for this long asks the backend whether the sandbox still runs
(a paused or stopped container never answers: it must not hang the caller)."""
MAX_RESTARTS = 3
RESTART_WINDOW = 60.0
RELAY_WINDOW = 256 * 1024
"""Unacknowledged bytes per relayed connection and direction: what either side may hold of
a connection whose reader is slow. Host memory for relays: at most this times 2 times
:data:`MAX_RELAYED` per channel."""
MAX_RELAYED = 32
"""Relayed connections open at once per listener; the agent closes more at once."""
RELAY_CONNECT_TIMEOUT = 10.0
"""Seconds for the host's service to accept a relayed connection."""
_U16 = struct.Struct(">H")

_DATA_KINDS = frozenset((agent.STDOUT, agent.STDERR, agent.CHUNK))
_LOST = -1
"""Pseudo frame type delivered to every open request when the stream ends."""
_NO_PYTHON = b"vf-sandbox:no-python"
_READY = b"vf-sandbox:ready\n"
"""What the bootstrap writes once the process is non-dumpable: the key is sent only then."""

PROBE = (
    "command -v python3 >/dev/null 2>&1 || { echo vf-sandbox:no-python; exit 0; }; "
    'exec python3 -I -S -B -c "$1"'
)
"""The command that starts the agent the first time: ``sh -c PROBE sh BOOTSTRAP``. Without
python3 it says so on stdout (the channel is then never tried again in this sandbox). Later
starts run the interpreter the first agent reported, by absolute path (:func:`agent_command`)."""

BOOTSTRAP = (
    "import os,sys\n"
    "if sys.version_info<(3,8):os.write(1,b'vf-sandbox:no-python\\n');sys.exit(0)\n"
    "d=0\n"
    "try:\n"
    " import ctypes;d=ctypes.CDLL(None).prctl(4,0,0,0,0)==0\n"
    "except Exception:pass\n"
    "os.write(1,b'vf-sandbox:ready\\n')\n"
    "def r(n):\n"
    " b=b''\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:sys.exit(3)\n"
    "  b+=c\n"
    " return b\n"
    "exec(compile(r(int(r(10))),'vf-sandbox-agent','exec'),"
    "{'__name__':'__vf_sandbox_agent__','_vf_nodump':d})\n"
)
"""Python's ``-c`` program: makes the process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``: no
``/proc/<pid>/fd``, no ptrace by other processes without CAP_SYS_PTRACE), says ``ready``, then
reads the agent's length-prefixed source from stdin and runs it. The agent then reads the
per-start key from stdin (sent by the host only after ``ready``)."""


@cache
def agent_source() -> bytes:
    """The agent's source, prefixed with its length as the bootstrap expects."""
    source = Path(agent.__file__).read_bytes()
    return b"%010d" % len(source) + source


def agent_command(interpreter: str | None = None) -> list[str]:
    """argv that starts the agent: through ``sh`` and a ``PATH`` search for ``python3`` the
    first time, else straight through ``interpreter`` (an absolute path, pinned at the first
    start: no shell, no ``PATH``)."""
    if interpreter is not None:
        return [interpreter, "-I", "-S", "-B", "-c", BOOTSTRAP]
    return ["sh", "-c", PROBE, "sh", BOOTSTRAP]


# ---------------------------------------------------------------------- errors (internal)


class ChannelLost(Exception):
    """The stream ended or broke while a request was in flight (``sent=False``: before
    anything of the request was sent, so it may safely take the plain path)."""

    def __init__(self, message: str, pgid: int | None = None, *, sent: bool = True) -> None:
        super().__init__(message)
        self.pgid = pgid
        self.sent = sent


class ChannelStalled(ChannelLost):
    """A file request heard nothing for the backend's I/O timeout: the channel is dropped."""


class ChannelRefused(Exception):
    """The agent cannot serve this request (nothing was started): use the plain path."""


class ChannelUnsupported(Exception):
    """The sandbox cannot run the agent (no python3 >= 3.8)."""


class SandboxGone(Exception):
    """The backend's liveness probe says the sandbox stopped while a request waited."""


# ---------------------------------------------------------------------- transports


class ChannelTransport(abc.ABC):
    """The byte stream to the agent's stdin and stdout. Blocking calls, from the channel's
    own threads: ``recv`` from the reader thread, ``send`` from the writer thread, ``close``
    from any thread (it must unblock a pending ``recv``)."""

    @abc.abstractmethod
    def recv(self) -> bytes:
        """The next bytes of the agent's stdout; ``b""`` once it ended."""

    @abc.abstractmethod
    def send(self, data: bytes) -> None:
        """Write to the agent's stdin. Raises ``OSError`` (or anything) when broken."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close the stream (idempotent); the agent then kills what it runs and exits."""

    def try_send(self, data: bytes) -> int:
        """Write what can be written without blocking, from the event loop's thread; return
        how much. The default (0) sends everything through the writer thread."""
        return 0

    def diagnostics(self) -> str:
        """What the agent said on stderr (its last lines), for failure messages."""
        return ""


# ---------------------------------------------------------------------- event loop binding


def _loop_handle() -> tuple[object, Callable[[Callable[[], None]], object]]:
    """The running event loop and a thread-safe "call this soon on it"."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        import trio

        token = trio.lowlevel.current_trio_token()
        return token, token.run_sync_soon
    return loop, loop.call_soon_threadsafe


def _current_loop() -> object | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    try:
        import trio

        return trio.lowlevel.current_trio_token()
    except (ImportError, RuntimeError):
        return None


# ---------------------------------------------------------------------- the channel


Frame = tuple[int, bytes]


@dataclass
class _Request:
    rid: int
    inbox: MemoryObjectSendStream[Frame]
    frames: MemoryObjectReceiveStream[Frame]
    budget: int | None = None
    """The most output / content bytes the real agent may send for this request."""
    received: int = 0


class Channel:
    """One agent, one stream, many concurrent requests. Bound to the event loop that
    started it. Use through :class:`ChannelSupervisor`."""

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
        self._key = secrets.token_bytes(agent.KEY)
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
        self.hello: dict[str, Any] = {}
        self._transport = transport
        self._probe_dead = probe_dead
        self._kill_group = kill_group
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._queued = 0
        """Frames handed to the writer thread and not yet written: while there are any,
        nothing may be written directly (it would overtake them)."""
        self._requests: dict[int, _Request] = {}
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
        self._relay = _Relay(self)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, timeout: float = START_TIMEOUT) -> None:
        """Send the agent's source, start the threads, wait for the agent's hello.

        Raises:
            ChannelUnsupported: the sandbox has no usable python3.
            ChannelLost: the stream ended before the agent said hello.
            TimeoutError: no hello within ``timeout``.
        """
        self._loop, self._call_soon = _loop_handle()
        self._ready = anyio.Event()
        self._digests_ready = anyio.Event()
        # The source goes first: the reader answers the agent's "ready" with the key, which
        # must not overtake it (a restarted agent can say "ready" before we get here).
        self._emit(agent_source())
        for name, target in (("reader", self._read_loop), ("writer", self._write_loop)):
            threading.Thread(target=target, name=f"vf-channel-{name}", daemon=True).start()
        with anyio.fail_after(timeout):
            await self._ready.wait()
        if self._unsupported:
            raise ChannelUnsupported(f"{self.label}: no python3 >= 3.8 in the sandbox")
        if not self.hello:
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
            and _current_loop() is self._loop
        )

    @property
    def foreign_loop(self) -> bool:
        """Called from another event loop than the one that started it."""
        return self._loop is not None and _current_loop() is not self._loop

    @property
    def agent_pid(self) -> int | None:
        pid = self.hello.get("pid")
        return int(pid) if pid is not None else None

    def close(self, *, wait: bool = True) -> None:
        """Close the stream (from any thread; idempotent). The agent kills what it still
        runs and exits; open requests get :class:`ChannelLost`. With ``wait=False`` the
        transport is closed by a thread of its own (closing an SSH channel to a frozen
        server can block)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._relay.shutdown(self.tampered or "the channel to the sandbox was closed")
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
                data = self._transport.recv()
                if not data:
                    if not greeted and bytes(buf).startswith(_NO_PYTHON):
                        self._unsupported = True
                    return
                buf += data
                if not greeted:
                    head = bytes(buf[: len(_NO_PYTHON)])
                    if buf.startswith(_NO_PYTHON) or _NO_PYTHON.startswith(head):
                        continue  # no python3 (its EOF follows), or not all of the word yet
                    if len(buf) < len(_READY) and _READY.startswith(head):
                        continue
                    if not buf.startswith(_READY):
                        log.warning("%s: the agent began with %r", self.label, head)
                        return
                    del buf[: len(_READY)]
                    greeted = True
                    self._send_key()
                frames, tampered = self._parse(buf)
                if frames and tampered is None:
                    frames, tampered = self._relay.take(frames)
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
            self._relay.shutdown(self.tampered or "the channel to the sandbox ended")
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
        while end - pos >= FRAME.size:
            kind, rid, size = FRAME.unpack_from(buf, pos)
            if size > MAX_FRAME:
                tampered = f"the agent's stream announced a frame of {size} bytes"
                break
            stop = pos + FRAME.size + size
            if stop + TAG > end:
                break
            header = bytes(buf[pos : pos + FRAME.size])
            payload = bytes(buf[pos + FRAME.size : stop])
            expected = agent.mac(key, self._seq_in, header, payload)
            if not hmac.compare_digest(expected, bytes(buf[stop : stop + TAG])):
                tampered = (
                    f"a frame on the agent's stream failed authentication (#{self._seq_in}): "
                    "something in the sandbox wrote to it"
                )
                break
            self._seq_in += 1
            frames.append((kind, rid, payload))
            size_total += size + FRAME.size
            pos = stop + TAG
        del buf[:pos]
        if size_total:
            with self._flow:
                self._backlog += size_total
        return frames, tampered

    def _release(self, size: int) -> None:
        """A request took ``size`` bytes off its inbox: the reader may read on."""
        with self._flow:
            self._backlog -= size + FRAME.size
            if self._backlog <= MAX_BACKLOG:
                self._flow.notify()

    async def _receive(self, request: _Request) -> Frame:
        kind, payload = await request.frames.receive()
        if kind != _LOST:
            self._release(len(payload))
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
                if request.budget is not None and kind in _DATA_KINDS:
                    request.received += len(payload)
                    if request.received > request.budget:
                        self._tamper(
                            f"the agent sent {request.received} bytes for a request allowed "
                            f"{request.budget}: it is not the agent the host started"
                        )
                continue
            self._release(len(payload))
            if rid != 0:
                continue  # a request that finished meanwhile: late frames are dropped
            if kind == agent.HELLO and not self.hello:
                self._greeted(payload)
            elif kind == agent.DIGEST and self.digests is None:
                self.digests = _decode_digests(payload)
                if self._digests_ready is not None:
                    self._digests_ready.set()
            elif kind == agent.ALERT:
                reason = agent.Fields(payload).text()
                self._tamper(f"the agent received frames it did not get from the host: {reason}")

    def _greeted(self, payload: bytes) -> None:
        try:
            self.hello = _decode_hello(payload)
        except (ValueError, IndexError) as exc:  # struct.error is a ValueError
            self._tamper(f"the agent's hello is malformed: {exc}")
            return
        if self.hello["v"] != agent.VERSION:
            self.refused = f"the agent speaks version {self.hello['v']}, not {agent.VERSION}"
        elif not self.hello["flags"] & agent.NON_DUMPABLE:
            self.refused = (
                "the agent could not make itself non-dumpable (no ctypes or prctl?): "
                "code in the sandbox could open its stream"
            )
        if self._ready is not None:
            self._ready.set()

    def _on_lost(self) -> None:
        self._lost = True
        if self._ready is not None:
            self._ready.set()
        if self._digests_ready is not None:
            self._digests_ready.set()  # nothing more will come
        for request in list(self._requests.values()):
            request.inbox.send_nowait((_LOST, b""))

    def _open(self, budget: int | None = None) -> _Request:
        if not self.usable:
            raise ChannelLost(f"{self.label}: the channel is closed", sent=False)
        rid = self._last_id
        while True:
            rid = rid % (agent.RELAY_BIT - 1) + 1  # the relay bit marks the agent's ids
            if rid not in self._requests:
                break
        self._last_id = rid
        inbox, frames = anyio.create_memory_object_stream[Frame](math.inf)
        request = _Request(rid, inbox, frames, budget)
        self._requests[rid] = request
        return request

    def _finish(self, request: _Request) -> None:
        self._requests.pop(request.rid, None)
        request.inbox.close()
        while True:
            try:
                kind, payload = request.frames.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                break
            if kind != _LOST:
                self._release(len(payload))
        request.frames.close()

    def _send(self, kind: int, rid: int, payload: bytes = b"") -> None:
        header = FRAME.pack(kind, rid, len(payload))
        with self._seq_lock:
            tag = agent.mac(self._key, self._seq_out, header, payload)
            self._seq_out += 1
            self._emit(header + payload + tag)

    def _relay_send(self, kind: int, rid: int, payload: bytes = b"") -> None:
        """A relay frame, from a relay thread: dropped once the stream is gone."""
        if self.tampered is None and not self._broken.is_set() and not self._closed.is_set():
            self._send(kind, rid, payload)

    def _send_with_header(
        self, kind: int, rid: int, header: bytes, inline: bytes | memoryview
    ) -> None:
        prefix = U32.pack(len(header)) + header
        frame = FRAME.pack(kind, rid, len(prefix) + len(inline))
        with self._seq_lock:
            if len(inline) < 4096:
                body = prefix + bytes(inline)
                tag = agent.mac(self._key, self._seq_out, frame, body)
                self._seq_out += 1
                self._emit(frame + body + tag)
                return
            digest = hmac.new(self._key, SEQ.pack(self._seq_out) + frame, hashlib.sha256)
            digest.update(prefix)
            digest.update(inline)
            self._seq_out += 1
            self._emit(frame + prefix + inline + digest.digest()[:TAG])

    async def _next(self, request: _Request, *, file: bool = False) -> Frame:
        """The request's next frame. A silence is met with the backend's liveness probe;
        a file request (never silent for long) fails after the stall timeout."""
        stall = self._stall_timeout if file else None
        waited = 0.0
        wait = FIRST_PROBE
        while True:
            step = wait if stall is None else min(wait, stall - waited)
            with anyio.move_on_after(step):
                return await self._receive(request)
            waited += step
            if stall is not None and waited >= stall:
                raise ChannelStalled(f"{self.label}: no answer for {stall:g}s")
            if self._probe_dead is not None and await self._probe_dead():
                raise SandboxGone(f"{self.label}: the sandbox stopped")
            wait = NEXT_PROBE

    def _acked(self, in_flight: int, payload: bytes) -> int:
        """The window after an ``ACK``; one acknowledging more than was sent is a forgery."""
        in_flight -= U32.unpack(payload)[0]
        if in_flight < 0:
            self._tamper("the agent acknowledged bytes the host never sent")
        return in_flight

    def _send_more(self, rid: int, data: memoryview, sent: int, in_flight: int) -> tuple[int, int]:
        """Queue stdin / content frames while the window allows; EOF after the last."""
        total = len(data)
        while sent < total and in_flight < WINDOW:
            piece = data[sent : sent + CHUNK]
            self._send(agent.DATA, rid, bytes(piece))
            sent += len(piece)
            in_flight += len(piece)
            if sent == total:
                self._send(agent.EOF, rid)
        return sent, in_flight

    # ------------------------------------------------------------------ requests

    async def exec(self, request: ExecRequest, sink: OutputSink, env: Mapping[str, str]) -> int:
        """Run a command through the agent; on cancellation kill its group and confirm.

        Raises:
            ChannelRefused / ChannelLost / SandboxGone: for the supervisor to handle.
            SandboxError subclasses: the command could not start (typed, as documented on
                :meth:`runtimes.base.Runtime.exec`).
        """
        # The agent forwards at most the cap and the chunk that crossed it.
        pending = self._open(request.output_limit + agent.PIPE_CHUNK)
        data = memoryview(request.stdin or b"")
        inline = data[:INLINE]
        header = _exec_header(request, env, bool(data), len(inline) == len(data))
        pgid: int | None = None
        finished = False
        try:
            self._send_with_header(agent.EXEC, pending.rid, header, inline)
            sent, in_flight = len(inline), 0
            while True:
                sent, in_flight = self._send_more(pending.rid, data, sent, in_flight)
                kind, payload = await self._next(pending)
                if kind == agent.STDOUT:
                    sink.feed("stdout", payload)
                elif kind == agent.STDERR:
                    sink.feed("stderr", payload)
                elif kind == agent.ACK:
                    in_flight = self._acked(in_flight, payload)
                elif kind == agent.STARTED:
                    pgid = U32.unpack(payload)[0]
                elif kind == agent.EXIT:
                    finished = True
                    return int(I32.unpack(payload)[0])
                elif kind == agent.ERROR:
                    finished = True
                    raise _exec_error(payload, request)
                elif kind == _LOST:
                    finished = True
                    raise ChannelLost(f"{self.label}: the channel died during an exec", pgid)
        except BaseException as exc:
            if not finished and not isinstance(exc, SandboxGone):
                with anyio.CancelScope(shield=True):
                    await self._kill(pending, pgid)
            raise
        finally:
            self._finish(pending)

    async def _kill(self, pending: _Request, pgid: int | None) -> None:
        """Kill the request's process group (timeout, output cap, cancellation).

        The agent kills it and confirms with the exit; when the channel died or the agent
        does not confirm in time, the backend's plain path kills the group instead.
        """
        if self.usable:
            self._send(agent.KILL, pending.rid)
            with anyio.move_on_after(self._kill_wait):
                while True:
                    kind, payload = await self._receive(pending)
                    if kind == agent.STARTED:
                        pgid = U32.unpack(payload)[0]
                    elif kind in (agent.EXIT, agent.ERROR):
                        return
                    elif kind == _LOST:
                        break
        if pgid is None or self._kill_group is None:
            log.warning(
                "%s: a command may be left running (its kill was not confirmed)", self.label
            )
            return
        try:
            with anyio.move_on_after(self._kill_wait):
                await self._kill_group(pgid)
        except SandboxError as exc:
            log.warning("%s: could not kill process group %s: %s", self.label, pgid, exc)

    async def read(self, path: str, limit: int) -> bytes:
        """A file's bytes (``limit`` enforced by the agent).

        Raises:
            SandboxFileNotFoundError, SandboxIsADirectoryError, SandboxNotADirectoryError,
            SandboxPermissionError, OutputLimitExceededError: as for ``Runtime.read``.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        pending = self._open(limit)
        done = False
        try:
            self._send(agent.READ, pending.rid, agent.U64.pack(limit) + agent.text(path))
            parts: list[bytes] = []
            received = 0
            while True:
                kind, payload = await self._next(pending, file=True)
                if kind == agent.CHUNK:
                    received += len(payload)
                    if received > limit:
                        # The agent checks the cap before it sends: one that sends more is
                        # not the agent the host started. Nothing more is buffered.
                        parts.clear()
                        self._tamper(f"the agent sent more than the {limit} bytes a read allows")
                        raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
                    parts.append(payload)
                elif kind == agent.DONE:
                    done = True
                    return b"".join(parts)
                elif kind == agent.ERROR:
                    done = True
                    raise _file_error(payload, path, limit)
                elif kind == _LOST:
                    done = True
                    raise ChannelLost(f"{self.label}: the channel died during a read")
        finally:
            if not done and self.usable:
                self._send(agent.KILL, pending.rid)
            self._finish(pending)

    async def write(self, path: str, data: bytes) -> None:
        """Write a file (parents created), streamed under the window.

        Raises:
            SandboxIsADirectoryError, SandboxNotADirectoryError, SandboxPermissionError:
                as for ``Runtime.write``.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        pending = self._open()
        view = memoryview(data)
        inline = view[:INLINE]
        done = False
        try:
            complete = len(inline) == len(view)
            header = agent.U8.pack(2 if complete else 0) + agent.text(path)
            self._send_with_header(agent.WRITE, pending.rid, header, inline)
            sent, in_flight = len(inline), 0
            while True:
                sent, in_flight = self._send_more(pending.rid, view, sent, in_flight)
                kind, payload = await self._next(pending, file=True)
                if kind == agent.ACK:
                    in_flight = self._acked(in_flight, payload)
                elif kind == agent.DONE:
                    done = True
                    return
                elif kind == agent.ERROR:
                    done = True
                    raise _file_error(payload, path, 0)
                elif kind == _LOST:
                    done = True
                    raise ChannelLost(f"{self.label}: the channel died during a write")
        finally:
            if not done and self.usable:
                self._send(agent.KILL, pending.rid)
            self._finish(pending)

    async def exists(self, path: str) -> bool:
        """Whether anything is at ``path`` (``lstat``).

        Raises:
            SandboxPermissionError: a parent cannot be searched.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        payload = await self._simple(agent.STAT, path)
        return payload == b"\x01"

    async def remove(self, path: str) -> None:
        """Remove a file, a link or a whole tree.

        Raises:
            SandboxFileNotFoundError, SandboxPermissionError: as for ``Runtime.remove``.
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        await self._simple(agent.REMOVE, path)

    async def _simple(self, kind: int, path: str) -> bytes:
        pending = self._open()
        try:
            self._send(kind, pending.rid, agent.text(path))
            answer, payload = await self._next(pending, file=True)
            if answer == agent.DONE:
                return payload
            if answer == agent.ERROR:
                raise _file_error(payload, path, 0)
            raise ChannelLost(f"{self.label}: the channel died during a file operation")
        finally:
            self._finish(pending)

    async def listen(
        self, target: tuple[str, int], *, port: int = 0, max_connections: int = MAX_RELAYED
    ) -> RelayListener:
        """A TCP listener on the sandbox's loopback (``port``, 0: a free one) whose every
        connection is relayed over this channel to ``target`` on the host.

        Raises:
            HostRouteError: the agent could not listen (the port is taken...).
            ChannelLost / SandboxGone: for the supervisor to handle.
        """
        pending = self._open()
        listener = RelayListener(self, pending, target, max_connections)
        self._relay.add(listener)  # before LISTEN: OPENED may overtake its DONE
        ready = False
        try:
            payload = U32.pack(max_connections) + U32.pack(RELAY_WINDOW) + _U16.pack(port)
            self._send(agent.LISTEN, pending.rid, payload)
            kind, answer = await self._next(pending, file=True)
            if kind == agent.DONE:
                listener.sandbox_port = _U16.unpack(answer)[0]
                ready = True
                return listener
            if kind == agent.ERROR:
                _, _, message = _decode_error(answer)
                raise HostRouteError(
                    f"{self.label}: the agent cannot listen on 127.0.0.1:{port}: {message}",
                    via="channel",
                )
            raise ChannelLost(f"{self.label}: the channel died while the relay started")
        finally:
            if not ready:
                self._relay.remove(listener, "the relay never started")
                self._finish(pending)


class RelayListener:
    """A relay's listener in the sandbox (:meth:`Channel.listen`): ``sandbox_port`` on the
    sandbox's ``127.0.0.1`` reaches ``target`` on the host. ``lost`` says why it stopped
    serving (the channel died or closed), ``None`` while it serves."""

    def __init__(
        self, channel: Channel, request: _Request, target: tuple[str, int], max_connections: int
    ) -> None:
        self.channel = channel
        self.request = request
        self.target = target
        self.max_connections = max_connections
        self.sandbox_port = 0
        self.lost: str | None = None
        self.connections: dict[int, _RelayedConnection] = {}
        self.accepted = 0
        """Connections relayed so far (for tests and benchmarks)."""

    @property
    def rid(self) -> int:
        return self.request.rid

    async def aclose(self) -> None:
        """Stop listening in the sandbox and close every relayed connection (idempotent;
        call from the channel's event loop)."""
        chan = self.channel
        if self.lost is None and chan.usable:
            chan._send(agent.KILL, self.rid)
        chan._relay.remove(self, "the relay was closed")
        if not chan.foreign_loop:
            chan._finish(self.request)
        await anyio.lowlevel.checkpoint()


class _Relay:
    """The host side of a channel's relays: listeners by request id, connections by the
    agent's id. Driven from the channel's reader thread (frames) and one thread pair per
    connection (the host's socket); never from the event loop, so a slow service blocks
    nothing else."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.lock = threading.Lock()
        self.listeners: dict[int, RelayListener] = {}
        self.connections: dict[int, _RelayedConnection] = {}
        self.stopped: str | None = None

    def add(self, listener: RelayListener) -> None:
        with self.lock:
            self.listeners[listener.rid] = listener

    def remove(self, listener: RelayListener, reason: str) -> None:
        with self.lock:
            self.listeners.pop(listener.rid, None)
            conns = list(listener.connections.values())
            if listener.lost is None:
                listener.lost = reason
        for conn in conns:
            conn.abort(tell_agent=True)

    def shutdown(self, reason: str) -> None:
        """The channel ended: every listener is lost, every connection closed."""
        with self.lock:
            if self.stopped is not None:
                return
            self.stopped = reason
            listeners = list(self.listeners.values())
            conns = list(self.connections.values())
            self.listeners.clear()
        for listener in listeners:
            if listener.lost is None:
                listener.lost = reason
        for conn in conns:
            conn.abort(tell_agent=False)

    def take(
        self, frames: list[tuple[int, int, bytes]]
    ) -> tuple[list[tuple[int, int, bytes]], str | None]:
        """Handle the relay's frames (on the reader thread); return the others, and why the
        stream is tampered with if a relay frame broke the protocol."""
        if not self.listeners and not self.connections:
            return frames, None
        rest = []
        for kind, rid, payload in frames:
            if not rid & agent.RELAY_BIT:
                rest.append((kind, rid, payload))
                continue
            self.channel._release(len(payload))
            problem = self.on_frame(kind, rid, payload)
            if problem is not None:
                return rest, problem
        return rest, None

    def on_frame(self, kind: int, cid: int, payload: bytes) -> str | None:
        if kind in (agent.OPENED, agent.R_ACK) and len(payload) != U32.size:
            # unpacking it would end the reader with an exception: a restartable break,
            # where a protocol violation must distrust the channel
            return f"the agent sent a malformed relay frame (type {kind}, {len(payload)} bytes)"
        if kind == agent.OPENED:
            return self.opened(cid, U32.unpack(payload)[0])
        with self.lock:
            conn = self.connections.get(cid)
        if conn is None:
            return None  # closed meanwhile: late frames are dropped
        return conn.on_frame(kind, payload)

    def opened(self, cid: int, listener_id: int) -> str | None:
        with self.lock:
            listener = self.listeners.get(listener_id)
            if cid in self.connections:
                return f"the agent opened relayed connection {cid:#x} twice"
            if listener is None or len(listener.connections) >= listener.max_connections:
                listener = None
            else:
                conn = _RelayedConnection(self, listener, cid)
                self.connections[cid] = conn
                listener.connections[cid] = conn
                listener.accepted += 1
        if listener is None:
            self.channel._relay_send(agent.R_CLOSE, cid)
            return None
        conn.start()
        return None

    def forget(self, conn: _RelayedConnection) -> None:
        with self.lock:
            self.connections.pop(conn.cid, None)
            conn.listener.connections.pop(conn.cid, None)


class _RelayedConnection:
    """One relayed connection on the host: the agent's bytes written to a socket connected
    to the listener's target (at most :data:`RELAY_WINDOW` of them held: the real agent never
    sends more unacknowledged), the target's bytes sent back while the agent's window
    allows."""

    def __init__(self, relay: _Relay, listener: RelayListener, cid: int) -> None:
        self.relay = relay
        self.listener = listener
        self.cid = cid
        self.incoming: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.held = 0
        self.credit = RELAY_WINDOW
        self.cond = threading.Condition()
        self.sock: socket.socket | None = None
        self.closed = False
        self.halves = 0

    def is_closed(self) -> bool:
        return self.closed

    def start(self) -> None:
        threading.Thread(target=self._connect, name="vf-relay-in", daemon=True).start()

    def on_frame(self, kind: int, payload: bytes) -> str | None:
        if kind == agent.R_DATA:
            with self.cond:
                self.held += len(payload)
                over = self.held > RELAY_WINDOW
            if over:
                return "the agent sent more relayed bytes than the window allows"
            self.incoming.put(payload)
        elif kind == agent.R_EOF:
            self.incoming.put(None)
        elif kind == agent.R_ACK:
            with self.cond:
                self.credit += U32.unpack(payload)[0]
                over = self.credit > RELAY_WINDOW
                self.cond.notify()
            if over:
                return "the agent acknowledged relayed bytes the host never sent"
        elif kind == agent.R_CLOSE:
            self.abort(tell_agent=False)
        else:
            return f"unexpected frame type {kind} on a relayed connection"
        return None

    def _connect(self) -> None:
        try:
            sock = socket.create_connection(self.listener.target, timeout=RELAY_CONNECT_TIMEOUT)
        except OSError as exc:
            log.warning(
                "%s: relay to %s failed: %s", self.relay.channel.label, self.listener.target, exc
            )
            self.abort(tell_agent=True)
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.cond:
            if self.closed:
                sock.close()
                return
            self.sock = sock
        threading.Thread(target=self._pump_out, name="vf-relay-out", daemon=True).start()
        self._pump_in(sock)

    def _pump_in(self, sock: socket.socket) -> None:
        """The agent's bytes to the service, acknowledged once written."""
        send = self.relay.channel._relay_send
        while True:
            data = self.incoming.get()
            if self.closed:
                return
            try:
                if data is None:
                    sock.shutdown(socket.SHUT_WR)
                else:
                    sock.sendall(data)
            except OSError:
                self.abort(tell_agent=True)
                return
            if data is None:
                self._half_closed()
                return
            with self.cond:
                self.held -= len(data)
            send(agent.R_ACK, self.cid, U32.pack(len(data)))

    def _pump_out(self) -> None:
        """The service's bytes to the agent, never more than the window unacknowledged."""
        sock = self.sock
        assert sock is not None
        send = self.relay.channel._relay_send
        while True:
            with self.cond:
                while self.credit <= 0 and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                size = min(self.credit, agent.RELAY_CHUNK)
            try:
                data = sock.recv(size)
            except OSError:
                self.abort(tell_agent=True)
                return
            if self.is_closed():
                return
            if not data:
                send(agent.R_EOF, self.cid)
                self._half_closed()
                return
            with self.cond:
                self.credit -= len(data)
            send(agent.R_DATA, self.cid, data)

    def _half_closed(self) -> None:
        with self.cond:
            self.halves += 1
            done = self.halves == 2 and not self.closed
            if done:
                self.closed = True
            sock = self.sock
        if done:
            if sock is not None:
                sock.close()
            self.relay.forget(self)

    def abort(self, *, tell_agent: bool) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
            sock = self.sock
        self.incoming.put(b"")  # wakes _pump_in
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes _pump_out
            sock.close()
        self.relay.forget(self)
        if tell_agent:
            self.relay.channel._relay_send(agent.R_CLOSE, self.cid)


def _exec_header(
    request: ExecRequest, env: Mapping[str, str], has_stdin: bool, complete: bool
) -> bytes:
    text = agent.text
    merged = {**request.env, **env}
    parts = [
        agent.U8.pack((1 if has_stdin else 0) | (2 if complete else 0)),
        agent.U64.pack(request.output_limit),
        text(request.cwd),
        text(request.user or ""),
        U32.pack(len(request.argv)),
        *(text(arg) for arg in request.argv),
        U32.pack(len(merged)),
    ]
    for name, value in merged.items():
        parts += (text(name), text(value))
    return b"".join(parts)


def _decode_hello(payload: bytes) -> dict[str, Any]:
    version, pid, sid, uid, gid, flags = agent.HELLO_FIELDS.unpack_from(payload, 0)
    fields = agent.Fields(payload[agent.HELLO_FIELDS.size :])
    python = fields.text()
    return {
        "v": version,
        "pid": pid,
        "sid": sid,
        "uid": uid,
        "gid": gid,
        "flags": flags,
        "python": python,
        "executable": fields.text(),
    }


def _decode_digests(payload: bytes) -> dict[str, bytes]:
    fields = agent.Fields(payload)
    digests = {}
    while fields.pos < len(payload):
        path = fields.text()
        digests[path] = payload[fields.pos : fields.pos + 32]
        fields.pos += 32
    return digests


def _decode_error(payload: bytes) -> tuple[int, str, str]:
    fields = agent.Fields(payload[4:])
    (num,) = I32.unpack_from(payload, 0)
    return int(num), fields.text(), fields.text()


def _exec_error(payload: bytes, request: ExecRequest) -> Exception:
    num, what, message = _decode_error(payload)
    program = request.argv[0]
    if what == "unsupported":
        return ChannelRefused(message)
    if what == "internal":
        return SandboxError(f"the channel agent could not run {program!r}: {message}")
    if what == "cwd":
        return error_for_errno(num, request.cwd, "working directory")
    if what == "user":
        return SandboxInvalidArgumentError(
            f"no such user in the sandbox: {request.user!r} ({message})"
        )
    if num == errno.E2BIG:
        size = sum(len(a.encode("utf-8", "surrogateescape")) + 1 for a in request.argv)
        return SandboxInvalidArgumentError(
            f"argument list too long for the kernel ({size} bytes); "
            "pass large data through stdin or a file"
        )
    if num == errno.ENOENT:
        return SandboxFileNotFoundError(program, "no such program")
    if num in (errno.EACCES, errno.EPERM, errno.EISDIR):
        return SandboxPermissionError(program, "not executable")
    return error_for_errno(num, program, message or None)


def _file_error(payload: bytes, path: str, limit: int) -> SandboxError:
    num, what, message = _decode_error(payload)
    if what == "internal":
        return SandboxError(f"the channel agent failed on {path!r}: {message}")
    if what == "special":
        return SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
    if what == "limit":
        return OutputLimitExceededError(f"read of {path!r}", limit, path=path)
    return error_for_errno(num, path, None)


# ---------------------------------------------------------------------- supervision


@dataclass(frozen=True)
class ChannelHooks:
    """What a backend gives its :class:`ChannelSupervisor`.

    ``open_transport``: start ``agent_command(interpreter)`` with stdin attached and return
    the stream (raise a ``SandboxError`` when it cannot); ``interpreter`` is ``None`` the first
    time, then the absolute path pinned then. ``kill_group``: kill a process group through
    the plain path (the agent died holding it). ``lost_means_dead``: after the channel died,
    whether the sandbox itself is gone. ``probe_dead``: a cheap check, during a long silence,
    that the sandbox stopped (``None``: no such check). ``verify_agent``: before a restart,
    check through the backend's own file access (never by running sandbox code) that the
    files the first agent ran from are unchanged: given their sha256 (32 zero bytes: absent;
    :data:`UNKNOWN`: the first agent died before it reported) as the first agent reported
    them, the pinned interpreter always among them, return ``None`` or why they cannot be
    trusted (``None`` hook: a restart is never trusted, the plain path serves).
    ``verify_first``: before the first start, whether the sandbox's ``python3`` can be trusted
    (a sandbox commands ran in before this runtime attached); ``None`` or why not.
    """

    open_transport: Callable[[str | None], Awaitable[ChannelTransport]]
    kill_group: Callable[[int], Awaitable[None]]
    lost_means_dead: Callable[[], Awaitable[bool]]
    probe_dead: Callable[[], Awaitable[bool]] | None = None
    verify_agent: Callable[[Mapping[str, bytes]], Awaitable[str | None]] | None = None
    verify_first: Callable[[], Awaitable[str | None]] | None = None


ABSENT = bytes(32)
"""The digest the agent reports for a file that is not there (``/etc/ld.so.preload``)."""
UNKNOWN = b""
"""The digest of a file the first agent did not report (it died first)."""


async def verify_by_reading(
    read_file: Callable[[str], Awaitable[bytes | None]], digests: Mapping[str, bytes]
) -> str | None:
    """A ``verify_agent`` for backends that can read a file without running sandbox code
    (SFTP, a filesystem API): every file hashed again and compared. ``read_file`` returns
    ``None`` for a missing file and may raise ``SandboxError``."""
    for path, digest in digests.items():
        if digest == UNKNOWN:
            return f"the first agent died before it reported the digest of {path!r}"
        try:
            data = await read_file(path)
        except SandboxError as exc:
            return f"could not read {path!r} to verify it: {exc}"
        now = ABSENT if data is None else hashlib.sha256(data).digest()
        if not hmac.compare_digest(now, digest):
            return f"{path!r} changed since the agent first ran"
    return None


@dataclass(frozen=True)
class ChannelInfo:
    """The state of a runtime's channel, for tests, logs and ``vf-sandbox doctor``.

    ``state`` is ``disabled`` (``channel=False``), ``unsupported`` (no python3 in the
    sandbox, or an agent that cannot protect itself), ``running``, ``down`` (died or never
    came up; restarted on the next call while the restart budget allows), ``distrusted``
    (the stream was tampered with, or the agent could not be restarted from verified files:
    the plain path serves for good; ``reason`` says why) or ``closed``. ``served`` counts
    the calls the channel served, ``fallbacks`` those that took the backend's plain path
    while the channel was enabled.
    """

    state: str
    agent_pid: int | None
    python: str | None
    restarts: int
    served: int
    fallbacks: int
    reason: str | None


class ChannelSupervisor:
    """Routes a runtime's calls through its channel, with the fallbacks described above."""

    def __init__(
        self,
        enabled: bool,
        label: Callable[[], str],
        hooks: ChannelHooks,
        *,
        max_restarts: int = MAX_RESTARTS,
        restart_window: float = RESTART_WINDOW,
        start_timeout: float = START_TIMEOUT,
        stall_timeout: float | None = None,
        kill_wait: float = KILL_WAIT,
    ) -> None:
        self.enabled = enabled
        self._label = label
        self._hooks = hooks
        self._max_restarts = max_restarts
        self._restart_window = restart_window
        self._start_timeout = start_timeout
        self._stall_timeout = stall_timeout
        self._kill_wait = kill_wait
        self._channel: Channel | None = None
        self._unsupported = False
        self._closed = False
        self._reason: str | None = None
        self._restarts: collections.deque[float] = collections.deque()
        self._restart_count = 0
        self._served = 0
        self._fallbacks = 0
        self._locks: dict[int, anyio.Lock] = {}
        self._interpreter: str | None = None
        """The interpreter's absolute path, as the first agent (started before any command
        of the runtime) reported it: later starts run it by path, after verification."""
        self._first: Channel | None = None
        self._distrusted: str | None = None

    @property
    def info(self) -> ChannelInfo:
        chan = self._channel
        if not self.enabled:
            state = "disabled"
        elif self._closed:
            state = "closed"
        elif self._distrusted is not None or (chan is not None and chan.tampered):
            state = "distrusted"
        elif self._unsupported:
            state = "unsupported"
        elif chan is not None and chan.hello and not chan._lost and not chan._broken.is_set():
            state = "running"
        else:
            state = "down"
        hello = chan.hello if chan is not None else {}
        return ChannelInfo(
            state=state,
            agent_pid=chan.agent_pid if chan is not None else None,
            python=hello.get("python"),
            restarts=self._restart_count,
            served=self._served,
            fallbacks=self._fallbacks,
            reason=self._reason or (chan.tampered if chan is not None else None),
        )

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the agent (the runtime's ``_start``). Never raises: a sandbox without a
        channel still works through the plain path."""
        if not self.enabled:
            return
        if self._hooks.verify_first is not None:
            try:
                reason = await self._hooks.verify_first()
            except SandboxError as exc:
                reason = f"could not verify the sandbox's python3: {exc}"
            if reason is not None:
                self._distrust(f"the agent's interpreter cannot be trusted: {reason}")
                return
        self._channel = await self._launch()

    async def close(self) -> None:
        """Close the channel (before the sandbox goes away)."""
        self._closed = True
        chan, self._channel = self._channel, None
        if chan is not None:
            await chan.aclose()

    def close_now(self) -> None:
        """Blocking close, for the atexit backstop."""
        self._closed = True
        chan, self._channel = self._channel, None
        if chan is not None:
            chan.close()

    def _distrust(self, reason: str) -> None:
        if self._distrusted is None:
            self._distrusted = reason
            self._reason = reason
            log.warning("%s: channel distrusted: %s; the plain path serves", self._label(), reason)

    async def _verified_interpreter(self) -> str | None:
        """Before a restart: the pinned interpreter if the files the first agent ran from
        are verified unchanged; else ``None`` and the channel is distrusted for good."""
        first = self._first
        if self._interpreter is None or first is None:
            self._distrust(
                "no interpreter was pinned at the first start: a restart would run "
                "whatever python3 the sandbox has now"
            )
            return None
        verify = self._hooks.verify_agent
        if verify is None:
            self._distrust("the agent died and this backend cannot verify its interpreter")
            return None
        # The first agent may have died before it reported (killed at once): the pinned
        # interpreter is then listed with an unknown digest (a backend that verifies by
        # content refuses it; Docker's diff against the image needs no digest).
        digests = dict(await first.wait_digests(self._start_timeout) or {})
        digests.setdefault(self._interpreter, UNKNOWN)
        try:
            reason = await verify(digests)
        except SandboxError as exc:
            reason = f"could not verify the agent's files: {exc}"
        if reason is not None:
            self._distrust(f"the agent died and its files cannot be trusted: {reason}")
            return None
        return self._interpreter

    async def _launch(self, interpreter: str | None = None) -> Channel | None:
        label = self._label()
        first = self._first is None
        try:
            with anyio.CancelScope(shield=True):
                # Shielded: once the stream is open nothing may lose the handle on it.
                transport = await self._hooks.open_transport(interpreter)
        except SandboxError as exc:
            self._reason = f"could not start the agent: {exc}"
            log.info("%s: %s", label, self._reason)
            return None
        chan = Channel(
            transport,
            f"channel of {label}",
            probe_dead=self._probe_dead,
            kill_group=self._hooks.kill_group,
            stall_timeout=self._stall_timeout,
            kill_wait=self._kill_wait,
            want_digests=first and self._hooks.verify_agent is not None,
        )
        try:
            await chan.start(self._start_timeout)
        except ChannelUnsupported as exc:
            self._unsupported = True
            self._reason = str(exc)
            log.info("%s: %s; using the plain path", label, exc)
        except (ChannelLost, TimeoutError) as exc:
            if chan.tampered is not None:
                self._distrust(chan.tampered)
            else:
                self._reason = f"the agent did not start: {exc or 'timed out'}"
                log.warning("%s: %s", label, self._reason)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await chan.aclose()
            raise
        else:
            self._reason = None
            if first:
                self._first = chan
                executable = str(chan.hello.get("executable") or "")
                self._interpreter = executable if executable.startswith("/") else None
            return chan
        with anyio.CancelScope(shield=True):
            await chan.aclose()
        return None

    async def _current(self) -> Channel | None:
        """The channel to use for this call, restarting a dead one if allowed; ``None``
        for the plain path."""
        if not self.enabled or self._unsupported or self._closed or self._distrusted:
            return None
        chan = self._channel
        if chan is not None:
            if chan.usable:
                return chan
            if chan.foreign_loop:
                return None  # another event loop (an atexit close, say): plain path
        async with self._lock():
            chan = self._channel
            if chan is not None and chan.usable:
                return chan
            if chan is not None:
                self._channel = None
                await chan.aclose()
                if chan.tampered is not None:
                    self._distrust(chan.tampered)
            if self._closed or self._distrusted or not self._may_restart():
                return None
            interpreter = None
            if self._first is not None or self._served or self._fallbacks:
                # Commands may have run since the first start: never search PATH again,
                # and run the pinned interpreter only once its files are verified.
                interpreter = await self._verified_interpreter()
                if interpreter is None:
                    return None
            self._restart_count += 1
            self._restarts.append(time.monotonic())
            self._channel = await self._launch(interpreter)
            return self._channel

    def _lock(self) -> anyio.Lock:
        key = id(_current_loop())
        lock = self._locks.get(key)
        if lock is None:
            self._locks = {key: (lock := anyio.Lock())}
        return lock

    def _may_restart(self) -> bool:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self._restart_window:
            self._restarts.popleft()
        return len(self._restarts) < self._max_restarts

    async def _retire(self, chan: Channel) -> None:
        if self._channel is chan:
            self._channel = None
        with anyio.CancelScope(shield=True):
            await chan.aclose()

    async def _probe_dead(self) -> bool:
        probe = self._hooks.probe_dead
        if probe is None:
            return False
        try:
            return await probe()
        except SandboxError as exc:
            log.debug("%s: liveness probe failed: %s", self._label(), exc)
            return False

    async def _tampered(
        self, chan: Channel, what: str, pgid: int | None = None
    ) -> ChannelTamperedError:
        """The error for a request whose channel was tampered with (never retried through
        a channel; the plain path serves later calls)."""
        reason = chan.tampered or "tampered with"
        self._distrust(reason)
        with anyio.CancelScope(shield=True):
            await self._retire_and_kill(chan, pgid)
        return ChannelTamperedError(f"{self._label()}: during {what}: {reason}")

    async def _retire_and_kill(self, chan: Channel, pgid: int | None) -> None:
        """Retire a channel that failed a request, and kill the request's process group
        (if it started one) through the backend's plain path, bounded."""
        await self._retire(chan)
        if pgid is not None:
            with anyio.move_on_after(self._kill_wait):
                try:
                    await self._hooks.kill_group(pgid)
                except SandboxError as exc:
                    log.warning("%s: could not kill group %s: %s", self._label(), pgid, exc)

    async def _failure(self, chan: Channel, what: str, pgid: int | None = None) -> SandboxError:
        """The error for a non-idempotent request whose channel died under it."""
        with anyio.CancelScope(shield=True):
            await self._retire_and_kill(chan, pgid)
            try:
                dead = await self._hooks.lost_means_dead()
            except SandboxError:
                dead = False
        if dead:
            return SandboxUnavailableError(f"{self._label()} died during {what}")
        said = chan._transport.diagnostics()
        return SandboxTransportError(
            f"{self._label()}: the channel to the sandbox failed during {what}"
            + (f" (agent said: {said})" if said else "")
        )

    async def _unsent(self, chan: Channel, plain: Callable[[], Awaitable[T]]) -> T:
        """The channel died before the request left: nothing ran, the plain path may."""
        await self._retire(chan)
        self._served -= 1
        self._fallbacks += 1
        return await plain()

    def _gone(self, what: str) -> SandboxUnavailableError:
        return SandboxUnavailableError(f"{self._label()} stopped answering during {what}")

    # ------------------------------------------------------------------ relay

    @property
    def can_relay(self) -> bool:
        """Whether a relay may be asked for: the channel is enabled, the sandbox can run
        the agent, and the channel is neither distrusted nor closed (a channel that is down
        is restarted by :meth:`listen`)."""
        return self.enabled and not self._unsupported and not self._closed and not self._distrusted

    async def listen(self, target: tuple[str, int]) -> RelayListener:
        """A listener on the sandbox's loopback relayed to ``target`` on the host.

        Raises:
            HostRouteError: the channel cannot serve (disabled, no python3, distrusted,
                down) or the agent could not listen.
            SandboxUnavailableError: the sandbox stopped answering.
        """
        chan = await self._current()
        if chan is None:
            state = self.info
            raise HostRouteError(
                f"{self._label()}: no channel to relay through (state {state.state!r}"
                + (f": {state.reason}" if state.reason else "")
                + ")",
                via="channel",
            )
        try:
            return await chan.listen(target)
        except ChannelLost as lost:
            await self._retire(chan)
            raise HostRouteError(f"{self._label()}: {lost}", via="channel") from None
        except SandboxGone:
            await self._retire(chan)
            raise self._gone("starting a relay") from None

    # ------------------------------------------------------------------ routed calls

    async def exec(
        self,
        request: ExecRequest,
        sink: OutputSink,
        plain: Callable[[], Awaitable[int]],
        env: Mapping[str, str] | None = None,
    ) -> int:
        """Run through the channel, or ``plain()``. Errors as for ``Runtime._exec``."""
        chan = await self._current()
        if chan is None:
            self._fallbacks += self.enabled
            return await plain()
        self._served += 1
        what = f"exec of {request.argv[0]!r}"
        try:
            return await chan.exec(request, sink, env or {})
        except ChannelRefused:
            self._served -= 1
            self._fallbacks += 1
            return await plain()
        except ChannelLost as lost:
            if chan.tampered is not None:
                raise await self._tampered(chan, what, lost.pgid) from None
            if not lost.sent:
                return await self._unsent(chan, plain)
            raise await self._failure(chan, what, lost.pgid) from None
        except SandboxGone:
            await self._retire(chan)
            raise self._gone(what) from None

    async def read(self, path: str, limit: int, plain: Callable[[], Awaitable[bytes]]) -> bytes:
        """Idempotent: a channel that dies under it hands over to ``plain()``."""
        return await self._file_call(
            lambda chan: chan.read(path, limit), plain, f"a read of {path!r}", idempotent=True
        )

    async def exists(self, path: str, plain: Callable[[], Awaitable[bool]]) -> bool:
        """Idempotent: a channel that dies under it hands over to ``plain()``."""
        return await self._file_call(
            lambda chan: chan.exists(path), plain, f"a stat of {path!r}", idempotent=True
        )

    async def write(self, path: str, data: bytes, plain: Callable[[], Awaitable[None]]) -> None:
        """Not idempotent: a channel that dies under it is a transport (or dead) error."""
        await self._file_call(
            lambda chan: chan.write(path, data), plain, f"a write of {path!r}", idempotent=False
        )

    async def remove(self, path: str, plain: Callable[[], Awaitable[None]]) -> None:
        """Not idempotent: a channel that dies under it is a transport (or dead) error."""
        await self._file_call(
            lambda chan: chan.remove(path), plain, f"removing {path!r}", idempotent=False
        )

    async def _file_call(
        self,
        call: Callable[[Channel], Awaitable[T]],
        plain: Callable[[], Awaitable[T]],
        what: str,
        *,
        idempotent: bool,
    ) -> T:
        """Serve a file call through the channel, else ``plain()``. A channel lost under an
        idempotent call hands over to ``plain()``; under another one, only if the request
        was never sent (else a transport or dead error)."""
        chan = await self._current()
        if chan is None:
            self._fallbacks += self.enabled
            return await plain()
        self._served += 1
        try:
            return await call(chan)
        except ChannelLost as lost:
            if chan.tampered is not None:
                raise await self._tampered(chan, what) from None
            if idempotent:
                await self._retire(chan)
                self._fallbacks += 1
                return await plain()
            if not lost.sent:
                return await self._unsent(chan, plain)
            raise await self._failure(chan, what) from None
        except SandboxGone:
            await self._retire(chan)
            raise self._gone(what) from None
