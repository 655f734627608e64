"""Attack classes 3, 7 and 10: the channel's relay (``docs/channel.md``, "Relay").

The relay's listener is on the sandbox's loopback, so any code in the sandbox can connect to
it: that is how an installed agent reaches the model proxy. What that code must not get:

10. (sandbox code at the policy's privilege) host memory without bound — a client floods the
    relay while the host's service does not read, or opens far more connections than the
    bound —, or a connection to any host port but the exposed one.
3.  The channel spoken for through the relay: relayed bytes shaped as the agent's frames
    (exits, file chunks, relay frames for other connections) are never parsed as frames.
7.  A replaced agent (a test double: the real agent plus a patch, started by the host like
    the real one, so it holds the key) sends relayed bytes past the window, or acknowledges
    bytes the host never sent: the channel is marked tampered (typed, logged), the route
    reports it, the plain path serves.
10. The same double announces connections of listeners that do not exist: the host connects
    nowhere.

Every attack runs its control first (the path it uses is live), and each test fails if the
defence it names is taken away.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest

import runtimes.channel.bootstrap as channel
from runtimes import open_runtime
from runtimes.channel import MAX_RELAYED
from runtimes.channel.agent import wire as agent
from runtimes.errors import ChannelTamperedError, HostRouteError
from tests.reliability.memory_child import _reset_peak, _status_kib

from .conftest import Hostile
from .test_channel import _forged_frames

pytestmark = pytest.mark.anyio


class Service:
    """A TCP service on the host's loopback: ``handle`` runs in a thread per connection;
    counts connections (in all, and at most at once)."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self.handle = handle
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.accepted = 0
        self.open = 0
        self.most_at_once = 0
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
                self.most_at_once = max(self.most_at_once, self.open)
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            with conn:
                self.handle(conn)
        except OSError:
            pass
        finally:
            with self.lock:
                self.open -= 1

    def close(self) -> None:
        self.sock.close()


def echo(conn: socket.socket) -> None:
    """Echo until the client half-closes, then half-close too."""
    conn.settimeout(60)
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)


@pytest.fixture
def service() -> Iterator[Callable[[Callable[[socket.socket], None]], Service]]:
    made: list[Service] = []

    def make(handle: Callable[[socket.socket], None]) -> Service:
        made.append(Service(handle))
        return made[-1]

    yield make
    for one in made:
        one.close()


ServiceFactory = Callable[[Callable[[socket.socket], None]], Service]

ECHO_ONCE = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 10)
s.settimeout(30)
s.sendall(sys.argv[2].encode())
s.shutdown(socket.SHUT_WR)
got = b""
while chunk := s.recv(65536):
    got += chunk
print(got.decode())
"""


async def echo_once(rt: Any, port: int, message: str, user: str | None = None) -> str:
    """What the exposed echo service answered a client in the sandbox (the path is live)."""
    result = await rt.exec(["python3", "-c", ECHO_ONCE, str(port), message], user=user, timeout=60)
    assert result.exit_code == 0, result.stderr
    return str(result.stdout.strip())


# ---------------------------------------------------------------------- class 10: memory

FLOOD = r"""
import json, socket, sys
port, total = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port), 10)
s.settimeout(2)
block = b"f" * 65536
sent, stalled = 0, None
while sent < total:
    try:
        sent += s.send(block[: total - sent])
    except TimeoutError:
        if stalled is None:  # two seconds without room: the relay pushed back
            stalled = sent
            s.settimeout(60)
s.shutdown(socket.SHUT_WR)
s.settimeout(60)
answer = b""
while chunk := s.recv(100):
    answer += chunk
