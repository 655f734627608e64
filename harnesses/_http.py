"""The HTTP server of the scripted endpoint and the model proxy, built for hostile clients.

Every byte it reads may come from a sandbox, so it runs aiohttp's server (a maintained
HTTP/1.1 parser) with its limits set (:class:`ServerLimits`):

* the request line, each header and the number of headers are capped (aiohttp's parser
  answers ``400`` past them); request bodies are never decompressed;
* a connection that completes no request head within ``idle_timeout`` seconds (a
  slow-loris, or an idle keep-alive connection) is closed;
* connections are capped per client address and overall: one past a cap is answered
  ``503`` and closed at once, before anything of it is read;
* ``admit`` (when given) sees the request head (method, path, headers) *before* any of
  the body is read: a response from it (e.g. a ``401`` for a missing secret) is sent and
  the connection closed, the body never read;
* a body is read only up to ``max_body`` bytes (``413`` past it, announced or not, and the
  connection closed), within ``read_timeout`` seconds (``408``);
* handlers are plain functions ``(HTTPRequest) -> HTTPResponse`` run on a bounded pool of
  ``workers`` daemon threads (they may block: the gated proxy parks a request there until
  its completion is delivered).

The server runs its own event loop in a daemon thread, so it serves whatever the caller
does (asyncio, trio, or blocking code) and never depends on the caller's loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

log = logging.getLogger("harnesses.http")

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """What one :class:`LocalHTTPServer` lets its clients use. Defaults suit the model proxy.

    ``max_body``: bytes of one request body (``413`` past it). ``read_timeout``: seconds to
    receive a whole body (``408``). ``idle_timeout``: seconds a connection may go without
    completing a request head (idle keep-alive, or a slow-loris) before it is closed.
    ``max_connections`` / ``max_connections_per_client``: open connections in all / from
    one client address (past either, ``503`` and closed at once). ``workers``: threads
    running handlers (requests past them wait for one). ``max_line``, ``max_header``,
    ``max_headers``: bytes of the request line, bytes of one header, number of headers.
    """

    max_body: int = 4 * MiB
    read_timeout: float = 30.0
    idle_timeout: float = 30.0
    max_connections: int = 512
    max_connections_per_client: int = 256
    workers: int = 128
    max_line: int = 8190
    max_header: int = 16384
    max_headers: int = 64

    def __post_init__(self) -> None:
        for name in ("max_body", "max_connections", "max_connections_per_client", "workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("read_timeout", "idle_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class HTTPRequest:
    """One request: ``path`` is the request target as sent (with its query); ``body`` is
    empty for the head :class:`LocalHTTPServer` hands ``admit``."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes
    client: str | None = None

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
Admit = Callable[[HTTPRequest], HTTPResponse | None]

_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: 66\r\n\r\n"
    b'{"error": {"message": "too many connections", "type": "overload"}}'
)
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})


_IDLE_WORKER_EXIT = 1.0
"""Seconds an idle worker thread waits for a job before it exits."""


class _Workers:
    """A bounded pool of daemon threads (a blocked handler never holds up interpreter exit,
    as ``concurrent.futures``' non-daemon threads would); idle ones exit."""

    def __init__(self, limit: int, name: str):
        self._limit = limit
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads waiting for a job
        self._pending = 0  # jobs submitted and not yet taken

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._pending += 1
            spawn = self._pending > self._idle and self._threads < self._limit
            if spawn:
                self._threads += 1
        self._jobs.put(job)
        if spawn:
            threading.Thread(target=self._work, name=self._name, daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            try:
                job = self._jobs.get(timeout=_IDLE_WORKER_EXIT)
            except queue.Empty:
                with self._lock:
                    if self._pending:  # a job is on its way to an idle thread: stay
                        self._idle -= 1
                        continue
                    self._idle -= 1
                    self._threads -= 1
                return
            with self._lock:
                self._idle -= 1
                if job is not None:
                    self._pending -= 1
                else:
                    self._threads -= 1
            if job is None:
                return
            job()

    def stop(self) -> None:
        with self._lock:
            count = self._threads
        for _ in range(count):
            self._jobs.put(None)


class _ClientErrorLog(logging.Logger):
    """aiohttp's server logs a client's malformed request as an ERROR with a traceback; the
    bytes came from a sandbox, so they are not the host's error (and a sandbox must not fill
    the host's logs): DEBUG. The handlers' own failures are logged by :data:`log`."""

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        kwargs.setdefault("exc_info", True)
        self.debug(msg, *args, **kwargs)


_client_errors = _ClientErrorLog("harnesses.http.clients")
_client_errors.parent = log


class _Server(web.Server):
    """aiohttp's low-level server, counting connections per client address."""

    def __init__(self, owner: LocalHTTPServer, **kwargs: Any):
        super().__init__(owner._serve, **kwargs)
        self._limits = owner.limits
        self._admitted: dict[RequestHandler, str] = {}
        self._per_client: dict[str, int] = {}

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        peer = transport.get_extra_info("peername")
        client = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        if (
            len(self._admitted) >= self._limits.max_connections
            or self._per_client.get(client, 0) >= self._limits.max_connections_per_client
        ):
            log.info("refused a connection from %s: connection limit reached", client)
            transport.write(_BUSY)
            handler.force_close()
            return
        self._admitted[handler] = client
        self._per_client[client] = self._per_client.get(client, 0) + 1
        super().connection_made(handler, transport)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        client = self._admitted.pop(handler, None)
        if client is not None:
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]
        super().connection_lost(handler, exc)

    @property
    def open_connections(self) -> int:
        return len(self._admitted)


