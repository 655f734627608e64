"""A host port reached from a sandbox on any Ray node: the driver's relay and the node's route.

For a ray sandbox "the host" of :meth:`~runtimes.base.Runtime.expose_host` is the driver's
machine, but the sandbox runs on another node, whose own runtime can only expose ports of
*that* node. The route therefore has two legs::

    process in the sandbox -> inner route (loopback / channel relay) -> NodeRoute listener
        (127.0.0.1 on the node) -> TCP over the cluster network -> DriverRelay (the driver's
        cluster address) -> 127.0.0.1:<port> on the driver

:class:`DriverRelay` (driver side) listens on the driver's cluster address, on an ephemeral
port, served by an event loop of its own on a daemon thread (so it works whatever loop the
caller runs, and outlives the call that opened it). :meth:`DriverRelay.open` registers one
target port and returns a :class:`RelayTicket` holding a fresh 32-byte token. Every
connection the relay accepts must send exactly that token first, within
:data:`PREAMBLE_DEADLINE` seconds: the relay reads at most the token's length before it has
compared it (:func:`hmac.compare_digest`) with the open tickets; anything else (no token, a
wrong, short or slow one, the token of a closed ticket) is closed at once, logged at debug
and counted in :attr:`DriverRelay.refused`. Only then does the relay connect to
``127.0.0.1:<port>`` and copy bytes both ways (:func:`pipe`).

:class:`NodeRoute` (node side, in the :class:`~runtimes.ray.host.SandboxHost` actor) listens
on the node's loopback, exposes that port into the sandbox through the inner runtime's own
route, and for each connection the sandbox makes connects to the ticket's address, sends
the token, then copies both ways. The token never enters the sandbox. :class:`NodeRoutes`
is the actor's set of them.

The two functions the ray runtime calls: :func:`open_ticket` / :func:`close_ticket` on the
driver, :class:`NodeRoutes` (``open`` / ``close`` / ``close_all``) in the actor.
"""

from __future__ import annotations

import asyncio
import atexit
import hmac
import ipaddress
import logging
import secrets
import socket
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field

import anyio
import anyio.abc

from ..base import Runtime
from ..errors import HostRouteError, SandboxError, SandboxInvalidArgumentError
from ..portal import PortalThread, running_event_loop
from ..routes import HostRoute, RouteKind

__all__ = [
    "CHUNK",
    "CONNECT_TIMEOUT",
    "MAX_PENDING",
    "PREAMBLE_DEADLINE",
    "TOKEN_BYTES",
    "DriverRelay",
    "NodeRoute",
    "NodeRoutes",
    "RelayTicket",
    "close_ticket",
    "driver_relay",
    "open_ticket",
    "pipe",
]

log = logging.getLogger("runtimes.ray")

TOKEN_BYTES = 32
"""Length of a ticket's token: the fixed-size preamble of every relayed connection."""
PREAMBLE_DEADLINE = 2.0
"""Seconds a connection to the driver's relay has to send its whole token."""
CONNECT_TIMEOUT = 10.0
"""Seconds either leg waits to connect onward (to the relay, or to the target port)."""
MAX_PENDING = 256
"""Connections the relay holds at once before their token arrived; more are closed at once."""
CHUNK = 64 << 10
"""Bytes one copy step moves (each direction holds at most about this much)."""
CLOSE_WAIT = 5.0
"""Seconds closing a ticket (or the relay) waits for its live connections to end."""


@dataclass(frozen=True)
class RelayTicket:
    """What the node needs to reach one exposed driver port: the relay's ``address:port``
    and the token that admits a connection there (one ticket per exposed port)."""

    address: str
    port: int
    token: bytes = field(repr=False)


async def pipe(one: anyio.abc.ByteStream, other: anyio.abc.ByteStream) -> None:
    """Copy bytes both ways between two streams until both directions ended.

    An end of stream on one side is passed on as a half-close (``send_eof``) to the other,
    and the opposite direction keeps flowing; a broken or reset side ends both directions.
    Each direction holds at most :data:`CHUNK` bytes (the next read waits for the send)."""

    async with anyio.create_task_group() as tg:

        async def copy(src: anyio.abc.ByteStream, dst: anyio.abc.ByteStream) -> None:
            try:
                while True:
                    try:
                        chunk = await src.receive(CHUNK)
                    except anyio.EndOfStream:
                        break
                    await dst.send(chunk)
                await dst.send_eof()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                log.debug("a relayed connection broke: %r", exc)
                tg.cancel_scope.cancel()

        tg.start_soon(copy, one, other)
        tg.start_soon(copy, other, one)


# ---------------------------------------------------------------------------- driver side


@dataclass(eq=False)
class _Open:
    """One open ticket: its target port and the cancel scopes of its live connections."""

    target: int
    live: dict[anyio.CancelScope, anyio.Event] = field(default_factory=dict)
    closed: bool = False


