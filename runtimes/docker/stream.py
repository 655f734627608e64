"""The hijacked exec connection of the ``docker`` runtime as an async byte stream.

Commands run through ``exec_create`` + a hijacked ``exec_start`` connection: stdin goes out
on it (then a half-close), the engine's framed stdout/stderr come back. A plain unix or TCP
socket is driven by the event loop itself; a TLS socket or a paramiko channel (``ssh://``)
through blocking calls in worker threads.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import socket
import ssl
import threading
from collections.abc import AsyncIterable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.lowlevel

from ..models import MiB, OutputSink, StdinSource
from ..stdin_feed import feed_stdin
from .client import thread_limiter

if TYPE_CHECKING:
    import requests

    from .process import ExecOutput

log = logging.getLogger("runtimes.docker")

STREAM_CHUNK = 256 * 1024
_STDIN_CHUNK = 1 * MiB


def take_frames(buffer: bytearray) -> list[tuple[int, bytes]]:
    """Remove the complete frames of the engine's multiplexed stream from the front of
    ``buffer`` and return them as ``(stream, payload)``; an incomplete frame stays.

    Frames are ``[stream, 0, 0, 0, size (4 bytes, big-endian)] + payload``; stream 1 is
    stdout, 2 stderr.
    """
    frames = []
    offset = 0
    while len(buffer) - offset >= 8:
        size = int.from_bytes(buffer[offset + 4 : offset + 8], "big")
        if len(buffer) - offset - 8 < size:
            break
        frames.append((buffer[offset], bytes(buffer[offset + 8 : offset + 8 + size])))
        offset += 8 + size
    del buffer[:offset]
    return frames


class ExecStream:
    """The hijacked exec connection as an async byte stream (stdin out, frames in)."""

    async def receive(self) -> bytes:
        """Next chunk, or ``b""`` once the engine closed the stream."""
        raise NotImplementedError

    async def send(self, data: bytes) -> bool:
        """Send stdin bytes; ``False`` once the other side stopped reading."""
        raise NotImplementedError

    async def send_eof(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class _SocketExecStream(ExecStream):
    """A plain unix or TCP socket, driven by the event loop itself (no threads)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self._stream = stream

    async def receive(self) -> bytes:
        try:
            return await self._stream.receive(STREAM_CHUNK)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return b""

    async def send(self, data: bytes) -> bool:
        try:
            await self._stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    async def send_eof(self) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._stream.send_eof()

    async def aclose(self) -> None:
        with contextlib.suppress(OSError):
            await self._stream.aclose()


class GuardedSocket:
    """A blocking socket (or paramiko channel) that threads read and write while another
    thread may close it.

    ``close()`` shuts it down at once, which ends a ``recv()`` under way with ``b""`` and a
    ``sendall()`` with an error, but releases the descriptor only once no call is inside
    it (on the thread of the last one out). Closed under a thread that is about to enter
    ``recv()``, the number would be free for the next socket the process opens, and that
    thread would read (or write) another connection's bytes: a desynchronised SSH transport
    ("Invalid packet blocking"), an exec stream that loses its output."""

    def __init__(self, sock: Any, on_release: Callable[[], None] | None = None) -> None:
        self.raw = sock
        self._on_release = on_release
        self._lock = threading.Lock()
        self._inside = 0
        self._closing = False
        self._released = False

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        with self._lock:
            if self._closing:
                raise OSError(errno.EBADF, "the stream was closed")
            self._inside += 1
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        with self._lock:
            self._inside -= 1
            release = self._closing and not self._inside and not self._released
            self._released = self._released or release
        if release:
            self._release()

    def recv(self, size: int) -> bytes:
        """The next bytes; ``b""`` at the end of the stream or once ``close()`` began."""
        try:
            with self._call():
                data: bytes = self.raw.recv(size)
                return data
        except OSError:
            if self._closing:
                return b""
            raise

    def send(self, data: bytes, flags: int = 0) -> int:
        with self._call():
            sent: int = self.raw.send(data, flags)
            return sent

    def sendall(self, data: bytes) -> None:
        with self._call():
            self.raw.sendall(data)

    def shutdown_write(self) -> None:
        with self._call():
            shutdown_write = getattr(self.raw, "shutdown_write", None)
            if shutdown_write is not None:
                shutdown_write()  # a paramiko channel
            else:
                self.raw.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Shut the socket down now; release it now or when the last call inside returns
        (idempotent, from any thread)."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            with contextlib.suppress(Exception):  # already shut or gone: nothing to wake
                self.raw.shutdown(socket.SHUT_RDWR)
            release = not self._inside
            self._released = release
        if release:
            self._release()

    def _release(self) -> None:
        with contextlib.suppress(Exception):  # an already broken connection
            self.raw.close()
        if self._on_release is not None:
            with contextlib.suppress(Exception):
                self._on_release()


