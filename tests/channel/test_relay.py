"""The channel's relay: a listener on the sandbox's loopback whose connections reach a host
port over the channel (``Runtime.expose_host(port)``, route ``channel``), in Docker
containers without any network (``network="none"``: the channel is the only way out)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import anyio.to_thread
import pytest

from runtimes import SandboxTransportError
from runtimes.base import Runtime
from runtimes.channel import MAX_RELAYED, RELAY_WINDOW
from runtimes.errors import HostRouteError
from runtimes.pytest_plugin import DockerRuntimeFactory

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


class HostService:
    """A TCP service on the host's loopback, one thread per connection running ``handle``."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.handle = handle
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.done = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            self.handle(conn)

    def close(self) -> None:
        self.done.set()
        self.sock.close()


def echo(conn: socket.socket) -> None:
    """Echo until the client half-closes, then half-close too."""
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)


@pytest.fixture
def service() -> Iterator[Callable[[Callable[[socket.socket], None]], HostService]]:
    made: list[HostService] = []

    def make(handle: Callable[[socket.socket], None]) -> HostService:
        made.append(HostService(handle))
        return made[-1]

    yield make
    for one in made:
        one.close()


@pytest.fixture
async def sandbox(docker_runtime_factory: DockerRuntimeFactory) -> AsyncIterator[Runtime]:
    async with docker_runtime_factory() as rt:  # network="none": no route but the channel
        yield rt


CLIENTS = r"""
import hashlib, os, socket, sys, threading
port, count, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
results = {}
def client(i):
    data = (bytes([i]) * 997 + os.urandom(3)) * (size // 1000)
    s = socket.create_connection(("127.0.0.1", port))
    sender = threading.Thread(target=lambda: (s.sendall(data), s.shutdown(socket.SHUT_WR)))
    sender.start()
    got = hashlib.sha256()
    while chunk := s.recv(65536):
        got.update(chunk)
    sender.join()
    results[i] = got.hexdigest() == hashlib.sha256(data).hexdigest()
threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
[t.start() for t in threads]
[t.join() for t in threads]
print(sum(results.values()))
"""


CONNECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 5)"


async def test_concurrent_connections_carry_every_byte_both_ways(
    sandbox: Runtime, service: Callable[[Callable[[socket.socket], None]], HostService]
) -> None:
    assert sandbox.host_routes() == ("channel",)
    host = service(echo)
    route = await sandbox.expose_host(host.port)
    assert (route.via, route.host) == ("channel", "127.0.0.1")
    # 8 clients at once, each 4x the relay's window both ways: the windows are reopened
    # by acknowledgements, the bytes of one connection never mix with another's
    size = 4 * RELAY_WINDOW
    result = await sandbox.exec(
        ["python3", "-c", CLIENTS, str(route.port), "8", str(size)], timeout=60
    )
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip() == "8"
    await route.close()
    refused = await sandbox.exec(["python3", "-c", CONNECT, str(route.port)], timeout=30)
    assert refused.exit_code != 0 and "ConnectionRefusedError" in refused.stderr


async def test_a_client_that_does_not_read_pushes_back_on_the_host_service(
    sandbox: Runtime, service: Callable[[Callable[[socket.socket], None]], HostService]
) -> None:
    sent = [0]

    def flood(conn: socket.socket) -> None:
        conn.settimeout(20)
        block = b"x" * 65536
        try:
            while sent[0] < 512 * 1024 * 1024:
                conn.sendall(block)
                sent[0] += len(block)
        except OSError:
            return

    host = service(flood)
    route = await sandbox.expose_host(host.port)
    idle = (
        f"import socket,time; s=socket.create_connection(('127.0.0.1',{route.port})); time.sleep(3)"
    )
    result = await sandbox.exec(["python3", "-c", idle], timeout=30)
    assert result.exit_code == 0, result.stderr
    # what left the service sits in a window of the relay and in kernel socket buffers:
    # megabytes, not the 512 MiB it tried (the host holds at most the window per direction)
    assert 0 < sent[0] < 32 * 1024 * 1024, sent[0]
    await route.close()


async def test_connections_beyond_the_bound_are_closed_at_once(
    sandbox: Runtime, service: Callable[[Callable[[socket.socket], None]], HostService]
) -> None:
    host = service(echo)
    route = await sandbox.expose_host(host.port)
    script = f"""
import socket, time
held = [socket.create_connection(("127.0.0.1", {route.port})) for _ in range({MAX_RELAYED})]
for s in held:  # every held connection is relayed: an echo comes back
    s.sendall(b"ping"); assert s.recv(4) == b"ping"
extra = socket.create_connection(("127.0.0.1", {route.port}))
started = time.monotonic()
try:
    extra.sendall(b"ping")
    answer = extra.recv(4)
except OSError:
    answer = b""
print(repr(answer), round(time.monotonic() - started, 1))
"""
    result = await sandbox.exec(["python3", "-c", script], timeout=60)
    assert result.exit_code == 0, result.stderr
    answer, seconds = result.stdout.split()
    assert answer == "b''" and float(seconds) < 5, result.stdout
    await route.close()


async def test_a_dead_relay_fails_fast_inside_and_is_typed_on_the_host(
    sandbox: Runtime, service: Callable[[Callable[[socket.socket], None]], HostService]
) -> None:
    host = service(echo)
    route = await sandbox.expose_host(host.port)
    assert route.lost() is None
    route.check()
    agent = sandbox.channel_info.agent_pid  # type: ignore[attr-defined]
    with pytest.raises(SandboxTransportError):
        await sandbox.exec(["kill", "-9", str(agent)], timeout=30)  # the agent is its parent
    assert route.lost() is not None
    with pytest.raises(HostRouteError, match="stopped"):
        route.check()
    started = time.monotonic()
    refused = await sandbox.exec(["python3", "-c", CONNECT, str(route.port)], timeout=30)
    assert refused.exit_code != 0 and "ConnectionRefusedError" in refused.stderr
    assert time.monotonic() - started < 10
    await route.close()


async def test_closing_the_runtime_closes_relayed_connections(
    docker_runtime_factory: DockerRuntimeFactory,
    service: Callable[[Callable[[socket.socket], None]], HostService],
) -> None:
    connected, ended = threading.Event(), threading.Event()

    def wait_for_end(conn: socket.socket) -> None:
        connected.set()
        conn.settimeout(30)
        try:
            while conn.recv(65536):
                pass
        except OSError:
            pass
        ended.set()

    host = service(wait_for_end)
    async with docker_runtime_factory() as rt:
        route = await rt.expose_host(host.port)
        script = (
            f"import socket,time; s=socket.create_connection(('127.0.0.1',{route.port})); "
            "s.sendall(b'hi'); time.sleep(300)"
        )
        await rt.exec(["sh", "-c", f'python3 -c "{script}" >/dev/null 2>&1 &'], timeout=30)
        with anyio.fail_after(10):
            await anyio.to_thread.run_sync(connected.wait)
        assert not ended.is_set()
    # the client still sleeps in its (removed) container; the host's side was closed
    assert ended.wait(10), "the host side of a relayed connection outlived the runtime"
    assert route.lost() is not None
