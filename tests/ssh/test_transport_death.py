"""A transport that dies under calls in flight: each of them fails at once, typed, and the
runtime carries on with a fresh connection.

The transport is killed three ways, on both exec paths (plain channels, channel agent):

* ``shutdown``: the socket under paramiko is shut down (the peer vanished, the socket was
  closed under it);
* ``steal``: a few inbound bytes are read off the socket behind paramiko's back, which
  desynchronises the stream: paramiko fails with "Invalid packet blocking" or a MAC
  mismatch, the failure seen under load when another thread read from a reused descriptor;
  or (1 time in 16) it decodes a block-aligned garbage length;
* ``flip``: that garbage length, every time: the top bit of the next packet's length is
  flipped on the wire (a stream cipher, so the plaintext length flips with it), a length of
  over 2 GiB. paramiko alone waits for those bytes, and while the streaming command's output
  keeps arriving its socket never times out, so no keepalive notices (the steal case failed
  CI that way, with the transport still up 15 s later): the runtime refuses any packet longer
  than a server sends;
* ``blackhole``: every inbound byte is lost from then on while the TCP connection stays up
  (a silent network drop, a wedged server; and what the garbage-length wait looks like):
  only keepalives that ask for an answer notice it.

Every exec in flight must raise ``SandboxTransportError`` within seconds (a watchdog far below
the calls' own timeouts), never wait for its timeout; a read in flight (idempotent) may
instead reconnect and return the exact bytes. Afterwards read, exists and exec work again on
the same runtime.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import anyio
import anyio.to_thread
import pytest

from runtimes import SandboxTransportError, open_runtime
from runtimes.ssh import SSHRuntime
from tests.ssh.sshd import SSHServer

pytestmark = pytest.mark.anyio

BIG = 64 * 1024 * 1024
"""Big enough that an SFTP read of it is still running when the transport dies."""

CALL_TIMEOUT = 120.0
"""The calls' own timeout: far above the watchdog, so only a prompt failure passes."""

WATCHDOG = 30.0

Kill = Literal["shutdown", "steal", "flip", "blackhole"]

BLOCK = 16
"""The cipher's block: paramiko reads a packet's first block (its length) alone."""


class _Thief:
    """paramiko's socket, with inbound bytes taken away once armed: 7 bytes of one chunk
    (``steal``: what a stale read elsewhere in the process does to it), the top bit of a
    packet's length (``flip``), or everything from then on (``blackhole``: the connection
    stays up, nothing arrives)."""

    def __init__(self, sock: socket.socket, how: Kill) -> None:
        self._sock = sock
        self._how = how
        self.stolen = False

    def recv(self, size: int) -> bytes:
        data = self._sock.recv(size)
        if self._how == "blackhole" and data:
            self.stolen = True
            raise TimeoutError  # what paramiko's 0.1 s socket timeout raises: nothing came
        if self._how == "flip":
            if not self.stolen and size == BLOCK and data:
                self.stolen = True
                return bytes([data[0] ^ 0x80]) + data[1:]
            return data
        if not self.stolen and len(data) > 7:
            self.stolen = True
            return data[7:]
        return data

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def _kill_transport(rt: SSHRuntime, how: Kill) -> None:
    """Kill the live transport of ``rt`` underneath paramiko (blocking; run in a thread)."""
    conn = rt.backend._conn
    assert conn is not None and conn.usable()
    if how != "shutdown":
        # Output keeps arriving from the streaming exec: the next chunk loses its bytes.
        packetizer = conn.transport.packetizer
        thief = _Thief(packetizer._Packetizer__socket, how)  # type: ignore[attr-defined]
        packetizer._Packetizer__socket = thief  # type: ignore[attr-defined]
        deadline = time.monotonic() + WATCHDOG / 2
        while conn.transport.is_active() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thief.stolen and not conn.transport.is_active(), "paramiko read on"
        if how == "flip":
            assert "the stream is corrupt" in str(conn.transport.saved_exception)
        return
    # A second descriptor of the same socket: the test acts on the socket without touching
    # the object paramiko holds.
    sock = socket.socket(fileno=os.dup(conn.transport.sock.fileno()))
    try:
        sock.shutdown(socket.SHUT_RDWR)
    finally:
        sock.close()


async def _outcome(call: Callable[[], Awaitable[object]]) -> object:
    try:
        return await call()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


