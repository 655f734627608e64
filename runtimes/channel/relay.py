"""The host's side of the relay: listeners in the sandbox (:meth:`Channel.listen`) whose
connections are carried over the channel to a port on the host. Driven from the channel's
reader thread and one thread pair per connection, never from the event loop."""

from __future__ import annotations

import logging
import socket
import threading
from typing import TYPE_CHECKING

import anyio.lowlevel

from .agent import wire
from .agent.stream import RelayStream
from .agent.wire import U32
from .protocol import RELAY_CONNECT_TIMEOUT, RELAY_WINDOW

if TYPE_CHECKING:
    from .framing import FramedStream, PendingRequest

log = logging.getLogger("runtimes.channel")


class RelayListener:
    """A relay's listener in the sandbox (:meth:`Channel.listen`): ``sandbox_port`` on the
    sandbox's ``127.0.0.1`` reaches ``target`` on the host. ``lost`` says why it stopped
    serving (the channel died or closed), ``None`` while it serves."""

    def __init__(
        self,
        channel: FramedStream,
        request: PendingRequest,
        target: tuple[str, int],
        max_connections: int,
    ) -> None:
        self.channel = channel
        self.request = request
        self.target = target
        self.max_connections = max_connections
        self.sandbox_port = 0
        self.lost: str | None = None
        self.connections: dict[int, RelayedConnection] = {}
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
            chan.send_frame(wire.KILL, self.rid)
        chan.relay.remove(self, "the relay was closed")
        if not chan.foreign_loop:
            chan.finish(self.request)
        await anyio.lowlevel.checkpoint()


class Relay:
    """The host side of a channel's relays: listeners by request id, connections by the
    agent's id. Driven from the channel's reader thread (frames) and one thread pair per
    connection (the host's socket); never from the event loop, so a slow service blocks
    nothing else."""

    def __init__(self, channel: FramedStream) -> None:
        self.channel = channel
        self.lock = threading.Lock()
        self.listeners: dict[int, RelayListener] = {}
        self.connections: dict[int, RelayedConnection] = {}
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
            conn.abort(tell_peer=True)

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
            conn.abort(tell_peer=False)

    def take(
        self, frames: list[tuple[int, int, bytes]]
    ) -> tuple[list[tuple[int, int, bytes]], str | None]:
        """Handle the relay's frames (on the reader thread); return the others, and why the
        stream is tampered with if a relay frame broke the protocol."""
        if not self.listeners and not self.connections:
            return frames, None
        rest = []
        for kind, rid, payload in frames:
            if not rid & wire.RELAY_BIT:
                rest.append((kind, rid, payload))
                continue
            self.channel.release_backlog(len(payload))
            problem = self.on_frame(kind, rid, payload)
            if problem is not None:
                return rest, problem
        return rest, None

    def on_frame(self, kind: int, cid: int, payload: bytes) -> str | None:
        if kind in (wire.OPENED, wire.R_ACK) and len(payload) != U32.size:
            # unpacking it would end the reader with an exception: a restartable break,
            # where a protocol violation must distrust the channel
            return f"the agent sent a malformed relay frame (type {kind}, {len(payload)} bytes)"
        if kind == wire.OPENED:
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
                conn = RelayedConnection(self, listener, cid)
                self.connections[cid] = conn
                listener.connections[cid] = conn
                listener.accepted += 1
        if listener is None:
            self.channel.relay_send(wire.R_CLOSE, cid)
            return None
        conn.start()
        return None

    def forget(self, conn: RelayedConnection) -> None:
        with self.lock:
            self.connections.pop(conn.cid, None)
            conn.listener.connections.pop(conn.cid, None)


class RelayedConnection(RelayStream):
    """One relayed connection on the host: the agent's bytes written to a socket connected
    to the listener's target (at most :data:`RELAY_WINDOW` of them held: the real agent never
    sends more unacknowledged), the target's bytes sent back while the agent's window
    allows (:class:`~runtimes.channel.agent.stream.RelayStream`, shared with the agent)."""

    def __init__(self, relay: Relay, listener: RelayListener, cid: int) -> None:
        super().__init__(cid, RELAY_WINDOW)
        self.relay = relay
        self.listener = listener

    def start(self) -> None:
        threading.Thread(target=self._connect, name="vf-relay-in", daemon=True).start()

    def send(self, kind: int, payload: bytes = b"") -> None:
        self.relay.channel.relay_send(kind, self.cid, payload)

    def forget(self) -> None:
        self.relay.forget(self)

    def _connect(self) -> None:
        try:
            sock = socket.create_connection(self.listener.target, timeout=RELAY_CONNECT_TIMEOUT)
        except OSError as exc:
            log.warning(
                "%s: relay to %s failed: %s", self.relay.channel.label, self.listener.target, exc
            )
            self.abort(True)
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.cond:
            if self.closed:
                sock.close()
                return
            self.sock = sock
        threading.Thread(target=self.pump_out, name="vf-relay-out", daemon=True).start()
        self.pump_in()
