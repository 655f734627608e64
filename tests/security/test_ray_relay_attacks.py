"""Attack class 23: the driver's relay of the ray route, spoken to by anything else on the
cluster network (``runtimes/ray/routes.py``).

The relay listens on the driver's cluster address, so every node can connect to it: other
tenants' processes, and a policy in a sandbox whose network reaches the driver. Only a
connection that opens with the token of an open ticket reaches the exposed port (the model
proxy). What an attacker without it must not get: a connection to the target, a hang of the
relay (a silent or slow preamble is dropped at the deadline), the relay's memory (it never
reads past the token's length before it verified it), or the route after it closed.

Every test runs its control first (a connection with the right token reaches the target),
asserts that the target saw no connection from the attack, and that the relay counted it
in ``refused``. No cluster: the relay listens on 127.0.0.1.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from runtimes.ray.routes import PREAMBLE_DEADLINE, TOKEN_BYTES, DriverRelay, RelayTicket

pytestmark = pytest.mark.attack(23)

DEADLINE = 0.5
"""The preamble deadline of the tests' relay (the default one is tested once)."""


class Target:
    """The exposed service: counts connections, answers ``ok`` + what it read first."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    @staticmethod
    def _one(conn: socket.socket) -> None:
        try:
            with conn:
                conn.sendall(b"ok " + conn.recv(100))
        except OSError:
            pass  # the attack's own connection: the test reads what the attacker saw

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def target() -> Iterator[Target]:
    service = Target()
    yield service
    service.close()


@pytest.fixture
def relay() -> Iterator[DriverRelay]:
    relay = DriverRelay("127.0.0.1", deadline=DEADLINE)
    yield relay
    relay.close()


def connect(relay: DriverRelay) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", relay.port), timeout=10)
    conn.settimeout(10)
    return conn


def ended(conn: socket.socket) -> str:
    """How the relay ended the connection: ``eof`` or ``reset`` (fails on data)."""
    try:
        data = conn.recv(1)
    except ConnectionResetError:
        return "reset"
    assert data == b"", f"the relay answered {data!r}"
    return "eof"


def control(relay: DriverRelay, target: Target, ticket: RelayTicket) -> None:
    """The path the attack uses is live: the right token reaches the target."""
    before = target.accepted
    with connect(relay) as conn:
        conn.sendall(ticket.token + b"hello")
        assert conn.recv(100) == b"ok hello"
    assert target.accepted == before + 1


def test_no_token(relay: DriverRelay, target: Target) -> None:
    ticket = relay.open(target.port)
    control(relay, target, ticket)
    with connect(relay):
        pass  # connects and leaves
    with connect(relay) as silent:  # connects and says nothing
        started = time.monotonic()
        assert ended(silent) in {"eof", "reset"}
        assert DEADLINE - 0.1 <= time.monotonic() - started < DEADLINE + 2
    _wait_refused(relay, 2)
    assert target.accepted == 1


def test_wrong_token(relay: DriverRelay, target: Target) -> None:
    ticket = relay.open(target.port)
    control(relay, target, ticket)
    wrong = bytes(b ^ 1 for b in ticket.token)  # every byte off by one bit
    last_wrong = ticket.token[:-1] + bytes([ticket.token[-1] ^ 0x80])
    for token in (wrong, last_wrong, b"\0" * TOKEN_BYTES):
        with connect(relay) as conn:
            started = time.monotonic()
            conn.sendall(token)
            assert ended(conn) in {"eof", "reset"}
            assert time.monotonic() - started < DEADLINE  # at once, not at the deadline
    assert relay.refused == 3
    assert target.accepted == 1


def test_token_one_byte_short_then_silence_is_dropped_at_the_deadline(target: Target) -> None:
    relay = DriverRelay("127.0.0.1")  # the default deadline
    try:
        ticket = relay.open(target.port)
        control(relay, target, ticket)
        with connect(relay) as conn:
            conn.sendall(ticket.token[:-1])
            started = time.monotonic()
            assert ended(conn) in {"eof", "reset"}
            waited = time.monotonic() - started
        assert PREAMBLE_DEADLINE - 0.2 <= waited < PREAMBLE_DEADLINE + 2
        assert relay.refused == 1
        assert target.accepted == 1
    finally:
        relay.close()


def test_bytes_past_the_preamble_are_never_read_before_the_token_is_verified(
    relay: DriverRelay, target: Target
) -> None:
    """The relay reads exactly the token's length and stops: what the attacker sent past
    it is still unread when the relay closes the connection, so the kernel resets it
    (a relay that read ahead would have drained it and closed cleanly)."""
    ticket = relay.open(target.port)
    control(relay, target, ticket)
    with connect(relay) as conn:
        conn.sendall(b"x" * TOKEN_BYTES + b"y" * 4000)  # one segment on loopback
        assert ended(conn) == "reset"
    assert relay.refused == 1
    assert target.accepted == 1


def test_a_flood_without_a_token_is_cut_off(relay: DriverRelay, target: Target) -> None:
    ticket = relay.open(target.port)
    control(relay, target, ticket)
    with connect(relay) as conn:
        started = time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for _ in range(4096):  # 256 MiB at most: far past any socket buffer
                conn.sendall(b"z" * (64 << 10))
        assert time.monotonic() - started < 10
    assert relay.refused == 1
    assert target.accepted == 1
    control(relay, target, ticket)  # and the route still serves


def test_the_token_of_a_closed_ticket(relay: DriverRelay, target: Target) -> None:
    ticket = relay.open(target.port)
    other = relay.open(target.port)
    control(relay, target, ticket)
    relay.close_ticket(ticket)
    relay.close_ticket(ticket)  # idempotent
    with connect(relay) as conn:
        conn.sendall(ticket.token)
        assert ended(conn) in {"eof", "reset"}
    assert relay.refused == 1
    assert target.accepted == 1
    control(relay, target, other)  # another ticket of the same port is its own


def test_connections_waiting_for_a_token_are_bounded(target: Target) -> None:
    """Past ``max_pending`` silent connections the relay closes new ones at once (no
    descriptor or task per attacker connection without bound); once the silent ones hit
    the deadline the route serves again."""
    relay = DriverRelay("127.0.0.1", deadline=DEADLINE, max_pending=4)
    try:
        ticket = relay.open(target.port)
        control(relay, target, ticket)
        silent = [connect(relay) for _ in range(4)]
        time.sleep(0.1)  # accepted: each waits for its token
        with connect(relay) as extra:
            started = time.monotonic()
            assert ended(extra) in {"eof", "reset"}
            assert time.monotonic() - started < DEADLINE
        for conn in silent:
            assert ended(conn) in {"eof", "reset"}
            conn.close()
        _wait_refused(relay, 5)
        control(relay, target, ticket)
        assert target.accepted == 2
    finally:
        relay.close()


def _wait_refused(relay: DriverRelay, count: int) -> None:
    deadline = time.monotonic() + 5
    while relay.refused < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert relay.refused == count
