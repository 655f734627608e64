"""A small threaded HTTP/1.1 server for the scripted endpoint and the model proxy.

It runs ``http.server.ThreadingHTTPServer`` in a daemon thread, so it serves while the
caller's event loop (asyncio or trio) is busy or blocked, and it needs no event loop of
its own. Handlers are plain functions ``(HTTPRequest) -> HTTPResponse``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self

log = logging.getLogger("harnesses.http")

MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True)
class HTTPRequest:
    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        for key, value in self.headers.items():
            if key.lower() == lowered:
                return value
        return None

    def bearer_token(self) -> str | None:
        value = self.header("Authorization") or ""
        scheme, _, token = value.partition(" ")
        return token.strip() if scheme.lower() == "bearer" and token.strip() else None


@dataclass(frozen=True)
class HTTPResponse:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


def json_response(
    status: int, payload: Any, headers: Mapping[str, str] | None = None
) -> HTTPResponse:
    merged = {"Content-Type": "application/json"}
    merged.update(headers or {})
    return HTTPResponse(status, json.dumps(payload).encode("utf-8"), merged)


def error_response(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    code: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> HTTPResponse:
    """An OpenAI-shaped error body: ``{"error": {"message", "type", "code"}}``."""
    return json_response(
        status, {"error": {"message": message, "type": kind, "code": code}}, headers
    )


Handler = Callable[[HTTPRequest], HTTPResponse]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], handler: Handler):
        self.handler = handler
        super().__init__(address, _RequestHandler)


class _RequestHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body go out in separate writes: without TCP_NODELAY, Nagle plus
    # delayed ACKs add ~40 ms to every keep-alive round trip.
    disable_nagle_algorithm = True
    server: _Server

    def do_POST(self) -> None:
        self._dispatch()

    def do_GET(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self._send(error_response(400, "missing or invalid Content-Length"))
            return
        body = self.rfile.read(length) if length else b""
        request = HTTPRequest(self.command, self.path, dict(self.headers.items()), body)
        try:
            response = self.server.handler(request)
        except Exception as exc:  # a handler bug must not kill the connection silently
            log.exception("handler failed for %s %s", self.command, self.path)
            response = error_response(500, f"internal error: {type(exc).__name__}: {exc}")
        self._send(response)

    def _send(self, response: HTTPResponse) -> None:
        self.send_response(response.status)
        for key, value in response.headers.items():
            if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        self.wfile.write(response.body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class LocalHTTPServer:
    """``handler`` served on ``host`` (a free port unless ``port`` is given), in a thread.

    Use as a context manager, or call :meth:`start` / :meth:`stop`.
    """

    def __init__(self, handler: Handler, *, host: str = "127.0.0.1", port: int = 0):
        self._handler = handler
        self._address = (host, port)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return int(self._server.server_address[1])

    def start(self) -> None:
        """Bind and start serving.

        Raises:
            OSError: the address cannot be bound.
        """
        if self._server is not None:
            return
        self._server = _Server(self._address, self._handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"vf-http-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