print(json.dumps({"stalled": stalled, "sent": sent, "service_got": int(answer or 0)}))
"""
FLOOD_TOTAL = 64 * 1024 * 1024
SERVICE_PAUSE = 6.0
"""The host's service reads nothing for this long (the client floods meanwhile), then
reads everything."""


@pytest.mark.attack(10)
@pytest.mark.parametrize("hostile", ["docker-user"], indirect=True)
async def test_a_client_flooding_the_relay_is_pushed_back_not_buffered_on_the_host(
    hostile: Hostile, service: ServiceFactory
) -> None:
    def slow_then_count(conn: socket.socket) -> None:
        time.sleep(SERVICE_PAUSE)
        conn.settimeout(60)
        got = 0
        while data := conn.recv(1024 * 1024):
            got += len(data)
        conn.sendall(str(got).encode())

    host = service(slow_then_count)
    rt: Any
    async with open_runtime(hostile.config) as rt:
        route = await rt.expose_host(host.port)
        await rt.exec(["true"], user=hostile.user)  # the policy's account exists before we measure
        _reset_peak()
        rss = _status_kib("VmRSS")
        result = await rt.exec(
            ["python3", "-c", FLOOD, str(route.port), str(FLOOD_TOTAL)],
            user=hostile.user,
            timeout=180,
        )
        growth = (_status_kib("VmHWM") - rss) * 1024
        await route.close()
    assert result.exit_code == 0, result.stderr
    outcome = json.loads(result.stdout)
    # Control: the flood is live: every byte of it reached the host's service once it read.
    assert outcome["sent"] == outcome["service_got"] == FLOOD_TOTAL, outcome
    # While the service did not read, the client could place only the relay's window and
    # the kernels' socket buffers (megabytes), not its 64 MiB: it was pushed back.
    assert outcome["stalled"] is not None and outcome["stalled"] < 24 * 1024 * 1024, outcome
    assert growth < 32 * 1024 * 1024, (growth, outcome)
    print(f"\nrelay flood: blocked after {outcome['stalled']} bytes, host peak +{growth} bytes")


MANY = r"""
import json, socket, sys, time
port, count = int(sys.argv[1]), int(sys.argv[2])
held, answered, refused = [], 0, 0
started = time.monotonic()
for _ in range(count):
    try:
        s = socket.create_connection(("127.0.0.1", port), 10)
        s.settimeout(10)
        s.sendall(b"ping")
        ok = s.recv(4) == b"ping"
    except OSError:
        ok = False
    if ok:
        answered += 1
        held.append(s)  # kept open: the relay holds it
    else:
        refused += 1
seconds = time.monotonic() - started
for s in held:
    s.close()
after, deadline = b"", time.monotonic() + 20
while after != b"ping" and time.monotonic() < deadline:  # the bound frees up again
    time.sleep(0.2)
    try:
        s = socket.create_connection(("127.0.0.1", port), 10)
        s.settimeout(10)
        s.sendall(b"ping")
        after = s.recv(4)
        s.close()
    except OSError:
        pass
print(json.dumps({"answered": answered, "refused": refused, "seconds": seconds,
                  "after": after.decode()}))
"""


@pytest.mark.attack(10)
@pytest.mark.parametrize("hostile", ["docker-user"], indirect=True)
async def test_many_connections_are_bounded_on_the_host(
    hostile: Hostile, service: ServiceFactory
) -> None:
    host = service(echo)
    rt: Any
    async with open_runtime(hostile.config) as rt:
        route = await rt.expose_host(host.port)
        result = await rt.exec(
            ["python3", "-c", MANY, str(route.port), "200"], user=hostile.user, timeout=120
        )
        await route.close()
    assert result.exit_code == 0, result.stderr
    outcome = json.loads(result.stdout)
    # Control: the connections are live (the first MAX_RELAYED are relayed and echo).
    assert outcome["answered"] == MAX_RELAYED, outcome
    # Beyond the bound they are closed at once (not queued, not relayed)...
    assert outcome["refused"] == 200 - MAX_RELAYED and outcome["seconds"] < 60, outcome
    # ... so the host never holds more (each relayed connection is one to its service,
    # with a window per direction and two threads).
    assert host.most_at_once == MAX_RELAYED, host.most_at_once
    # Closed connections free their place: the policy cannot jam the relay for good.
    assert outcome["after"] == "ping", outcome


# ---------------------------------------------------------------------- class 10: other ports

ESCAPE = r"""
import json, socket, struct, sys
relay, secret = int(sys.argv[1]), int(sys.argv[2])
out = {}
def direct(host, port):
    try:
        socket.create_connection((host, port), 3).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__
out["direct"] = [direct("127.0.0.1", secret), direct("172.17.0.1", secret)]
asks = [
    b"CONNECT 127.0.0.1:%d HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (secret, secret),
    b"GET http://127.0.0.1:%d/ HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % (secret, secret),
    b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + struct.pack(">H", secret),
    # the agent's own LISTEN frame, naming the secret port (as a relayed byte string)
    struct.pack(">BII", 9, 7, 10) + struct.pack(">IIH", 1, 65536, secret) + bytes(16),
]
echoed = []
for ask in asks:
    s = socket.create_connection(("127.0.0.1", relay), 10)
    s.settimeout(30)
    s.sendall(ask)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    echoed.append(got == ask)