class DriverRelay:
    """The driver's end of the ray route (see the module): a listener on ``address`` (the
    driver's cluster address, an IP) that admits a connection only with an open ticket's
    token and relays it to ``127.0.0.1:<the ticket's port>``. ``deadline``: seconds a
    connection has to send its token; ``max_pending``: connections waiting for theirs at
    once (more are closed at once).

    Raises:
        SandboxInvalidArgumentError: ``address`` is not an IP address.
        HostRouteError: the relay cannot listen on ``address``.
    """

    def __init__(
        self,
        address: str,
        *,
        deadline: float = PREAMBLE_DEADLINE,
        max_pending: int = MAX_PENDING,
    ) -> None:
        try:
            ipaddress.ip_address(address)
        except ValueError as exc:
            raise SandboxInvalidArgumentError(
                f"the driver's relay listens on an IP address, not {address!r}"
            ) from exc
        self.address = address
        self.deadline = deadline
        self.max_pending = max_pending
        self.refused = 0
        """Connections closed unrelayed: no, wrong, short, slow or closed token, or too
        many waiting for theirs."""
        self._lock = threading.Lock()
        self._tickets: dict[bytes, _Open] = {}
        self._pending = 0
        self._closed = False
        self._thread = PortalThread("asyncio", {}, name=f"vf-ray-relay {address}")
        try:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            sock = socket.create_server((address, 0), family=family)
        except OSError as exc:
            self._thread.stop(CLOSE_WAIT)
            raise HostRouteError(f"the driver's relay cannot listen on {address}: {exc}") from exc
        sock.setblocking(False)
        self.port: int = sock.getsockname()[1]
        self._thread.portal.start_task_soon(self._accept, sock).add_done_callback(self._stopped)

    def __repr__(self) -> str:
        return f"DriverRelay({self.address}:{self.port}, tickets={len(self._tickets)})"

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def open(self, port: int) -> RelayTicket:
        """Admit connections to ``127.0.0.1:port`` here: a ticket with a fresh token.

        Raises:
            SandboxInvalidArgumentError: ``port`` is not a TCP port.
            HostRouteError: the relay is closed.
        """
        if not 0 < port < 65536:
            raise SandboxInvalidArgumentError(f"not a TCP port: {port}")
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            if self._closed:
                raise HostRouteError("the driver's relay for ray sandboxes is closed")
            self._tickets[token] = _Open(port)
        return RelayTicket(self.address, self.port, token)

    def close_ticket(self, ticket: RelayTicket) -> None:
        """Refuse the ticket's token from now on and end its live connections (returns once
        they ended, or after :data:`CLOSE_WAIT` seconds). Idempotent; not from the relay's
        own thread."""
        with self._lock:
            entry = self._tickets.pop(ticket.token, None)
            if entry is None:
                return
            entry.closed = True
            closed = self._closed
        if not closed:
            try:
                self._thread.portal.call(self._end, entry)
            except RuntimeError:  # the relay's loop stopped meanwhile: nothing is live
                log.debug("the relay stopped while a ticket was closed")

    def close(self) -> None:
        """Close every ticket and the listener, and stop the relay's loop. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = list(self._tickets.values())
            self._tickets.clear()
        for entry in entries:
            entry.closed = True
        if not self._thread.stop(CLOSE_WAIT):
            log.warning("the driver's relay on %s did not stop within %ss", self, CLOSE_WAIT)

    # ------------------------------------------------------------------ the relay's loop

    async def _end(self, entry: _Open) -> None:
        live = list(entry.live.items())
        for scope, _ in live:
            scope.cancel()
        with anyio.move_on_after(CLOSE_WAIT):
            for _, ended in live:
                await ended.wait()

    async def _accept(self, sock: socket.socket) -> None:
        with sock:
            async with anyio.create_task_group() as tg:
                while True:
                    await anyio.wait_readable(sock)
                    try:
                        conn, peer = sock.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError as exc:  # out of descriptors: wait for some to close
                        log.warning("the driver's relay cannot accept: %s", exc)
                        await anyio.sleep(0.1)
                        continue
                    conn.setblocking(False)
                    if self._pending >= self.max_pending:
                        self._refuse(conn, peer, "too many connections wait for their token")
                        continue
                    self._pending += 1
                    tg.start_soon(self._serve, conn, peer)

    def _stopped(self, future: Future[None]) -> None:
        if not future.cancelled() and future.exception() is not None:
            log.error("the driver's relay on %s stopped", self, exc_info=future.exception())

    def _refuse(self, conn: socket.socket, peer: object, why: str) -> None:
        self.refused += 1
        log.debug("the driver's relay refused a connection from %s: %s", peer, why)
        conn.close()

    async def _preamble(self, conn: socket.socket) -> bytes | str:
        """The connection's token (never reading past its length), or why there is none."""
        got = bytearray()
        with anyio.move_on_after(self.deadline):
            while len(got) < TOKEN_BYTES:
                await anyio.wait_readable(conn)
                try:
                    chunk = conn.recv(TOKEN_BYTES - len(got))
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    return f"broke before its token: {exc}"
                if not chunk:
                    return f"closed after {len(got)} of {TOKEN_BYTES} token bytes"
                got += chunk
            return bytes(got)
        return f"sent {len(got)} of {TOKEN_BYTES} token bytes within {self.deadline}s"

    def _match(self, token: bytes) -> _Open | None:
        """The open ticket whose token this is (every open one compared, in constant time)."""
        found = None
        with self._lock:
            for known, entry in self._tickets.items():
                if hmac.compare_digest(known, token):
                    found = entry
        return found

    async def _serve(self, conn: socket.socket, peer: object) -> None:
        with conn:  # closed however this ends (the relay's close cancels it anywhere)
            try:
                token = await self._preamble(conn)
            finally:
                self._pending -= 1
            entry = self._match(token) if isinstance(token, bytes) else None
            if entry is None:
                why = token if isinstance(token, str) else "no open ticket's token"
                self._refuse(conn, peer, why)
                return
            try:
                with anyio.fail_after(CONNECT_TIMEOUT):
                    target = await anyio.connect_tcp("127.0.0.1", entry.target)
            except (OSError, TimeoutError) as exc:
                log.warning("the driver's relay cannot reach 127.0.0.1:%s: %s", entry.target, exc)
                return
            ended = anyio.Event()
            with anyio.CancelScope() as scope:
                entry.live[scope] = ended
                try:
                    if entry.closed:  # closed while this one connected onward
                        scope.cancel()
                    client = await anyio.abc.SocketStream.from_socket(conn)
                    async with client:
                        await pipe(client, target)
                finally:
                    with anyio.CancelScope(shield=True):
                        await target.aclose()
                    entry.live.pop(scope, None)
                    ended.set()