# paramiko's SFTP prefetch thread of the read in flight dies with an EOFError when the
# transport does; the read itself surfaces the typed error (or retries).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("how", ["shutdown", "steal", "flip", "blackhole"])
@pytest.mark.parametrize("channel", [False, True], ids=["plain", "channel"])
async def test_calls_in_flight_fail_at_once_then_the_runtime_reconnects(
    sshd: SSHServer, channel: bool, how: Kill
) -> None:
    # A keepalive asking for an answer after 1 s without traffic; the second unanswered one
    # declares the connection dead (the defaults: 15 s, 3).
    config = sshd.config(
        channel=channel, max_channels=14, keepalive_interval=1, keepalive_count_max=2
    )
    async with open_runtime(config) as rt:
        assert isinstance(rt, SSHRuntime)
        made = await rt.exec(["sh", "-c", f"head -c {BIG} /dev/urandom > big.bin"], timeout=120)
        assert made.exit_code == 0, made
        expected = await rt.read("big.bin", max_bytes=BIG)
        await rt.write("small.txt", b"small")
        streaming = anyio.Event()

        def on_output(stream: object, data: bytes) -> None:
            streaming.set()

        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "sleep": lambda: rt.exec(["sleep", "300"], timeout=CALL_TIMEOUT),
            "sleep2": lambda: rt.exec(["sh", "-c", "sleep 300"], timeout=CALL_TIMEOUT),
            "stream": lambda: rt.exec(
                ["sh", "-c", "while :; do echo tick; sleep 0.01; done"],
                timeout=CALL_TIMEOUT,
                on_output=on_output,
            ),
            # stdin the command does not read yet: the sender waits for window space
            "stdin": lambda: rt.exec(
                ["sh", "-c", "sleep 300; cat > /dev/null"],
                stdin=b"\0" * (BIG // 4),
                timeout=CALL_TIMEOUT,
            ),
            "read": lambda: rt.read("big.bin", max_bytes=BIG),
        }
        outcomes: dict[str, object] = {}

        async def run(name: str) -> None:
            outcomes[name] = await _outcome(calls[name])

        with anyio.fail_after(WATCHDOG):
            async with anyio.create_task_group() as tg:
                for name in calls:
                    tg.start_soon(run, name)
                await streaming.wait()
                await anyio.sleep(0.3)  # the other calls are under way too
                await anyio.to_thread.run_sync(_kill_transport, rt, how)

        for name in ("sleep", "sleep2", "stream", "stdin"):
            assert isinstance(outcomes[name], SandboxTransportError), (name, outcomes[name])
        # The read is idempotent: it failed the same way, or reconnected and got every byte.
        read = outcomes["read"]
        assert isinstance(read, SandboxTransportError) or read == expected, repr(read)[:200]

        # The same runtime carries on, on a new connection.
        with anyio.fail_after(WATCHDOG):
            assert await rt.read("small.txt") == b"small"
            assert await rt.exists("small.txt")
            result = await rt.exec(["echo", "again"])
            assert result.stdout == "again\n", result


async def test_a_closed_connection_ends_its_reader_thread(sshd: SSHServer) -> None:
    """Closing the runtime ends paramiko's reader thread and the TCP connection.

    With a blocking socket (the old code), ``close()`` left the idle transport's thread in
    ``recv()`` for ever: one thread, one TCP connection and one server session leaked per
    runtime closed, each still holding a socket whose descriptor number was already free
    for reuse.
    """
    async with open_runtime(sshd.config()) as rt:
        assert isinstance(rt, SSHRuntime)
        conn = rt.backend._conn
        assert conn is not None
        transport = conn.transport
        assert transport.is_alive()
    with anyio.fail_after(WATCHDOG):
        while transport.is_alive():
            await anyio.to_thread.run_sync(transport.join, 0.2)