out["echoed"] = echoed
print(json.dumps(out))
"""


@pytest.mark.attack(10)
@pytest.mark.parametrize("hostile", ["docker-user"], indirect=True)
async def test_the_relay_reaches_the_exposed_port_only(
    hostile: Hostile, service: ServiceFactory
) -> None:
    exposed = service(echo)
    secret = service(echo)  # another service on the host's loopback: must stay unreachable
    with socket.create_connection(("127.0.0.1", secret.port), 5):
        pass  # Control: the secret service is live from the host
    with anyio.fail_after(5):
        while secret.accepted != 1:  # noqa: ASYNC110 - the service's thread counts it
            await anyio.sleep(0.01)
    rt: Any
    async with open_runtime(hostile.config) as rt:
        route = await rt.expose_host(exposed.port)
        result = await rt.exec(
            ["python3", "-c", ESCAPE, str(route.port), str(secret.port)],
            user=hostile.user,
            timeout=90,
        )
        await route.close()
    assert result.exit_code == 0, result.stderr
    outcome = json.loads(result.stdout)
    # Every ask went through the relay to the exposed service, as opaque bytes (echoed
    # back whole); none of them reached the secret one, nor did a direct connection.
    assert outcome["echoed"] == [True] * 4, outcome
    assert exposed.accepted == 4, exposed.accepted
    assert secret.accepted == 1, outcome
    assert all(d != "connected" for d in outcome["direct"]), outcome


# ---------------------------------------------------------------------- class 3


FORGE = r"""
import socket, sys
port = int(sys.argv[1])
forged = sys.stdin.buffer.read()
s = socket.create_connection(("127.0.0.1", port), 10)
s.settimeout(60)
import threading
threading.Thread(target=lambda: (s.sendall(forged), s.shutdown(socket.SHUT_WR))).start()
got = bytearray()
while chunk := s.recv(1 << 20):
    got += chunk
print("intact" if bytes(got) == forged else "changed %d of %d" % (len(got), len(forged)))
"""


def _forged_relay_frames() -> bytes:
    """Relay frames an impostor would inject for other connections (ids with the relay bit):
    openings, data, acknowledgements past any window, closes."""
    frames = []
    for n in range(1, 65):
        cid = agent.RELAY_BIT | n
        for kind, payload in (
            (agent.OPENED, agent.U32.pack(n)),
            (agent.R_DATA, b"FORGED" * 100),
            (agent.R_ACK, agent.U32.pack(0xFFFFFFFF)),
            (agent.R_EOF, b""),
            (agent.R_CLOSE, b""),
        ):
            frames.append(agent.HEADER.pack(kind, cid, len(payload)) + payload + bytes(agent.TAG))
    return b"".join(frames)


@pytest.mark.attack(3)
@pytest.mark.parametrize("hostile", ["docker-user"], indirect=True)
async def test_relayed_bytes_are_never_parsed_as_frames(
    hostile: Hostile, service: ServiceFactory
) -> None:
    forged = (_forged_frames() + _forged_relay_frames()) * 2
    host = service(echo)
    rt: Any
    async with open_runtime(hostile.config) as rt:
        route = await rt.expose_host(host.port)
        # another relayed connection, open meanwhile: forged relay frames must not touch it
        assert await echo_once(rt, route.port, "before", hostile.user) == "before"
        await rt.write("/tmp/vf-relay-small", b"s" * 3000)
        wrong: list[str] = []
        relayed: dict[str, str] = {}

        async def forge() -> None:
            result = await rt.exec(
                ["python3", "-c", FORGE, str(route.port)],
                stdin=forged,
                user=hostile.user,
                timeout=120,
            )
            relayed["result"] = result.stdout.strip() or result.stderr

        async def load() -> None:
            for i in range(40):
                if i % 2:
                    code = (await rt.exec(["sh", "-c", "exit 7"], user=hostile.user)).exit_code
                    if code != 7:
                        wrong.append(f"exit {code}")
                elif await rt.read("/tmp/vf-relay-small") != b"s" * 3000:
                    wrong.append("read")

        async with anyio.create_task_group() as tg:
            tg.start_soon(forge)
            tg.start_soon(load)
        # Control: the forged frames crossed the channel twice (in the relay's payloads),
        # byte for byte.
        assert relayed["result"] == "intact", relayed
        assert not wrong, wrong
        assert rt.channel_info.state == "running", rt.channel_info
        assert await echo_once(rt, route.port, "after", hostile.user) == "after"
        await route.close()


# ---------------------------------------------------------------------- a replaced agent

HOSTILE_PATCH = """
_vf_pump_out = Conn.pump_out


def _vf_hostile_pump_out(self):
    try:
        head = self.sock.recv(64, socket.MSG_PEEK)
    except OSError:
        head = b""
    if head.startswith(b"VF-OVER-WINDOW"):
        chunk = b"w" * RELAY_CHUNK
        for _ in range({flood_frames}):  # never waits for the host's acknowledgement
            if self.out.broken:
                return
            self.out.send(R_DATA, self.cid, chunk)
        return
    if head.startswith(b"VF-BOGUS-ACK"):
        self.out.send(R_ACK, self.cid, U32.pack(1))  # the host sent nothing yet
    if head.startswith(b"VF-SHORT-ACK"):
        self.out.send(R_ACK, self.cid, b"\\x00\\x01")  # not a u32
    if head.startswith(b"VF-OPEN-ELSEWHERE"):
        for listener in {listener_ids}:
            if isinstance(self.listener.agent.requests.get(listener), Listener):
                continue  # a real listener's connection would be relayed: by design
            self.listener.agent.next_conn += 1
            cid = RELAY_BIT | (self.listener.agent.next_conn + 0x100000)
            self.out.send(OPENED, cid, U32.pack(listener))
            self.out.send(R_DATA, cid, b"GET / HTTP/1.0\\r\\n\\r\\n")
    return _vf_pump_out(self)