_RELAYS: dict[str, DriverRelay] = {}
_RELAYS_LOCK = threading.Lock()


def driver_relay(address: str) -> DriverRelay:
    """This process's relay on ``address`` (made on first use, closed at exit).

    Raises:
        SandboxInvalidArgumentError: ``address`` is not an IP address.
        HostRouteError: the relay cannot listen on ``address``.
    """
    with _RELAYS_LOCK:
        relay = _RELAYS.get(address)
        if relay is None or relay.closed:
            if not _RELAYS:
                atexit.register(_close_relays)
            relay = _RELAYS[address] = DriverRelay(address)
        return relay


def _close_relays() -> None:
    with _RELAYS_LOCK:
        relays = list(_RELAYS.values())
        _RELAYS.clear()
    for relay in relays:
        relay.close()


def open_ticket(address: str, port: int) -> RelayTicket:
    """Driver side of ``RayRuntime.expose_host``: a ticket for ``127.0.0.1:port`` of this
    machine, from this process's relay on ``address`` (the driver's address on the cluster
    network, e.g. ``ray.util.get_node_ip_address()``). Hand the ticket to the actor
    (:meth:`NodeRoutes.open`); :func:`close_ticket` when the route closes.

    Raises:
        SandboxInvalidArgumentError: ``address`` is not an IP address, or ``port`` not a port.
        HostRouteError: the relay cannot listen on ``address``.
    """
    return driver_relay(address).open(port)


def close_ticket(ticket: RelayTicket) -> None:
    """Refuse ``ticket`` from now on and end its live connections (idempotent; blocks for
    a moment: call it through ``anyio.to_thread`` from an event loop if that matters)."""
    with _RELAYS_LOCK:
        relay = _RELAYS.get(ticket.address)
    if relay is not None and relay.port == ticket.port:
        relay.close_ticket(ticket)


# ---------------------------------------------------------------------------- node side