async def test_the_socket_is_closed_by_its_reader_thread_or_after_it(
    sshd: SSHServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transport's socket is never closed while paramiko's reader thread may still call
    ``recv()`` on it: a close from another thread frees the descriptor number while the
    reader can sit between releasing the GIL and its ``recv()``, which then reads from the
    socket that reuses the number (under load: another SSH connection's bytes stolen,
    "Invalid packet blocking" there)."""
    async with open_runtime(sshd.config()) as rt:
        assert isinstance(rt, SSHRuntime)
        assert rt.backend._conn is not None
        transport = rt.backend._conn.transport
        sock = transport.sock
        safe: list[bool] = []
        real_close = socket.socket.close

        def close(self: socket.socket) -> None:
            if self is sock and self.fileno() != -1:
                reader = transport
                safe.append(threading.current_thread() is reader or not reader.is_alive())
            real_close(self)

        monkeypatch.setattr(socket.socket, "close", close)
        assert (await rt.exec(["echo", "hi"])).stdout == "hi\n"
    assert safe == [True]


async def test_an_idle_connection_whose_server_answers_its_keepalives_stays_up(
    sshd: SSHServer,
) -> None:
    """Keepalives ask for an answer and each answer counts: with one unanswered keepalive
    allowed, an idle connection to a live server outlives several keepalive intervals."""
    config = sshd.config(channel=False, keepalive_interval=1, keepalive_count_max=1)
    async with open_runtime(config) as rt:
        assert isinstance(rt, SSHRuntime)
        conn = rt.backend._conn
        assert conn is not None
        await anyio.sleep(4.5)
        assert conn.transport.is_active() and rt.backend._conn is conn
        assert (await rt.exec(["echo", "ok"])).stdout == "ok\n"
        assert rt.backend._conn is conn


async def test_a_control_command_left_unanswered_leaves_the_connection_to_its_calls(
    sshd: SSHServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a loaded host a kill's control channel can wait past its short deadline
    ("Timeout opening channel"). That is a slow server, not a dead connection (the
    keepalives say which): the control command fails typed, and the calls in flight on the
    connection carry on. Marked broken (the old code), the next call reconnected and closed
    the connection under all of them: a cancellation storm under load lost both SSH sandboxes'
    channel agents that way."""
    import paramiko

    import runtimes.ssh.connected as connected
    from runtimes.ssh.control import kill_script

    async with open_runtime(sshd.config()) as rt:
        assert isinstance(rt, SSHRuntime)
        conn = rt.backend._conn
        assert conn is not None
        outcome: dict[str, object] = {}

        async def run() -> None:
            outcome["exec"] = await _outcome(
                lambda: rt.exec(["sh", "-c", "sleep 2; echo through"], timeout=60)
            )

        def unanswered(*args: object) -> None:
            raise paramiko.SSHException("Timeout opening channel.")

        with anyio.fail_after(WATCHDOG):
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await anyio.sleep(0.5)
                with monkeypatch.context() as patch:
                    patch.setattr(connected, "run_control", unanswered)
                    with pytest.raises(SandboxTransportError):
                        await rt.backend._control(kill_script([12345]), timeout=0.5)
                assert await rt.exists("nothing-here") is False  # the next call
        result = outcome["exec"]
        assert not isinstance(result, BaseException), result
        assert result.stdout == "through\n"  # type: ignore[attr-defined]
        assert rt.backend._conn is conn and conn.usable()


async def test_an_sftp_call_cut_off_by_close_is_the_connections_failure(
    sshd: SSHServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close that lands while an SFTP call runs: the call fails typed, as the connection's
    failure, never as the server refusing that one operation.

    ``Connection.close`` closes the SFTP client first and then the transport; between the
    two, paramiko answers the call in flight with a bare ``OSError("Socket is closed")``
    while the transport is still up. Read with the table alone that is a refusal
    (``SandboxError``: what the soak found, once, in CI). Here the transport is held up for
    the whole call, so the window is always open."""
    import types

    async with open_runtime(sshd.config(channel=False)) as rt:
        assert isinstance(rt, SSHRuntime)
        await rt.write("f", b"x")
        conn = rt.backend._conn
        assert conn is not None
        # The transport part of close() does nothing while the call runs.
        monkeypatch.setattr(conn.transport, "sock", types.SimpleNamespace(shutdown=id))
        monkeypatch.setattr(conn.transport, "join", lambda *args: None)
        monkeypatch.setattr(conn.transport, "is_alive", lambda: True)

        def read_as_close_begins(sftp: object, path: str) -> object:
            conn.close()
            assert conn.transport.is_active()
            return sftp.stat(path)  # type: ignore[attr-defined]

        with pytest.raises(SandboxTransportError, match="connection failed during sftp"):
            await rt.backend._sftp_call(read_as_close_begins, rt.resolve_path("f"))
        monkeypatch.undo()