Conn.pump_out = _vf_hostile_pump_out
"""


def hostile_source(secret_port: int) -> bytes:
    """The real agent, patched: on a client's trigger word its relay misbehaves."""
    real = channel.agent_source()[10:].decode()
    anchor = 'if __name__ in ("__main__", "__vf_sandbox_agent__"):'
    assert anchor in real
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 8, 0x7FFFFFFF, 0xFFFFFFFF, secret_port]
    patch = HOSTILE_PATCH.format(flood_frames=512, listener_ids=ids)
    source = real.replace(anchor, patch + "\n\n" + anchor).encode()
    return b"%010d" % len(source) + source


TRIGGER = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 10)
s.settimeout(30)
s.sendall(sys.argv[2].encode())
try:
    print(s.recv(100))
except OSError as exc:
    print(type(exc).__name__)
"""


@pytest.mark.attack(7)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
@pytest.mark.parametrize("trigger", ["VF-OVER-WINDOW", "VF-BOGUS-ACK", "VF-SHORT-ACK"])
async def test_a_replaced_agent_breaking_the_window_is_tampering(
    hostile: Hostile,
    trigger: str,
    service: ServiceFactory,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = threading.Event()

    def echo_or_stall(conn: socket.socket) -> None:
        """Echoes a plain message; reads nothing after a trigger (so relayed bytes pile up
        on the host if the agent ignores its window)."""
        conn.settimeout(60)
        first = conn.recv(64)
        if first != b"hello":
            stop.wait(60)
            return
        conn.sendall(first)

    host = service(echo_or_stall)
    source = hostile_source(0)
    monkeypatch.setattr(channel, "agent_source", lambda: source)
    caplog.set_level(logging.ERROR, logger="runtimes.channel")
    rt: Any
    try:
        async with open_runtime(hostile.config) as rt:
            route = await rt.expose_host(host.port)
            # Control: the double relays honestly until triggered.
            plain = await rt.exec(["python3", "-c", TRIGGER, str(route.port), "hello"], timeout=60)
            assert plain.stdout.strip() == "b'hello'", plain
            assert rt.channel_info.state == "running"
            with pytest.raises(ChannelTamperedError):
                await rt.exec(["python3", "-c", TRIGGER, str(route.port), trigger], timeout=60)
            info = rt.channel_info
            expected = {
                "VF-OVER-WINDOW": "window",
                "VF-BOGUS-ACK": "never sent",
                "VF-SHORT-ACK": "malformed",
            }[trigger]
            assert info.state == "distrusted" and expected in (info.reason or ""), info
            assert any(expected in r.getMessage() for r in caplog.records), caplog.records
            assert route.lost() is not None and expected in (route.lost() or "")
            with pytest.raises(HostRouteError, match=expected):
                route.check()
            with pytest.raises(HostRouteError):  # no relay without a trusted channel
                await rt.expose_host(host.port)
            # the plain path serves, exactly
            assert (await rt.exec(["sh", "-c", "echo after; exit 7"])).exit_code == 7
    finally:
        stop.set()


@pytest.mark.attack(10)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
async def test_a_replaced_agent_cannot_open_connections_elsewhere(
    hostile: Hostile, service: ServiceFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    exposed = service(echo)
    secret = service(echo)
    source = hostile_source(secret.port)
    monkeypatch.setattr(channel, "agent_source", lambda: source)
    rt: Any
    async with open_runtime(hostile.config) as rt:
        route = await rt.expose_host(exposed.port)
        # The double announces connections of listeners that do not exist (request ids of
        # nothing, of no listener, the secret service's port), then relays its own trigger.
        said = await rt.exec(
            ["python3", "-c", TRIGGER, str(route.port), "VF-OPEN-ELSEWHERE"], timeout=60
        )
        assert said.exit_code == 0, said
        await anyio.sleep(1)  # the host would have connected by now
        # Control: the triggering connection itself was relayed (echoed, half-closed later).
        assert "VF-OPEN-ELSEWHERE" in said.stdout, said
        assert exposed.accepted == 1, exposed.accepted
        assert secret.accepted == 0
        assert rt.channel_info.state == "running"
        assert await echo_once(rt, route.port, "still") == "still"
        await route.close()