class _ThreadExecStream(ExecStream):
    """A TLS socket or a paramiko channel (ssh://): blocking calls in worker threads."""

    def __init__(self, sock: Any) -> None:
        with contextlib.suppress(OSError):
            sock.settimeout(None)
        self._sock = GuardedSocket(sock)

    async def receive(self) -> bytes:
        try:
            data: bytes = await anyio.to_thread.run_sync(
                self._sock.recv, STREAM_CHUNK, abandon_on_cancel=True, limiter=thread_limiter()
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the connection ends the stream
            log.debug("exec stream ended with %r", exc)
            return b""
        return data

    async def send(self, data: bytes) -> bool:
        try:
            await anyio.to_thread.run_sync(
                self._sock.sendall, data, abandon_on_cancel=True, limiter=thread_limiter()
            )
        except Exception as exc:  # noqa: BLE001 - the command stopped reading stdin
            log.debug("stdin not sent: %r", exc)
            return False
        return True

    async def send_eof(self) -> None:
        try:
            self._sock.shutdown_write()
        except Exception as exc:  # noqa: BLE001 - the stream is already gone
            log.debug("half-close failed: %r", exc)

    async def aclose(self) -> None:
        # A receive abandoned on cancellation may still be in its thread's recv().
        self._sock.close()


@dataclass
class Hijacked:
    """An exec that was started: its id, the HTTP response holding the connection, the
    raw transport object and any stream bytes the HTTP layer had already buffered."""

    exec_id: str
    response: requests.Response
    sock: Any
    leftover: bytes


def hijack(api: Any, exec_id: str) -> Hijacked:
    """``exec_start`` on an upgraded connection; returns the raw socket (blocking)."""
    sock = api.exec_start(exec_id, socket=True)
    response = sock._response
    raw = getattr(sock, "_sock", sock) if isinstance(sock, socket.SocketIO) else sock
    return Hijacked(exec_id, response, raw, _buffered_bytes(response, raw))


def _buffered_bytes(response: requests.Response, raw: Any) -> bytes:
    """Stream bytes the HTTP client read past the response headers, if any.

    http.client reads the upgrade response through a buffered file; whatever the engine
    sent right after the headers sits in that buffer and would be lost to a reader of
    the raw socket. Read it without blocking.
    """
    fp = getattr(getattr(response.raw, "_fp", None), "fp", None)
    if fp is None:
        return b""
    rbuffer = getattr(fp, "_rbuffer", None)  # paramiko's ChannelFile
    if isinstance(rbuffer, bytes | bytearray):
        data = bytes(rbuffer)
        fp._rbuffer = type(rbuffer)()
        return data
    if not isinstance(fp, io.BufferedReader) or not isinstance(raw, socket.socket):
        return b""
    raw.setblocking(False)
    try:
        return fp.read1(STREAM_CHUNK) or b""
    except (BlockingIOError, ssl.SSLWantReadError):
        return b""


async def open_exec_stream(hijacked: Hijacked) -> ExecStream:
    raw = hijacked.sock
    if type(raw) is socket.socket and raw.family == socket.AF_UNIX:
        return _SocketExecStream(await anyio.abc.UNIXSocketStream.from_socket(raw))
    if type(raw) is socket.socket and raw.family in (socket.AF_INET, socket.AF_INET6):
        return _SocketExecStream(await anyio.abc.SocketStream.from_socket(raw))
    return _ThreadExecStream(raw)


def start_stdin(
    tg: anyio.abc.TaskGroup, stream: ExecStream, stdin: StdinSource | None, sink: OutputSink
) -> None:
    """Start feeding the command's stdin (if any) beside the output pump."""
    if isinstance(stdin, bytes):
        if stdin:
            tg.start_soon(_send_stdin, stream, stdin)
    elif stdin is not None:
        tg.start_soon(_send_stdin_source, stream, stdin, sink)


async def _send_stdin(stream: ExecStream, data: bytes) -> None:
    view = memoryview(data)
    for offset in range(0, len(view), _STDIN_CHUNK):
        if not await stream.send(bytes(view[offset : offset + _STDIN_CHUNK])):
            return
    await stream.send_eof()


async def _send_stdin_source(
    stream: ExecStream, source: AsyncIterable[bytes], sink: OutputSink
) -> None:
    """Send what ``source`` yields as it yields (never read ahead of the connection),
    then half-close; a failing source stops the call through ``sink``."""
    await feed_stdin(source, sink, stream.send, stream.send_eof, size=_STDIN_CHUNK)


async def pump_frames(stream: ExecStream, output: ExecOutput) -> None:
    """Feed the stream to the output until the engine closes it or the sink is full
    (then the sink has already cancelled the call)."""
    while True:
        chunk = await stream.receive()
        if not chunk:
            return
        if not output.feed(chunk):
            await anyio.lowlevel.checkpoint()


async def close_exec_stream(stream: ExecStream, hijacked: Hijacked) -> None:
    await stream.aclose()
    with contextlib.suppress(Exception):
        hijacked.response.close()