class LocalHTTPServer:
    """``handler`` served on ``host`` (a free port unless ``port`` is given), in a thread.

    ``admit`` (optional) is asked about each request's head before its body is read; a
    response from it is sent instead of reading the body (see the module doc). Use as a
    context manager, or call :meth:`start` / :meth:`stop`.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        admit: Admit | None = None,
        limits: ServerLimits | None = None,
    ):
        self._handler = handler
        self._admit = admit
        self.limits = limits or ServerLimits()
        self._address = (host, port)
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: _Server | None = None
        self._listener: asyncio.Server | None = None
        self._workers: _Workers | None = None

    @property
    def host(self) -> str:
        return self._address[0]

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("server not started")
        return self._port

    @property
    def open_connections(self) -> int:
        """Connections open right now (those refused for a limit not counted)."""
        return self._server.open_connections if self._server is not None else 0

    def start(self) -> None:
        """Bind and start serving.

        Raises:
            OSError: the address cannot be bound.
        """
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()
        failure: list[OSError] = []

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._bind(loop))
            except OSError as exc:
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._unbind())
            loop.close()

        self._loop = loop
        self._workers = _Workers(self.limits.workers, f"vf-http-{self._address[1]}-worker")
        self._thread = threading.Thread(target=run, name="vf-http", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = self._loop = None
            raise failure[0]

    async def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        limits = self.limits
        self._server = _Server(
            self,
            loop=loop,
            keepalive_timeout=limits.idle_timeout,
            max_line_size=limits.max_line,
            max_field_size=limits.max_header,
            max_headers=limits.max_headers,
            lingering_time=0,
            auto_decompress=False,
            access_log=None,
            logger=_client_errors,
        )
        self._listener = await loop.create_server(
            self._server, self._address[0], self._address[1], reuse_address=True
        )
        sockets = self._listener.sockets
        self._port = int(sockets[0].getsockname()[1])

    async def _unbind(self) -> None:
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            for connection in self._server.connections:
                connection.force_close()
        if self._listener is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._listener.wait_closed(), 2)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        """Stop serving and release the port. Idempotent. Handlers still running finish on
        their threads; their answers go nowhere."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        self._loop = self._thread = None
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        if self._workers is not None:
            self._workers.stop()
            self._workers = None
        self._server = self._listener = None

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

    # ------------------------------------------------------------------ serving

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        head = HTTPRequest(
            request.method,
            request.raw_path,
            dict(request.headers.items()),
            b"",
            str(peer[0]) if isinstance(peer, tuple) and peer else None,
        )
        if self._admit is not None:
            refusal = self._admit(head)
            if refusal is not None:
                return _closing(refusal)
        announced = request.content_length
        if announced is not None and announced > self.limits.max_body:
            return _closing(_too_large(self.limits.max_body))
        try:
            async with asyncio.timeout(self.limits.read_timeout):
                body = await self._read_body(request)
        except TimeoutError:
            message = f"the request body did not arrive within {self.limits.read_timeout}s"
            return _closing(error_response(408, message))
        except RequestPayloadError as exc:
            return _closing(error_response(400, f"malformed request body: {exc}"))
        except ConnectionError:  # the client went away mid-body: nobody reads the answer
            return _closing(error_response(400, "the connection was lost mid-body"))
        if body is None:
            return _closing(_too_large(self.limits.max_body))
        whole = HTTPRequest(head.method, head.path, head.headers, body, head.client)
        return _web_response(await self._run_handler(whole))

    async def _read_body(self, request: web.BaseRequest) -> bytes | None:
        """The body, or ``None`` once it is past ``max_body`` (reading stops there)."""
        limit = self.limits.max_body
        pieces: list[bytes] = []
        size = 0
        while piece := await request.content.read(65536):
            size += len(piece)
            if size > limit:
                return None
            pieces.append(piece)
        return b"".join(pieces)

    async def _run_handler(self, request: HTTPRequest) -> HTTPResponse:
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[HTTPResponse] = loop.create_future()
        handler = self._handler

        def deliver(response: HTTPResponse) -> None:
            if not answer.done():
                answer.set_result(response)

        def job() -> None:
            try:
                response = handler(request)
            except Exception as exc:  # a handler bug: logged, answered 500, the server lives
                log.exception("handler failed for %s %s", request.method, request.path)
                response = error_response(500, f"internal error: {type(exc).__name__}")
            try:
                loop.call_soon_threadsafe(deliver, response)
            except RuntimeError:
                # The server stopped (its loop is closed) while the handler ran.
                log.debug(
                    "dropped the answer to %s %s: server stopped", request.method, request.path
                )

        assert self._workers is not None
        self._workers.submit(job)
        return await answer


def _too_large(limit: int) -> HTTPResponse:
    return error_response(413, f"request body over {limit} bytes", code="request_too_large")


def _web_response(response: HTTPResponse) -> web.Response:
    headers = {k: v for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS}
    return web.Response(status=response.status, body=response.body, headers=headers)


def _closing(response: HTTPResponse) -> web.Response:
    """A response after which the connection closes (its body was not read)."""
    answer = _web_response(response)
    answer.force_close()
    return answer
