"""The relay in the agent: a TCP listener on the sandbox's loopback whose connections are
carried as streams over the channel to a port on the host (agent part).

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host. The window logic is :mod:`.stream`, shared with
the host.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import TYPE_CHECKING

from .stream import RelayStream
from .wire import DONE, OPENED, RELAY_BIT, U16, U32, ListenHeader

if TYPE_CHECKING:
    from .serve import Agent


class Listener:
    """``LISTEN`` (:class:`ListenHeader`): a TCP listener on the sandbox's loopback,
    answered with ``DONE`` (``u16`` port) or one ``ERROR``. Each accepted connection is
    announced with ``OPENED`` (request id: the connection's own, ``RELAY_BIT`` set; payload:
    ``u32`` the listener's id) and then relayed as ``R_DATA`` / ``R_ACK`` / ``R_EOF`` /
    ``R_CLOSE`` frames; connections beyond the maximum are closed at once. ``KILL`` on the
    listener's id closes it and its connections. The bytes are opaque: the agent never reads
    them, the host's service answers them."""

    def __init__(self, agent: Agent, rid: int, header: ListenHeader) -> None:
        self.agent = agent
        self.rid = rid
        self.limit = header.max_connections
        self.window = header.window
        self.port = header.port
        self.sock: socket.socket | None = None
        self.conns: dict[int, Conn] = {}
        self.lock = threading.Lock()
        self.closed = False

    def open(self) -> None:
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            sock.listen(64)
        except OSError as exc:
            self.agent.finish(self.rid)
            self.agent.out.os_error(self.rid, exc)
            return
        sock.set_inheritable(False)
        self.sock = sock
        self.agent.out.send(DONE, self.rid, U16.pack(sock.getsockname()[1]))
        self.agent.workers.submit(self.accept_loop)

    def accept_loop(self) -> None:
        sock = self.sock
        assert sock is not None
        while not self.closed:
            try:
                accepted, _ = sock.accept()
            except OSError:
                if self.is_closed():
                    return
                time.sleep(0.01)  # EMFILE or an aborted handshake: go on accepting
                continue
            with self.lock:
                if self.closed or len(self.conns) >= self.limit:
                    accepted.close()  # the client sees its connection closed: it fails fast
                    continue
                self.agent.next_conn = self.agent.next_conn % 0x7FFFFFFF + 1
                cid = RELAY_BIT | self.agent.next_conn
                conn = Conn(self, cid, accepted)
                self.conns[cid] = conn
            with self.agent.lock:
                self.agent.requests[cid] = conn
            self.agent.out.send(OPENED, cid, U32.pack(self.rid))
            conn.start()

    def is_closed(self) -> bool:
        return self.closed

    def forget(self, cid: int) -> None:
        with self.lock:
            self.conns.pop(cid, None)
        self.agent.finish(cid)

    def feed(self, data: bytes | None) -> None:
        pass

    def kill(self) -> None:
        with self.lock:
            self.closed = True
            conns = list(self.conns.values())
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
            self.sock.close()
        for conn in conns:
            conn.abort(False)
        self.agent.finish(self.rid)


class Conn(RelayStream):
    """One relayed connection in the sandbox: the client's socket, pumped by two worker
    threads (:class:`RelayStream`); the main thread only hands it frames."""

    checks_peer = False

    def __init__(self, listener: Listener, cid: int, sock: socket.socket) -> None:
        super().__init__(cid, listener.window, sock)
        self.listener = listener
        self.out = listener.agent.out
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def start(self) -> None:
        workers = self.listener.agent.workers
        workers.submit(self.pump_out)
        workers.submit(self.pump_in)

    def send(self, kind: int, payload: bytes = b"") -> None:
        self.out.send(kind, self.cid, payload)

    def forget(self) -> None:
        self.listener.forget(self.cid)

    def feed(self, data: bytes | None) -> None:
        pass

    def kill(self) -> None:
        self.abort(False)
