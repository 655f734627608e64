"""Closing a Docker exec stream while a thread is inside it: the socket is shut down at once,
but its descriptor is released only once no call is inside it.

The channel agent's stream is read by the channel's reader thread and written by its writer
thread while ``close()`` comes from a third; a worker thread's ``recv()`` abandoned on
cancellation outlives ``aclose()`` of a TLS or ``ssh://`` stream. Closing the descriptor under
such a thread frees its number for the next socket the process opens, and the thread then
reads (or writes) that socket's bytes: another connection desynchronised. No engine needed:
the stream runs over a socket pair.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from runtimes.docker.agent import AgentStream
from runtimes.docker.stream import GuardedSocket, Hijacked

WATCHDOG = 10.0


class _Recording:
    """A socket that records whether a ``recv()`` was under way when it was closed."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.receiving = 0
        self.closed_while_receiving: int | None = None
        self.closed_on: str | None = None

    def recv(self, size: int) -> bytes:
        self.receiving += 1
        try:
            return self.sock.recv(size)
        finally:
            self.receiving -= 1

    def close(self) -> None:
        self.closed_while_receiving = self.receiving
        self.closed_on = threading.current_thread().name
        self.sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class _Response:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _wait_for(condition: Any) -> None:
    deadline = time.monotonic() + WATCHDOG
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_agent_stream_is_released_by_its_reader_after_close() -> None:
    ours, theirs = socket.socketpair()
    raw = _Recording(ours)
    response = _Response()
    stream = AgentStream(Hijacked("exec", response, raw, b""))  # type: ignore[arg-type]
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(stream.recv()), name="reader")
    reader.start()
    try:
        _wait_for(lambda: raw.receiving == 1)
        stream.close()  # from this thread, while the reader is inside recv()
        reader.join(WATCHDOG)
        assert not reader.is_alive(), "close() did not wake the reader"
        assert got == [b""]
        assert raw.closed_while_receiving == 0, "the descriptor was released under recv()"
        assert raw.closed_on == "reader"
        assert response.closed, "the HTTP response holding the connection is released too"
        assert stream.recv() == b"", "a read after close() never touches the descriptor"
    finally:
        theirs.close()


def test_a_guarded_socket_with_no_call_inside_is_released_at_once() -> None:
    ours, theirs = socket.socketpair()
    released: list[bool] = []
    guarded = GuardedSocket(ours, on_release=lambda: released.append(True))
    try:
        guarded.sendall(b"hello")
        assert theirs.recv(5) == b"hello"
        guarded.close()
        guarded.close()  # idempotent
        assert ours.fileno() == -1 and released == [True]
        assert theirs.recv(1) == b"", "the peer sees the end of the stream"
        assert guarded.recv(1) == b""
        with pytest.raises(OSError):
            guarded.sendall(b"late")
    finally:
        theirs.close()


def test_a_writer_blocked_in_sendall_fails_and_releases_after_close() -> None:
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    guarded = GuardedSocket(ours)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            guarded.sendall(b"x" * (8 * 1024 * 1024))  # the peer never reads: it blocks
        except OSError as exc:
            errors.append(exc)

    writer = threading.Thread(target=write, name="writer")
    writer.start()
    try:
        time.sleep(0.2)
        assert writer.is_alive(), "the write should be blocked on the full buffer"
        assert ours.fileno() != -1
        guarded.close()
        writer.join(WATCHDOG)
        assert not writer.is_alive(), "close() did not wake the writer"
        assert len(errors) == 1
        assert ours.fileno() == -1, "released by the writer on its way out"
    finally:
        theirs.close()


def test_engine_calls_do_not_scan_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """requests reads proxy settings from ``os.environ`` on every request unless told not to;
    iterating ``os.environ`` while another thread removes a variable raises ``KeyError``
    (seen: a removal in the reaper's thread during a test's monkeypatch teardown). The
    engine's client does not look."""
    import requests.sessions

    from runtimes.docker.client import client_for
    from runtimes.docker.config import DockerConfig

    def scanned(*args: object, **kwargs: object) -> object:
        raise KeyError("VF_TEST_GONE")

    client = client_for(DockerConfig(image="vf-sandbox/base:bookworm"))  # asks for the version
    monkeypatch.setattr(requests.sessions, "get_environ_proxies", scanned)
    assert client.api.ping() is True
    assert client.api.version()["ApiVersion"]
