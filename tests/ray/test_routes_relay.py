"""The ray route to a driver port, without a cluster: a process in a real subprocess sandbox
reaches a service on 127.0.0.1 through :class:`NodeRoute` (the node's leg, here in the
test's own loop) and :class:`DriverRelay` (the driver's leg, on its own thread), and gets
its bytes back exactly (``runtimes/ray/routes.py``).

Under asyncio the node's leg runs as :meth:`NodeRoute.open` runs it in the actor (a task of
the running loop); under trio as :meth:`NodeRoute.serve` in the test's task group.
"""

from __future__ import annotations

import socket
import textwrap
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import anyio
import pytest

from runtimes import open_runtime
from runtimes.base import Runtime
from runtimes.errors import SandboxInvalidArgumentError
from runtimes.portal import running_event_loop
from runtimes.ray.routes import (
    TOKEN_BYTES,
    DriverRelay,
    NodeRoute,
    NodeRoutes,
    RelayTicket,
    close_ticket,
    driver_relay,
    open_ticket,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Echo:
    """A TCP echo service on the host's loopback, a thread per connection: sends back what
    it reads as it reads it, half-closes after the client's end of stream; counts
    connections (in all, at most at once) and bytes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.accepted = 0
        self.open = 0
        self.echoed = 0
        self.grew = threading.Condition(self.lock)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.accepted += 1
                self.open += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            with conn:
                while chunk := conn.recv(65536):
                    conn.sendall(chunk)
                    with self.lock:
                        self.echoed += len(chunk)
                        self.grew.notify_all()
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the relay reset it: the test reads what the client saw
        finally:
            with self.lock:
                self.open -= 1

    def wait_echoed(self, count: int, timeout: float) -> bool:
        """Whether the service echoed ``count`` bytes in all within ``timeout`` seconds."""
        with self.lock:
            return self.grew.wait_for(lambda: self.echoed >= count, timeout)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def echo() -> Iterator[Echo]:
    service = Echo()
    yield service
    service.close()


@pytest.fixture
def relay() -> Iterator[DriverRelay]:
    relay = DriverRelay("127.0.0.1")
    yield relay
    relay.close()


@pytest.fixture
async def rt(anyio_backend: str) -> AsyncIterator[Runtime]:
    async with open_runtime({"type": "subprocess"}) as runtime:
        yield runtime


@asynccontextmanager
async def routed(
    runtime: Runtime, ticket: RelayTicket
) -> AsyncIterator[tuple[NodeRoute, tuple[str, int]]]:
    """The node's leg for ``ticket``, as the actor runs it (asyncio) or in a task group."""
    route = NodeRoute()
    if running_event_loop() == "asyncio":
        try:
            yield route, await route.open(runtime, ticket)
        finally:
            await route.close()
        return
    async with anyio.create_task_group() as tg:
        try:
            yield route, await tg.start(route.serve, runtime, ticket)
        finally:
            await route.close()


CLIENT = textwrap.dedent(
    """
    import hashlib, os, socket, sys, threading
    host, port, size, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    together = threading.Barrier(count, timeout=30)
    results = []

    def one():
        data = os.urandom(size)
        s = socket.create_connection((host, port), timeout=60)
        s.sendall(data[:1])
        first = s.recv(1)
        together.wait()  # every connection is up and relayed at once
        def send():
            s.sendall(data[1:])
            s.shutdown(socket.SHUT_WR)
        sender = threading.Thread(target=send)
        sender.start()
        got = bytearray(first)
        while chunk := s.recv(65536):
            got += chunk
        sender.join()
        results.append(hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
                       and len(got) == size)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads: t.start()
    for t in threads: t.join()
    print(sum(results), len(results))
    """
)


async def clients(
    runtime: Runtime, where: tuple[str, int], size: int, count: int = 1
) -> tuple[int, int]:
    """Run ``count`` clients at once in the sandbox, each sending ``size`` random bytes and
    reading them back: (how many got exactly theirs, how many ran)."""
    host, port = where
    result = await runtime.exec(
        ["python3", "-c", CLIENT, host, str(port), str(size), str(count)], timeout=120
    )
    assert result.exit_code == 0, result.stderr
    good, ran = result.stdout.split()
    return int(good), int(ran)


@pytest.mark.parametrize("size", [1 << 10, 8 << 20], ids=["1KiB", "8MiB"])
async def test_a_sandbox_process_gets_its_bytes_back_exactly(
    rt: Runtime, relay: DriverRelay, echo: Echo, size: int
) -> None:
    ticket = relay.open(echo.port)
    async with routed(rt, ticket) as (_, where):
        assert await clients(rt, where, size) == (1, 1)
    assert echo.accepted == 1
    assert echo.echoed == size
    assert relay.refused == 0


async def test_several_connections_at_once(rt: Runtime, relay: DriverRelay, echo: Echo) -> None:
    ticket = relay.open(echo.port)
    async with routed(rt, ticket) as (_, where):
        assert await clients(rt, where, 256 << 10, count=8) == (8, 8)
    assert echo.accepted == 8


HOLD = textwrap.dedent(
    """
    import socket, sys
    s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
    s.sendall(b"ping")
    got = b""
    try:
        while len(got) < 4 and (chunk := s.recv(4 - len(got))):
            got += chunk
        print("echoed", got.decode(), flush=True)
        s.sendall(b"!")
        rest = s.recv(1)  # its echo, then the end
        rest = s.recv(1) if rest == b"!" else rest
        print("ended", "eof" if rest == b"" else "data")
    except (ConnectionResetError, BrokenPipeError):
        print("ended", "reset")
    """
)


async def hold(runtime: Runtime, where: tuple[str, int]) -> str:
    result = await runtime.exec(["python3", "-c", HOLD, where[0], str(where[1])], timeout=60)
    assert result.exit_code == 0, result.stderr
    return result.stdout


async def relayed(echo: Echo) -> None:
    """Until the held connection is up end to end: its client got the echo of ``ping``
    (and said so by sending one byte more)."""
    assert await anyio.to_thread.run_sync(echo.wait_echoed, 5, 20.0)


async def test_closing_the_ticket_ends_live_connections_and_refuses_new_ones(
    rt: Runtime, relay: DriverRelay, echo: Echo
) -> None:
    ticket = relay.open(echo.port)
    async with routed(rt, ticket) as (_, where):
        outputs: list[str] = []

        async def held() -> None:
            outputs.append(await hold(rt, where))

        async with anyio.create_task_group() as tg:
            tg.start_soon(held)
            await relayed(echo)
            with anyio.fail_after(10):
                await anyio.to_thread.run_sync(relay.close_ticket, ticket)
        assert outputs[0].splitlines()[0] == "echoed ping"
        assert outputs[0].splitlines()[1] in {"ended eof", "ended reset"}

        after = await hold(rt, where)  # the node relays it; the driver's relay refuses it
        assert "echoed ping" not in after
    assert echo.accepted == 1  # the later connection never reached the service
    assert relay.refused == 1


async def test_closing_the_route_ends_its_connections_and_its_listener(
    rt: Runtime, relay: DriverRelay, echo: Echo
) -> None:
    ticket = relay.open(echo.port)
    outputs: list[str] = []
    async with routed(rt, ticket) as (route, where):

        async def held() -> None:
            outputs.append(await hold(rt, where))

        async with anyio.create_task_group() as tg:
            tg.start_soon(held)
            await relayed(echo)
            with anyio.fail_after(10):
                await route.close()
    assert outputs[0].splitlines() in (["echoed ping", "ended eof"], ["echoed ping", "ended reset"])
    with pytest.raises(OSError):  # the node's listener is gone (the inner route: loopback)
        await anyio.connect_tcp(*where)
    assert relay.refused == 0


async def test_the_actors_routes_close_all(
    rt: Runtime, relay: DriverRelay, echo: Echo, anyio_backend: str
) -> None:
    if anyio_backend == "trio":
        with pytest.raises(SandboxInvalidArgumentError, match="asyncio"):
            await NodeRoute().open(rt, relay.open(echo.port))
        return
    routes = NodeRoutes()
    first, second = relay.open(echo.port), relay.open(echo.port)
    assert first.token != second.token and len(first.token) == TOKEN_BYTES
    assert "token" not in repr(first)
    one, two = await routes.open(rt, first), await routes.open(rt, second)
    assert one != two
    assert await clients(rt, one, 1 << 10) == (1, 1)
    assert await clients(rt, two, 1 << 10) == (1, 1)
    await routes.close(first)
    with pytest.raises(OSError):
        await anyio.connect_tcp(*one)
    assert await clients(rt, two, 1 << 10) == (1, 1)
    await routes.close_all()
    with pytest.raises(OSError):
        await anyio.connect_tcp(*two)


def test_the_process_relay_is_one_per_address(echo: Echo) -> None:
    ticket = open_ticket("127.0.0.1", echo.port)
    relay = driver_relay("127.0.0.1")
    assert (ticket.address, ticket.port) == ("127.0.0.1", relay.port)
    assert open_ticket("127.0.0.1", echo.port).port == relay.port
    close_ticket(ticket)
    close_ticket(ticket)  # idempotent
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as conn:
        conn.sendall(ticket.token)
        conn.settimeout(5)
        assert conn.recv(1) == b""  # refused: the ticket is closed
    with pytest.raises(SandboxInvalidArgumentError):
        DriverRelay("localhost")
    with pytest.raises(SandboxInvalidArgumentError):
        relay.open(0)