class NodeRoute:
    """The node's end of the ray route (see the module): a listener on the node's loopback,
    exposed into the sandbox by the inner runtime, whose connections go to the driver's
    relay with the ticket's token first.

    Under asyncio (the actor's loop) :meth:`open` runs it as a background task; under any
    loop, :meth:`serve` runs it in the caller's task group (``await tg.start(route.serve,
    runtime, ticket)``). :meth:`close` ends it either way.
    """

    def __init__(self) -> None:
        self.via: RouteKind | None = None
        """The inner route's kind, once open."""
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._closed = False

    async def open(self, runtime: Runtime, ticket: RelayTicket) -> tuple[str, int]:
        """Start the route as a task of the running asyncio loop; the ``(host, port)`` a
        process in the sandbox connects to.

        Raises:
            HostRouteError: the inner runtime has no route to the node's port.
            SandboxInvalidArgumentError: the running loop is not asyncio (use :meth:`serve`).
            SandboxUnavailableError: the sandbox is closed.
        """
        if running_event_loop() != "asyncio":
            raise SandboxInvalidArgumentError(
                "NodeRoute.open needs an asyncio loop; run NodeRoute.serve in a task group"
            )
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[tuple[str, int]] = loop.create_future()

        async def run() -> None:
            try:
                await self.serve(runtime, ticket, task_status=_Ready(ready))
            except (SandboxError, OSError) as exc:
                if ready.done():
                    log.warning("the ray route to the driver's relay stopped: %r", exc)
                else:
                    ready.set_exception(exc)
            finally:
                if not ready.done():
                    ready.set_exception(HostRouteError("the ray route closed before it opened"))

        task = loop.create_task(run())
        try:
            return await asyncio.shield(ready)
        except asyncio.CancelledError:
            task.cancel()
            raise

    async def serve(
        self,
        runtime: Runtime,
        ticket: RelayTicket,
        *,
        task_status: anyio.abc.TaskStatus[tuple[str, int]] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the route until :meth:`close` or cancellation; reports the ``(host, port)``
        a process in the sandbox connects to once it is ready.

        Raises:
            HostRouteError: the inner runtime has no route to the node's port.
            SandboxUnavailableError: the sandbox is closed.
        """
        self._done = anyio.Event()
        try:
            with anyio.CancelScope() as self._scope:
                if self._closed:
                    return
                listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
                async with listener:
                    port = listener.extra(anyio.abc.SocketAttribute.local_port)
                    route = await runtime.expose_host(port)
                    try:
                        self.via = route.via
                        task_status.started((route.host, route.port))
                        await listener.serve(lambda client: self._relay(ticket, client))
                    finally:
                        with anyio.CancelScope(shield=True):
                            await self._close_inner(route)
        finally:
            self._done.set()

    async def close(self) -> None:
        """Close the listener, the inner route and every live connection (idempotent)."""
        self._closed = True
        if self._scope is not None:
            self._scope.cancel()
        if self._done is not None:
            with anyio.move_on_after(CLOSE_WAIT):
                await self._done.wait()

    @staticmethod
    async def _close_inner(route: HostRoute) -> None:
        try:
            await route.close()
        except SandboxError as exc:  # the sandbox may be gone: the route went with it
            log.warning("closing the ray route's inner %s route failed: %r", route.via, exc)

    async def _relay(self, ticket: RelayTicket, client: anyio.abc.SocketStream) -> None:
        async with client:
            try:
                with anyio.fail_after(CONNECT_TIMEOUT):
                    upstream = await anyio.connect_tcp(ticket.address, ticket.port)
            except (OSError, TimeoutError) as exc:
                log.warning(
                    "the ray route cannot reach the driver's relay at %s:%s: %s",
                    ticket.address,
                    ticket.port,
                    exc,
                )
                return
            async with upstream:
                try:
                    await upstream.send(ticket.token)
                except (anyio.BrokenResourceError, OSError) as exc:
                    log.warning("the driver's relay dropped the ray route: %r", exc)
                    return
                await pipe(client, upstream)


class _Ready(anyio.abc.TaskStatus[tuple[str, int]]):
    """:meth:`NodeRoute.serve`'s report, handed to :meth:`NodeRoute.open`'s future."""

    def __init__(self, future: asyncio.Future[tuple[str, int]]) -> None:
        self.future = future

    def started(self, value: tuple[str, int] | None = None) -> None:
        assert value is not None
        if not self.future.done():
            self.future.set_result(value)


class NodeRoutes:
    """The actor's routes, one per ticket: what :class:`~runtimes.ray.host.SandboxHost`
    keeps (``open_route`` / ``close_route`` call :meth:`open` / :meth:`close`; its
    ``close`` calls :meth:`close_all` before closing the runtime)."""

    def __init__(self) -> None:
        self._routes: dict[RelayTicket, NodeRoute] = {}

    async def open(self, runtime: Runtime, ticket: RelayTicket) -> tuple[str, int]:
        """A route into ``runtime``'s sandbox to the ticket's driver port: ``(host, port)``
        as seen in the sandbox.

        Raises:
            HostRouteError: the inner runtime has no route to the node's port.
            SandboxUnavailableError: the sandbox is closed.
        """
        route = NodeRoute()
        where = await route.open(runtime, ticket)
        self._routes[ticket] = route
        return where

    async def close(self, ticket: RelayTicket) -> None:
        """Close the ticket's route (idempotent)."""
        route = self._routes.pop(ticket, None)
        if route is not None:
            await route.close()

    async def close_all(self) -> None:
        """Close every route."""
        while self._routes:
            _, route = self._routes.popitem()
            await route.close()
