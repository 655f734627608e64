"""One relayed connection's two pumps, the same on both ends of the channel.

Shared: the host's relayed connection (:class:`runtimes.channel.relay.RelayedConnection`) and
the agent's (``Conn`` in :mod:`runtimes.channel.agent.relay`) are both a :class:`RelayStream`
over a socket of their side. Each direction keeps a window: the socket's bytes go to the peer
as ``R_DATA`` while the peer's unacknowledged bytes stay under the window (``R_ACK`` reopens
it); the peer's bytes are written to the socket from a queue and acknowledged once written.
``R_EOF`` half-closes, ``R_CLOSE`` aborts. On the host, an agent that breaks the window is
reported, never obeyed. Standard library only, Python >= 3.8 (part of the agent's joined source).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading

from .wire import R_ACK, R_CLOSE, R_DATA, R_EOF, RELAY_CHUNK, U32


class RelayStream:
    """A relayed connection: ``cid`` (the agent's number for it, ``RELAY_BIT`` set),
    ``window`` unacknowledged bytes per direction, ``sock`` on this side (may come later:
    set it before the pumps run). Subclasses say how a frame reaches the peer (:meth:`send`)
    and how the connection leaves the books once closed (:meth:`forget`)."""

    checks_peer = True
    """Whether a frame that breaks the window is reported instead of obeyed: the host checks
    the agent (sandbox code may have replaced it); the agent obeys the host, whose frames it
    authenticated."""

    def __init__(self, cid: int, window: int, sock: socket.socket | None = None) -> None:
        self.cid = cid
        self.window = window
        self.sock = sock
        self.credit = window
        """Bytes this side may still send before the peer acknowledges some."""
        self.held = 0
        """Bytes received from the peer and not yet written to the socket."""
        self.cond = threading.Condition()
        self.incoming: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.closed = False
        self.halves = 0

    def send(self, kind: int, payload: bytes = b"") -> None:
        """Send one frame of this connection to the peer."""
        raise NotImplementedError

    def forget(self) -> None:
        """The connection is closed: take it off the books."""
        raise NotImplementedError

    def is_closed(self) -> bool:
        return self.closed

    def on_frame(self, kind: int, payload: bytes) -> str | None:
        """Take a frame from the peer; return what broke the protocol, if it did and this
        side checks its peer (the frame is then not obeyed)."""
        if kind == R_DATA:
            with self.cond:
                self.held += len(payload)
                over = self.held > self.window
            if over and self.checks_peer:
                return "the agent sent more relayed bytes than the window allows"
            self.incoming.put(payload)
        elif kind == R_EOF:
            self.incoming.put(None)
        elif kind == R_ACK:
            with self.cond:
                self.credit += U32.unpack(payload)[0]
                over = self.credit > self.window
                self.cond.notify()
            if over and self.checks_peer:
                return "the agent acknowledged relayed bytes the host never sent"
        elif kind == R_CLOSE:
            self.abort(False)
        elif self.checks_peer:
            return f"unexpected frame type {kind} on a relayed connection"
        return None

    def pump_out(self) -> None:
        """The socket's bytes to the peer, never more than the window unacknowledged."""
        sock = self.sock
        assert sock is not None
        while True:
            with self.cond:
                while self.credit <= 0 and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                size = min(self.credit, RELAY_CHUNK)
            try:
                data = sock.recv(size)
            except OSError:
                self.abort(True)
                return
            if self.is_closed():
                return
            if not data:
                self.send(R_EOF)
                self.half_closed()
                return
            with self.cond:
                self.credit -= len(data)
            self.send(R_DATA, data)

    def pump_in(self) -> None:
        """The peer's bytes to the socket, acknowledged once written."""
        sock = self.sock
        assert sock is not None
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
                self.abort(True)
                return
            if data is None:
                self.half_closed()
                return
            with self.cond:
                self.held -= len(data)
            self.send(R_ACK, U32.pack(len(data)))

    def half_closed(self) -> None:
        with self.cond:
            self.halves += 1
            done = self.halves == 2 and not self.closed
            if done:
                self.closed = True
            sock = self.sock
        if done:
            if sock is not None:
                sock.close()
            self.forget()

    def abort(self, tell_peer: bool) -> None:
        """Close both directions at once (idempotent); ``tell_peer``: send ``R_CLOSE``."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
            sock = self.sock
        self.incoming.put(b"")  # wakes pump_in
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes pump_out
            sock.close()
        self.forget()
        if tell_peer:
            self.send(R_CLOSE)
