"""A TCP proxy in front of the Docker socket that a test can cut: a stand-in for an
engine (or a network path to it) that stops answering, without touching dockerd."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from types import TracebackType

from runtimes.reaper import wait_for_removals_blocking

DOCKER_SOCKET = "/var/run/docker.sock"
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


class EngineProxy:
    """``tcp://127.0.0.1:<port>`` forwarding to the local engine's unix socket.

    ``cut()`` closes every connection and refuses new ones (connection reset at once);
    ``hang()`` keeps accepting but forwards nothing (an engine that does not answer);
    ``restore()`` forwards again. Half-closes are forwarded, so exec stdin EOF works.
    """

    def __init__(self, target: str = DOCKER_SOCKET) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.mode = "forward"
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._closed = False

    @property
    def base_url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def __enter__(self) -> EngineProxy:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Sandboxes closed through this engine are removed in the background, through it.
        self.restore()
        wait_for_removals_blocking()
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self._drop_all()

    def cut(self) -> None:
        self.mode = "cut"
        self._drop_all()

    def hang(self) -> None:
        self.mode = "hang"
        self._drop_all()

    def restore(self) -> None:
        self.mode = "forward"

    def _drop_all(self) -> None:
        with self._lock:
            doomed = list(self._open)
            self._open.clear()
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _track(self, sock: socket.socket) -> None:
        with self._lock:
            self._open.add(sock)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "cut":
                # SO_LINGER on with a zero timeout: close() sends RST, "connection reset".
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
                client.close()
                continue
            self._track(client)
            if self.mode == "hang":
                continue
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                upstream.connect(self.target)
            except OSError:
                client.close()
                continue
            self._track(upstream)
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(256 * 1024)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                dst.sendall(data)
        except OSError:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_RDWR)
