"""The ``docker`` runtime: one container per sandbox, driven through the Engine API.

Everything goes through the docker SDK (``docker-py``) and the Engine API, never the
``docker`` CLI, so a remote engine (``tcp://``, ``ssh://``) works like the local socket.

Owned sandboxes: :meth:`DockerRuntime.start` creates a container from ``image`` with a
keep-alive command, vf-sandbox labels (:mod:`runtimes.ownership`), no network by default,
``docker-init`` as PID 1 when the engine has it, and the workdir; ``close()`` removes it.
Attach mode (``container=``): commands and files go to a running container the caller
owns; ``close()`` leaves it running and untouched.

Commands run through ``exec_create`` + a hijacked ``exec_start`` connection, with the
8-byte stream headers demultiplexed as output arrives and stdin streamed then half-closed.
Each command is started by a small ``sh`` prelude that changes to ``cwd``, checks the
program (so a missing or non-executable program is a typed error, never a guessed exit
code), announces its PID on the first line of stdout and ``exec``\\ s the program. Docker
makes every exec a session and process-group leader, so that PID is the group to kill:
``timeout=``, the output cap and cancellation kill the whole tree with a second exec
(``kill -9 -PGID``). Images therefore need ``/bin/sh``.

Files go through the archive API (``get_archive`` / ``put_archive`` / a ``HEAD`` stat)
when the sandbox's default user is root; with a non-root user they go through exec as
that user, so permissions mean what they mean for the user's commands.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import posixpath
import re
import socket
import ssl
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar

import anyio
import anyio.abc
import anyio.lowlevel
from pydantic import Field, field_validator

from . import ownership
from ._extract import extract_archive
from .base import MARK_VAR, Runtime, _write_local_file, shell_error, sweep_argv
from .channel import (
    ChannelHooks,
    ChannelInfo,
    ChannelSupervisor,
    ChannelTransport,
    agent_command,
)
from .config import RuntimeConfig, absolute_workdir
from .errors import (
    HostRouteError,
    OutputLimitExceededError,
    ProvisioningError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    SandboxTransportError,
    SandboxUnavailableError,
    error_for_errno,
)
from .limits import creation_rate, live_cap
from .models import ExecRequest, MiB, OutputSink, SandboxInfo, Stream
from .policy import DEFAULT_POLICY_USER, validate_policy_user
from .routes import HostRoute, RouteKind, channel_route

if TYPE_CHECKING:
    import docker
    import docker.errors
    import requests

log = logging.getLogger("runtimes.docker")

T = TypeVar("T")

DEFAULT_IMAGE = "vf-sandbox/base:bookworm"
DEFAULT_WORKDIR = "/work"

_KEEP_ALIVE = ["sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 86400 & wait $!; done"]
"""PID 1 (or docker-init's child): sleeps forever, exits at once on ``docker stop``,
and reaps orphans when there is no init."""

_HEADER_PREFIX = b"vf-sandbox:"
_HEADER_MAX = 256
_STREAM_CHUNK = 256 * 1024
_STDIN_CHUNK = 1 * MiB
_TAR_SLACK = 1 * MiB
_RAW = {"Accept-Encoding": "identity"}
"""The engine gzips archives for clients that accept it: costly for big files, and
local. Ask for the tar as is."""
_KILL_WAIT = 10.0
_SIGKILLED = 128 + 9
_DEATH_WATCH = 3.0
"""Seconds to wait for the engine to report a container stop after a failed probe."""
_THREADS = 64

# Go's os.FileMode bits, as the archive API's stat header reports them.
_MODE_DIR = 1 << 31
_MODE_SYMLINK = 1 << 27
_MODE_PIPE_OR_SOCKET = (1 << 25) | (1 << 24)

# The prelude every command runs through. $0 is the cwd, "$@" the argv. It answers on
# the first line of stdout, either ``vf-sandbox:pid=N`` (then execs the program, so N is
# the program's PID and, docker exec making it a session leader, its process group) or
# ``vf-sandbox:error=WHAT`` (and exits). It sets no variable in the shell that execs the
# program (the PATH search runs in a subshell), so the caller's environment reaches the
# program untouched whatever its names.
_PRELUDE = r"""
if ! cd -- "$0" 2>/dev/null; then
  if [ ! -e "$0" ]; then printf 'vf-sandbox:error=cwd-missing\n'
  elif [ ! -d "$0" ]; then printf 'vf-sandbox:error=cwd-notdir\n'
  else printf 'vf-sandbox:error=cwd-denied\n'; fi
  exit 0
fi
case $1 in
*/*)
  if [ -d "$1" ]; then printf 'vf-sandbox:error=prog-isdir\n'; exit 0; fi
  if [ ! -e "$1" ]; then printf 'vf-sandbox:error=prog-missing\n'; exit 0; fi
  if [ ! -x "$1" ]; then printf 'vf-sandbox:error=prog-denied\n'; exit 0; fi
  ;;
*)
  (
    set -f; IFS=:; s=2
    for d in $PATH; do
      if [ -f "${d:-.}/$1" ]; then
        if [ -x "${d:-.}/$1" ]; then exit 0; fi
        s=1
      fi
    done
    exit $s
  )
  case $? in
  0) ;;
  1) printf 'vf-sandbox:error=prog-denied\n'; exit 0 ;;
  *) printf 'vf-sandbox:error=prog-missing\n'; exit 0 ;;
  esac
  ;;
esac
printf 'vf-sandbox:pid=%s\n' "$$"
exec "$@"
"""

_KILL_GROUP = 'kill -9 "-$1" 2>/dev/null || kill -9 "$1" 2>/dev/null; exit 0'
# A kill retried later: only if the group's leader is still a command of this runtime
# (its environment carries the runtime's mark; a restarted container reuses pids).
_KILL_ORPHAN = (
    'tr "\\0" "\\n" < "/proc/$1/environ" 2>/dev/null | grep -qxF -- "$2" && '
    'kill -9 "-$1" 2>/dev/null; exit 0'
)


# File operations through exec, for sandboxes whose user is not root.
_READ_SCRIPT = r"""
if [ -d "$1" ]; then exit 21; fi
if [ -f "$1" ] && [ -r "$1" ]; then
  __vf_n=$(wc -c < "$1") && [ "$__vf_n" -gt "$2" ] && exit 27
fi
exec cat -- "$1"
"""
_WRITE_SCRIPT = r"""
if [ -d "$1" ]; then exit 21; fi
__vf_d=${1%/*}
if [ -e "${__vf_d:-/}" ] && [ ! -d "${__vf_d:-/}" ]; then exit 20; fi
mkdir -p -- "${__vf_d:-/}" || exit 1
exec cat > "$1"
"""
_TEMP_PREFIX = ".vf-sandbox-write-"
# A mount point (docker bind-mounts /etc/hosts, /etc/hostname...) cannot be renamed over:
# its content is rewritten from the temporary file instead.
_REPLACE_SCRIPT = r"""
mv -f -- "$1" "$2" 2>/dev/null && exit 0
cat -- "$1" > "$2"; rc=$?
rm -f -- "$1"
exit $rc
"""
_MKDIRS_SCRIPT = 'mkdir -p -- "$1" && if [ -n "$2" ]; then chown -- "$2" "$1"; fi'

_MEMORY = re.compile(r"^\d+(\.\d+)?[bkmgBKMG]?$")
_BASE_URL = re.compile(r"^(unix|tcp|ssh|http|https|npipe)://")


# ---------------------------------------------------------------------- config


class DockerConfig(RuntimeConfig):
    """Config of the ``docker`` runtime.

    Owned sandboxes (no ``container``): a fresh container from ``image`` per runtime,
    removed on close. Attach mode (``container`` = a running container's id or name):
    the runtime borrows it and leaves it running on close.

    ``workdir`` defaults to ``/work`` (created) for owned sandboxes; in attach mode to the
    container's ``WorkingDir``, else ``/``. ``user`` is the default user of commands (and
    of file operations): the host's machinery runs as it. ``policy_user`` is the account a
    rollout's policy runs as (``exec(user=rt.policy_user)``), made on first use in an owned
    container whose default user is root; ``None`` runs the policy as the default user
    (``docs/security.md``). ``cpu`` is in cores, ``memory`` in bytes or with a unit
    (``"512m"``, ``"2g"``). ``network`` is ``"none"`` (default), ``"bridge"``, ``"host"``
    or a network's name. ``base_url`` is ``unix://...``, ``tcp://host:port`` or
    ``ssh://user@host`` (paramiko); unset means ``DOCKER_HOST`` or the local socket.
    ``max_live`` caps the live sandboxes of this process (all docker configs share one
    count), ``creations_per_second`` paces creations; ``None`` disables the pacing.
    """

    type: Literal["docker"] = "docker"
    image: str = DEFAULT_IMAGE
    container: str | None = None
    user: str | None = None
    policy_user: str | None = DEFAULT_POLICY_USER
    cpu: float | None = Field(default=None, gt=0)
    memory: int | str | None = None
    pids_limit: int | None = Field(default=None, gt=0)
    network: str = "none"
    hostname: str | None = None
    init: bool | None = Field(
        default=None, description="docker-init as PID 1; None: if the engine has it"
    )
    base_url: str | None = None
    api_timeout: float = Field(default=60.0, gt=0, description="seconds for one Engine API call")
    start_timeout: float = Field(default=60.0, gt=0)
    retries: int = Field(default=3, ge=0, description="extra attempts of idempotent calls")
    max_live: int = Field(default=64, ge=1)
    creations_per_second: float | None = Field(default=10.0, gt=0)
    name_prefix: str = "vf-sandbox"
    channel: bool = Field(
        default=True,
        description="run commands and files through a persistent in-sandbox agent (python3)",
    )

    _absolute_workdir = field_validator("workdir")(absolute_workdir)
    _plain_policy_user = field_validator("policy_user")(validate_policy_user)

    @field_validator("memory")
    @classmethod
    def _memory_size(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value <= 0:
            raise ValueError("memory must be > 0 bytes")
        if isinstance(value, str) and not _MEMORY.match(value):
            raise ValueError(f"memory must be bytes or a size like '512m' or '2g', got {value!r}")
        return value

    @field_validator("base_url")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and not _BASE_URL.match(value):
            raise ValueError(f"base_url must start with unix://, tcp:// or ssh://, got {value!r}")
        return value

    def is_local(self) -> bool:
        """Only ``network="host"`` shares the host's network namespace (and loopback)."""
        return self.network == "host"


# ---------------------------------------------------------------------- engine access


_CLIENTS: dict[tuple[str | None, float], docker.DockerClient] = {}
_CLIENTS_LOCK = threading.Lock()
_INIT_SUPPORT: dict[int, bool] = {}

_THREAD_LIMITER: anyio.lowlevel.RunVar[anyio.CapacityLimiter] = anyio.lowlevel.RunVar(
    "vf_sandbox_docker_threads"
)


def _thread_limiter() -> anyio.CapacityLimiter:
    """One limiter per event loop for the blocking SDK calls of every docker runtime."""
    try:
        return _THREAD_LIMITER.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(_THREADS)
        _THREAD_LIMITER.set(limiter)
        return limiter


def _engine_name(config: DockerConfig) -> str:
    return config.base_url or "the default Docker engine"


def _client_for(config: DockerConfig) -> docker.DockerClient:
    """A process-wide client per engine (blocking: asks the engine for its API version)."""
    import docker

    key = (config.base_url, config.api_timeout)
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(key)
    if client is not None:
        return client
    if config.base_url is None:
        client = docker.from_env(
            timeout=int(config.api_timeout), use_ssh_client=False, max_pool_size=_THREADS
        )
    else:
        client = docker.DockerClient(
            base_url=config.base_url,
            timeout=int(config.api_timeout),
            use_ssh_client=False,
            max_pool_size=_THREADS,
        )
    with _CLIENTS_LOCK:
        return _CLIENTS.setdefault(key, client)


def _is_transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the engine did not answer (as opposed to answering 'no')."""
    import docker.errors
    import requests.exceptions
    import urllib3.exceptions

    if isinstance(exc, SandboxError | docker.errors.APIError):
        return False
    if isinstance(
        exc,
        requests.exceptions.ConnectionError
        | requests.exceptions.Timeout
        | requests.exceptions.ChunkedEncodingError
        | urllib3.exceptions.HTTPError
        | OSError,
    ):
        return True
    try:
        import paramiko
    except ImportError:  # pragma: no cover - paramiko ships with the docker extra
        pass
    else:
        if isinstance(exc, paramiko.SSHException):
            return True
    if isinstance(exc, docker.errors.DockerException):
        # The SDK wraps a failed version handshake in a bare DockerException; other
        # DockerExceptions (invalid arguments, TLS settings) are answers, not silence.
        cause = exc.__cause__ or exc.__context__
        return cause is not None and _is_transport_failure(cause)
    return False


def _transport_guard(fn: Callable[[], T], engine: str) -> Callable[[], T]:
    def guarded() -> T:
        try:
            return fn()
        except SandboxError:
            raise
        except UnicodeEncodeError as exc:  # a path with a lone surrogate, in a URL
            raise _not_engine_text(exc, engine) from None
        except Exception as exc:
            if _is_transport_failure(exc):
                raise SandboxTransportError(f"{engine} did not answer: {exc}") from exc
            raise

    return guarded


def _not_engine_text(exc: UnicodeEncodeError, engine: str) -> SandboxInvalidArgumentError:
    return SandboxInvalidArgumentError(
        f"{engine} takes only valid UTF-8 text, not {exc.object!r}: pass undecodable bytes "
        "through stdin or file content (or use the channel, which carries them)"
    )


async def _blocking(
    fn: Callable[[], T],
    config: DockerConfig,
    *,
    idempotent: bool = False,
    abandon_on_cancel: bool = False,
) -> T:
    """Run a blocking SDK call in a worker thread.

    A failure to reach the engine becomes :class:`SandboxTransportError`; idempotent
    calls are retried (bounded, exponential backoff) before it surfaces. With
    ``abandon_on_cancel`` a cancelled caller stops waiting for the thread (which then
    ends on the engine's answer or the client's timeout).
    """
    guarded = _transport_guard(fn, _engine_name(config))

    async def once() -> T:
        return await anyio.to_thread.run_sync(
            guarded, abandon_on_cancel=abandon_on_cancel, limiter=_thread_limiter()
        )

    if not idempotent or config.retries == 0:
        return await once()
    from tenacity import (
        AsyncRetrying,
        retry_if_exception_type,
        stop_after_attempt,
        wait_exponential,
    )

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(SandboxTransportError),
        stop=stop_after_attempt(config.retries + 1),
        wait=wait_exponential(multiplier=0.1, max=2.0),
        sleep=anyio.sleep,
        reraise=True,
    )
    return await retrying(once)


def _api_message(exc: docker.errors.APIError) -> str:
    return str(exc.explanation or exc)


def _status(exc: docker.errors.APIError) -> int:
    return exc.status_code or 0


def _container_is_gone(exc: docker.errors.APIError) -> bool:
    """404 no such container, or 409 not running / paused / restarting."""
    message = _api_message(exc).lower()
    if _status(exc) == 404:
        return "no such container" in message or "no such exec" not in message
    return _status(exc) == 409 and any(
        word in message for word in ("not running", "paused", "restarting", "is dead")
    )


def _engine_has_init(client: docker.DockerClient) -> bool:
    """Whether the engine can run docker-init (``--init``); asked once per client."""
    key = id(client)
    if key not in _INIT_SUPPORT:
        components = client.api.version().get("Components") or []
        names = {str(c.get("Name", "")) for c in components}
        if names:
            _INIT_SUPPORT[key] = "docker-init" in names
        else:
            _INIT_SUPPORT[key] = bool(client.api.info().get("InitBinary"))
    return _INIT_SUPPORT[key]


# ---------------------------------------------------------------------- exec plumbing


class _Channel:
    """The hijacked exec connection as an async byte stream (stdin out, frames in)."""

    async def receive(self) -> bytes:
        """Next chunk, or ``b""`` once the engine closed the stream."""
        raise NotImplementedError

    async def send(self, data: bytes) -> bool:
        """Send stdin bytes; ``False`` once the other side stopped reading."""
        raise NotImplementedError

    async def send_eof(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class _SocketChannel(_Channel):
    """A plain unix or TCP socket, driven by the event loop itself (no threads)."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self._stream = stream

    async def receive(self) -> bytes:
        try:
            return await self._stream.receive(_STREAM_CHUNK)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return b""

    async def send(self, data: bytes) -> bool:
        try:
            await self._stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False
        return True

    async def send_eof(self) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await self._stream.send_eof()

    async def aclose(self) -> None:
        with contextlib.suppress(OSError):
            await self._stream.aclose()


class _ThreadChannel(_Channel):
    """A TLS socket or a paramiko channel (ssh://): blocking calls in worker threads."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        with contextlib.suppress(OSError):
            sock.settimeout(None)

    async def receive(self) -> bytes:
        try:
            data: bytes = await anyio.to_thread.run_sync(
                self._sock.recv, _STREAM_CHUNK, abandon_on_cancel=True, limiter=_thread_limiter()
            )
        except Exception as exc:  # noqa: BLE001 - any failure of the channel ends the stream
            log.debug("exec stream ended with %r", exc)
            return b""
        return data

    async def send(self, data: bytes) -> bool:
        try:
            await anyio.to_thread.run_sync(
                self._sock.sendall, data, abandon_on_cancel=True, limiter=_thread_limiter()
            )
        except Exception as exc:  # noqa: BLE001 - the command stopped reading stdin
            log.debug("stdin not sent: %r", exc)
            return False
        return True

    async def send_eof(self) -> None:
        shutdown_write = getattr(self._sock, "shutdown_write", None)
        try:
            if shutdown_write is not None:
                shutdown_write()
            else:
                self._sock.shutdown(socket.SHUT_WR)
        except Exception as exc:  # noqa: BLE001 - the stream is already gone
            log.debug("half-close failed: %r", exc)

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            self._sock.close()


@dataclass
class _Hijacked:
    """An exec that was started: its id, the HTTP response holding the connection, the
    raw transport object and any stream bytes the HTTP layer had already buffered."""

    exec_id: str
    response: requests.Response
    sock: Any
    leftover: bytes


def _hijack(api: Any, exec_id: str) -> _Hijacked:
    """``exec_start`` on an upgraded connection; returns the raw socket (blocking)."""
    sock = api.exec_start(exec_id, socket=True)
    response = sock._response
    raw = getattr(sock, "_sock", sock) if isinstance(sock, socket.SocketIO) else sock
    return _Hijacked(exec_id, response, raw, _buffered_bytes(response, raw))


def _buffered_bytes(response: requests.Response, raw: Any) -> bytes:
    """Stream bytes the HTTP client read past the response headers, if any.

    http.client reads the upgrade response through a buffered file; whatever the engine
    sent right after the headers sits in that buffer and would be lost to a reader of
    the raw socket. Read it without blocking.
    """
    fp = getattr(getattr(response.raw, "_fp", None), "fp", None)
    if fp is None:
        return b""
    rbuffer = getattr(fp, "_rbuffer", None)  # paramiko's ChannelFile
    if isinstance(rbuffer, bytes | bytearray):
        data = bytes(rbuffer)
        fp._rbuffer = type(rbuffer)()
        return data
    if not isinstance(fp, io.BufferedReader) or not isinstance(raw, socket.socket):
        return b""
    raw.setblocking(False)
    try:
        return fp.read1(_STREAM_CHUNK) or b""
    except (BlockingIOError, ssl.SSLWantReadError):
        return b""


class _AgentStream(ChannelTransport):
    """The channel agent's exec stream (see :mod:`runtimes.channel`), for blocking use by
    the channel's threads: the engine's 8-byte frame headers are stripped, stdout is the
    agent's framed protocol, the tail of stderr is kept for failure messages."""

    def __init__(self, hijacked: _Hijacked) -> None:
        self._hijacked = hijacked
        self._sock = hijacked.sock
        self._raw = bytearray(hijacked.leftover)
        self._stderr = bytearray()
        with contextlib.suppress(OSError, AttributeError):
            self._sock.settimeout(None)  # _buffered_bytes may have left it non-blocking

    def recv(self) -> bytes:
        while True:
            out = self._demultiplex()
            if out:
                return out
            data: bytes = self._sock.recv(_STREAM_CHUNK)
            if not data:
                return b""
            self._raw += data

    def _demultiplex(self) -> bytes:
        raw = self._raw
        out = bytearray()
        pos = 0
        while len(raw) - pos >= 8:
            size = int.from_bytes(raw[pos + 4 : pos + 8], "big")
            if len(raw) - pos - 8 < size:
                break
            payload = raw[pos + 8 : pos + 8 + size]
            if raw[pos] == 2:
                self._stderr += payload
                del self._stderr[:-4096]
            else:
                out += payload
            pos += 8 + size
        del raw[:pos]
        return bytes(out)

    def send(self, data: bytes) -> None:
        self._sock.sendall(data)

    def try_send(self, data: bytes) -> int:
        if type(self._sock) is not socket.socket:
            return 0  # TLS or an ssh:// channel: the writer thread does it
        try:
            return self._sock.send(data, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return 0

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(Exception):
            self._sock.close()
        with contextlib.suppress(Exception):
            self._hijacked.response.close()

    def diagnostics(self) -> str:
        return self._stderr.decode("utf-8", "replace").strip()[-500:]


async def _open_channel(hijacked: _Hijacked) -> _Channel:
    raw = hijacked.sock
    if type(raw) is socket.socket and raw.family == socket.AF_UNIX:
        return _SocketChannel(await anyio.abc.UNIXSocketStream.from_socket(raw))
    if type(raw) is socket.socket and raw.family in (socket.AF_INET, socket.AF_INET6):
        return _SocketChannel(await anyio.abc.SocketStream.from_socket(raw))
    return _ThreadChannel(raw)


@dataclass
class _ExecOutput:
    """Demultiplexes the engine's framed stream and reads the prelude's first line.

    Frames are ``[stream, 0, 0, 0, size (4 bytes, big-endian)] + payload``; stream 1 is
    stdout, 2 stderr. Until the prelude's line is complete, stdout is held back; if the
    stream starts with anything else, the prelude never ran and the text is the engine's
    error message.
    """

    sink: OutputSink
    pid: int | None = None
    error: str | None = None
    foreign: bool = False
    _frames: bytearray = field(default_factory=bytearray)
    _head: bytearray = field(default_factory=bytearray)
    _early_err: bytearray = field(default_factory=bytearray)

    @property
    def announced(self) -> bool:
        return self.pid is not None or self.error is not None or self.foreign

    @property
    def foreign_text(self) -> str:
        return (bytes(self._head) + bytes(self._early_err)).decode("utf-8", "replace").strip()

    def feed(self, chunk: bytes) -> bool:
        """Take raw stream bytes; ``False`` once the sink refuses more output."""
        self._frames += chunk
        view = self._frames
        offset = 0
        keep_going = True
        while len(view) - offset >= 8:
            size = int.from_bytes(view[offset + 4 : offset + 8], "big")
            if len(view) - offset - 8 < size:
                break
            kind = view[offset]
            payload = bytes(view[offset + 8 : offset + 8 + size])
            offset += 8 + size
            if payload and not self._route(kind, payload):
                keep_going = False
        del self._frames[:offset]
        return keep_going

    def _route(self, kind: int, payload: bytes) -> bool:
        stream: Stream = "stderr" if kind == 2 else "stdout"
        if self.announced and not self.foreign:
            return self.sink.feed(stream, payload)
        if self.foreign:
            self._head += payload
            return True
        if stream == "stderr":
            self._early_err += payload
            return True
        self._head += payload
        return self._parse_head()

    def _parse_head(self) -> bool:
        newline = self._head.find(b"\n")
        if newline < 0:
            if len(self._head) > _HEADER_MAX or not _HEADER_PREFIX.startswith(
                bytes(self._head[: len(_HEADER_PREFIX)])
            ):
                self.foreign = True
            return True
        line = bytes(self._head[:newline])
        rest = bytes(self._head[newline + 1 :])
        key, _, value = line.removeprefix(_HEADER_PREFIX).partition(b"=")
        if not line.startswith(_HEADER_PREFIX) or key not in (b"pid", b"error"):
            self.foreign = True
            return True
        self._head.clear()
        if key == b"error":
            self.error = value.decode("ascii", "replace")
            return True
        self.pid = int(value)
        ok = True
        if self._early_err:
            ok = self.sink.feed("stderr", bytes(self._early_err))
            self._early_err.clear()
        if rest and ok:
            ok = self.sink.feed("stdout", rest)
        return ok


def _prelude_error(code: str, request: ExecRequest) -> SandboxError:
    program = request.argv[0]
    table: dict[str, SandboxError] = {
        "cwd-missing": SandboxFileNotFoundError(request.cwd, "working directory"),
        "cwd-notdir": SandboxNotADirectoryError(request.cwd, "working directory"),
        "cwd-denied": SandboxPermissionError(request.cwd, "working directory"),
        "prog-missing": SandboxFileNotFoundError(program, "no such program"),
        "prog-denied": SandboxPermissionError(program, "not executable"),
        "prog-isdir": SandboxPermissionError(program, "is a directory, not a program"),
    }
    return table.get(code, SandboxError(f"exec of {program!r} failed: {code}"))


def _engine_exec_error(text: str, request: ExecRequest, where: str) -> SandboxError:
    """The engine refused to start the command; ``text`` is its message."""
    lowered = text.lower()
    if any(gone in lowered for gone in ("is not running", "is paused", "no such container")):
        return SandboxUnavailableError(f"{where}: {text}")
    if "argument list too long" in lowered or "exceed maximum message" in lowered:
        size = sum(len(a.encode()) + 1 for a in request.argv)
        return SandboxInvalidArgumentError(
            f"argument list too long for the kernel ({size} bytes); "
            "pass large data through stdin or a file"
        )
    if "unable to find user" in lowered or "no matching entries in passwd" in lowered:
        return SandboxInvalidArgumentError(
            f"no such user in the sandbox: {request.user!r} ({text})"
        )
    if "executable file not found" in lowered or "no such file or directory" in lowered:
        return SandboxError(
            f"{where}: the image has no /bin/sh, which the docker runtime needs: {text}"
        )
    return SandboxError(
        f"{where}: the engine could not start {request.argv[0]!r}: {text or 'no message'}"
    )


# ---------------------------------------------------------------------- archive plumbing


def _decode_stat(header: str | None) -> dict[str, Any] | None:
    if not header:
        return None
    stat: dict[str, Any] = json.loads(base64.b64decode(header))
    return stat


def _is_dir(stat: Mapping[str, Any]) -> bool:
    return bool(int(stat.get("mode", 0)) & _MODE_DIR)


def _is_symlink(stat: Mapping[str, Any]) -> bool:
    return bool(int(stat.get("mode", 0)) & _MODE_SYMLINK)


def _archive_error(status: int, message: str, path: str) -> SandboxError:
    """Map an archive endpoint's refusal to the typed error for ``path``."""
    lowered = message.lower()
    if "no such container" in lowered or "is not running" in lowered:
        return SandboxUnavailableError(f"docker container is gone: {message}")
    table = (
        ("cannot overwrite directory", SandboxIsADirectoryError),
        ("cannot overwrite non-directory", SandboxNotADirectoryError),
        ("extraction point is not a directory", SandboxNotADirectoryError),
        ("not a directory", SandboxNotADirectoryError),
        ("is a directory", SandboxIsADirectoryError),
        ("permission denied", SandboxPermissionError),
        ("read-only", SandboxPermissionError),
        ("no such file", SandboxFileNotFoundError),
        ("could not find the file", SandboxFileNotFoundError),
    )
    for needle, kind in table:
        if needle in lowered:
            return kind(path)
    if status == 404:
        return SandboxFileNotFoundError(path)
    if status == 403:
        return SandboxPermissionError(path, message or None)
    return SandboxError(
        f"archive operation on {path!r} failed ({status}): {message or 'no message'}"
    )


def _response_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()
    if isinstance(body, dict):
        return str(body.get("message", "")).strip()
    return str(body)


def _tar_info(name: str, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.mtime = int(time.time())
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _file_tar(name: str, data: bytes, mode: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_tar_info(name, tarfile.REGTYPE, mode, len(data)), io.BytesIO(data))
    return buf.getvalue()


def _dirs_tar(names: Iterable[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            tar.addfile(_tar_info(name, tarfile.DIRTYPE, 0o755))
    return buf.getvalue()


def _tree_tar(source: Path) -> bytes:
    """The contents of a local directory as a tar owned by root (upload)."""

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(source.iterdir()):
            tar.add(entry, arcname=entry.name, filter=owned_by_root)
    return buf.getvalue()


def _extract_tree(archive: Any, top: str, local: Path, *, skip_unsafe: bool = False) -> None:
    """Extract a directory's archive into ``local``, dropping the top component ``top``.

    The engine archives the sandbox's own files, which a policy arranged: the archive is
    unpacked as hostile (:mod:`runtimes._extract`), never trusting ``tarfile``'s filter.
    """
    extract_archive(archive, local, skip_unsafe=skip_unsafe, strip=top)


def _single_file(response: requests.Response, path: str, limit: int) -> bytes:
    """The content of the one regular file in an archive response, streamed."""
    counted: Any = _CappedReader(response.raw, limit + _TAR_SLACK, path)
    with tarfile.open(fileobj=counted, mode="r|") as tar:
        for member in tar:
            if member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None
                data: bytes = handle.read()
                return data
    raise SandboxError(f"the engine's archive of {path!r} holds no regular file")


class _CappedReader:
    """A file-like view of a response body that refuses to go past ``cap`` bytes."""

    def __init__(self, raw: Any, cap: int, path: str) -> None:
        self._raw = raw
        self._left = cap
        self._cap = cap
        self._path = path

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all when negative); short only at the end of the body."""
        if size < 0:
            data = bytes(self._raw.read())
        else:
            buf = bytearray()
            while len(buf) < size:
                piece = self._raw.read(size - len(buf))
                if not piece:
                    break
                buf += piece
            data = bytes(buf)
        self._left -= len(data)
        if self._left < 0:
            raise OutputLimitExceededError(f"read of {self._path!r}", self._cap, path=self._path)
        return data


def _is_root_user(user: str | None) -> bool:
    if not user:
        return True
    name = user.split(":", 1)[0]
    return name in ("root", "0")


# ---------------------------------------------------------------------- the runtime


class DockerRuntime(Runtime):
    """A Docker container as a sandbox (owned, or attached to a running one)."""

    name = "docker"
    config_model = DockerConfig

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: DockerConfig
        self._client: docker.DockerClient | None = None
        self._container_id: str | None = None
        self._owned = self.config.container is None
        self._holds_slot = False
        self._default_user: str | None = self.config.user
        self._files_as_root = True
        self._orphans: set[int] = set()
        """Process groups whose kill could not be delivered (the container was paused, the
        engine did not answer): killed before the next command, or on close."""
        self._channels = ChannelSupervisor(
            self.config.channel,
            self.describe,
            ChannelHooks(
                open_transport=self._open_agent_stream,
                kill_group=self._kill_group,
                lost_means_dead=self._died_with_container,
                probe_dead=self._stopped,
                verify_agent=self._verify_agent_files,
                verify_first=self._verify_attached_python,
            ),
            stall_timeout=self.config.api_timeout,
        )

    @property
    def sandbox_id(self) -> str | None:
        """The container's full id, once created (or attached)."""
        return self._container_id

    @property
    def channel_info(self) -> ChannelInfo:
        """The state of the persistent channel (``docs/channel.md``)."""
        return self._channels.info

    @property
    def policy_user(self) -> str | None:
        """``policy_user`` (``vf-policy`` by default) in a container this runtime created
        whose default user is root; ``None`` otherwise (an attached container is not ours to
        add accounts to; a non-root default user cannot become another)."""
        if not self._owned or not self.config.policy_user:
            return None
        return self.config.policy_user if _is_root_user(self._default_user) else None

    @property
    def attached(self) -> bool:
        """Whether this runtime borrows a container it did not create."""
        return not self._owned

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        """Create the container (or attach to ``container``) and wait until exec works.

        Before creating, waits (cancellably) for a slot under ``max_live`` and for the
        ``creations_per_second`` pace; both are process-wide.

        Raises:
            ProvisioningError: the image is not present locally (it is never pulled), the
                container to attach to does not exist or is not running, the engine
                refused or could not be reached, or the container was not ready within
                ``start_timeout``.
            SandboxUnavailableError: the runtime was already started or closed.
        """
        if self._owned and self._state == "new":
            await live_cap(self.name).acquire(self.config.max_live)
            self._holds_slot = True
            try:
                await creation_rate(self.name).wait(self.config.creations_per_second)
            except BaseException:
                self._release_slot()
                raise
        try:
            return await super().start()
        finally:
            if self._state == "new":  # start() refused before creating anything
                self._release_slot()

    def _release_slot(self) -> None:
        if self._holds_slot:
            self._holds_slot = False
            live_cap(self.name).release()

    async def _start(self) -> str:
        try:
            self._client = await _blocking(
                lambda: _client_for(self.config), self.config, idempotent=True
            )
        except SandboxTransportError as exc:
            raise ProvisioningError(f"cannot reach {_engine_name(self.config)}: {exc}") from exc
        container = None
        if self._owned:
            workdir, container = await self._create_container()
        else:
            workdir = await self._attach()
        failures: list[Exception] = []
        async with anyio.create_task_group() as tg:
            # The channel's agent boots (tens of milliseconds) while the engine confirms
            # that the container runs and the workdir is prepared.
            tg.start_soon(self._channels.start)
            try:
                await self._confirm_ready(container, workdir)
            except Exception as exc:  # noqa: BLE001 - raised below, outside the task group
                failures.append(exc)
                tg.cancel_scope.cancel()
        if failures:
            raise failures[0]
        return workdir

    async def _confirm_ready(self, container: Any, workdir: str) -> None:
        try:
            if container is not None:
                await _blocking(lambda: self._confirm_running_blocking(container), self.config)
            with anyio.fail_after(self.config.start_timeout):
                await self._prepare(workdir)
        except TimeoutError:
            raise ProvisioningError(
                f"{self.describe()} was not ready within {self.config.start_timeout:g}s"
            ) from None
        except ProvisioningError:
            raise
        except SandboxError as exc:
            raise ProvisioningError(f"{self.describe()} is not usable: {exc}") from exc

    async def _create_container(self) -> tuple[str, Any]:
        """Create and start the container; return the workdir and the SDK's container (not
        yet confirmed running: see ``_confirm_running_blocking``)."""
        cfg = self.config
        client = self._require_client()
        image_user = await self._check_image(client)
        try:
            init = cfg.init
            if init is None:
                init = await _blocking(lambda: _engine_has_init(client), cfg, idempotent=True)
            container = await _blocking(lambda: self._create_and_start(client, init), cfg)
        except SandboxTransportError as exc:
            raise ProvisioningError(f"cannot create a container from {cfg.image!r}: {exc}") from exc
        self._default_user = cfg.user or image_user or None
        self._files_as_root = _is_root_user(self._default_user)
        return cfg.workdir or DEFAULT_WORKDIR, container

    async def _check_image(self, client: docker.DockerClient) -> str:
        """The image's configured user ("" for root); never pulls."""
        import docker.errors

        try:
            image = await _blocking(
                lambda: client.images.get(self.config.image), self.config, idempotent=True
            )
        except docker.errors.ImageNotFound:
            raise ProvisioningError(
                f"docker image {self.config.image!r} is not present on {_engine_name(self.config)} "
                "(images are never pulled: build or load it first)"
            ) from None
        except docker.errors.APIError as exc:
            raise ProvisioningError(
                f"cannot inspect image {self.config.image!r}: {_api_message(exc)}"
            ) from exc
        except SandboxTransportError as exc:
            raise ProvisioningError(f"cannot inspect image {self.config.image!r}: {exc}") from exc
        settings = image.attrs.get("Config") or {}
        return str(settings.get("User") or "")

    def _create_and_start(self, client: docker.DockerClient, init: bool) -> Any:
        """Create then start; the id is recorded before start so close() can remove it."""
        import docker.errors

        cfg = self.config
        options: dict[str, Any] = {
            "command": _KEEP_ALIVE,
            "detach": True,
            "labels": ownership.session_labels(self.name, cfg.labels),
            "network_mode": cfg.network,
            "working_dir": cfg.workdir or DEFAULT_WORKDIR,
            "name": f"{cfg.name_prefix}-{uuid.uuid4().hex[:12]}",
            "init": init or None,
        }
        if cfg.hostname:
            options["hostname"] = cfg.hostname
        if cfg.cpu is not None:
            options["nano_cpus"] = int(cfg.cpu * 1e9)
        if cfg.memory is not None:
            options["mem_limit"] = cfg.memory
        if cfg.pids_limit is not None:
            options["pids_limit"] = cfg.pids_limit
        try:
            container = client.containers.create(cfg.image, **options)
            self._container_id = container.id
            container.start()
        except docker.errors.ImageNotFound:
            raise ProvisioningError(
                f"docker image {cfg.image!r} is not present (never pulled)"
            ) from None
        except docker.errors.APIError as exc:
            raise ProvisioningError(
                f"the engine refused to run a container from {cfg.image!r}: {_api_message(exc)}"
            ) from exc
        return container

    def _confirm_running_blocking(self, container: Any) -> None:
        """A container whose command exited at once (an ENTRYPOINT that ignores its
        arguments, say) is a ProvisioningError carrying its last log lines."""
        import docker.errors

        cfg = self.config
        try:
            container.reload()
        except docker.errors.APIError as exc:
            raise ProvisioningError(
                f"the container from {cfg.image!r} vanished after start: {_api_message(exc)}"
            ) from exc
        if container.status != "running":
            logs = container.logs(tail=20).decode("utf-8", "replace").strip()
            raise ProvisioningError(
                f"the container from {cfg.image!r} did not keep running "
                f"({container.status}): {logs or 'no output'}"
            )

    async def _attach(self) -> str:
        import docker.errors

        cfg = self.config
        api = self._require_client().api
        name = cfg.container
        assert name is not None
        try:
            info = await _blocking(lambda: api.inspect_container(name), cfg, idempotent=True)
        except docker.errors.NotFound:
            raise ProvisioningError(f"no docker container {cfg.container!r} to attach to") from None
        except (docker.errors.APIError, SandboxTransportError) as exc:
            raise ProvisioningError(
                f"cannot inspect docker container {cfg.container!r}: {exc}"
            ) from exc
        state = info.get("State") or {}
        if not state.get("Running") or state.get("Paused"):
            raise ProvisioningError(
                f"docker container {name!r} is not running ({state.get('Status', '?')})"
            )
        self._container_id = str(info["Id"])
        settings = info.get("Config") or {}
        self._default_user = cfg.user or settings.get("User") or None
        self._files_as_root = _is_root_user(self._default_user)
        return cfg.workdir or settings.get("WorkingDir") or "/"

    async def _prepare(self, workdir: str) -> None:
        """Readiness. An owned container running as root is ready once it runs: the
        engine created the workdir (``working_dir``). Otherwise one exec creates the
        workdir, owned by the sandbox's default user, which also proves exec works."""
        owner = "" if _is_root_user(self._default_user) else self._default_user
        if self._owned and not owner:
            return
        need_dir = self._owned or self.config.workdir is not None
        argv = ["sh", "-c", _MKDIRS_SCRIPT, "sh", workdir, owner or ""] if need_dir else ["true"]
        request, sink = self._request(argv, user="0")
        code = await self._run(request, sink)
        if code != 0:
            raise ProvisioningError(
                f"{self.describe()}: preparing {workdir!r} failed ({code}): "
                f"{bytes(sink.stderr).decode('utf-8', 'replace').strip()}"
            )

    async def _close(self) -> None:
        await self._channels.close()
        try:
            if self._owned and self._container_id is not None and self._client is not None:
                await _blocking(self._remove_blocking, self.config, idempotent=True)
            elif self._orphans and self._container_id is not None and self._client is not None:
                await self._kill_orphans()  # a borrowed container keeps running: leave it clean
        finally:
            self._release_slot()

    def _remove_blocking(self) -> None:
        import docker.errors

        assert self._client is not None and self._container_id is not None
        try:
            self._client.api.remove_container(self._container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in _api_message(exc):
                raise SandboxError(
                    f"could not remove {self.describe()}: {_api_message(exc)}"
                ) from exc

    def _close_at_exit(self) -> None:
        """atexit backstop: remove the container synchronously through the SDK."""
        self._channels.close_now()
        try:
            if self._owned and self._container_id is not None and self._client is not None:
                self._remove_blocking()
        finally:
            self._release_slot()
            self._state = "closed"

    def _host_routes(self) -> tuple[RouteKind, ...]:
        channel: tuple[RouteKind, ...] = ("channel",) if self._channels.can_relay else ()
        if self.config.network == "host":
            return ("loopback", *channel)  # the host's loopback as it is: no relay hop
        return channel + (() if self.config.network == "none" else ("gateway",))

    def _route_hint(self) -> str:
        if self.config.network == "none":
            return (
                "network='none' has only the channel route (python3 in the image, "
                "channel=True); the gateway route needs network='bridge' or a named network"
            )
        return "the channel route needs python3 in the image and channel=True"

    async def _host_bind_address(self, via: RouteKind) -> str:
        if via != "gateway":
            return "127.0.0.1"
        return await self._host_gateway()

    async def _host_gateway(self) -> str:
        """The container's IPv4 default gateway (``/proc/net/route``), if it is an address
        of this host (so a service can listen on it).

        Raises:
            HostRouteError: no default route, or the gateway is not this host's (a remote
                engine).
        """
        table = await self.exec(["cat", "/proc/net/route"], timeout=30)
        gateway = gateway_from_route_table(table.stdout) if table.exit_code == 0 else None
        if gateway is None:
            raise HostRouteError(
                f"{self.describe()} has no default gateway: no gateway route to the host",
                via="gateway",
            )
        if not _is_local_address(gateway):
            raise HostRouteError(
                f"{self.describe()} routes through {gateway}, which is not an address of this "
                "host (a remote engine?): use the channel route",
                via="gateway",
            )
        return gateway

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        if via == "channel":
            return await channel_route(self._channels, port)
        if via == "loopback":
            return HostRoute("loopback", "127.0.0.1", port)
        return HostRoute("gateway", await self._host_gateway(), port)

    async def _alive(self) -> bool:
        import docker.errors

        api = self._require_client().api
        try:
            info = await _blocking(
                lambda: api.inspect_container(self._require_id()), self.config, idempotent=True
            )
        except docker.errors.NotFound:
            return False
        state = info.get("State") or {}
        return bool(state.get("Running")) and not state.get("Paused")

    def _require_client(self) -> docker.DockerClient:
        if self._client is None:
            raise SandboxUnavailableError(f"{self.describe()} has no engine connection")
        return self._client

    def _require_id(self) -> str:
        if self._container_id is None:
            raise SandboxUnavailableError(f"{self.describe()} has no container")
        return self._container_id

    def _check_running_blocking(self) -> None:
        """Raise SandboxUnavailableError unless the container is running (blocking)."""
        import docker.errors

        api = self._require_client().api
        try:
            info = api.inspect_container(self._require_id())
        except docker.errors.NotFound:
            raise SandboxUnavailableError(f"{self.describe()} was removed") from None
        state = info.get("State") or {}
        if not state.get("Running") or state.get("Paused"):
            raise SandboxUnavailableError(
                f"{self.describe()} is not running ({state.get('Status', 'unknown')})"
            )

    async def _unavailable_if_dead(self) -> None:
        await _blocking(self._check_running_blocking, self.config, idempotent=True)

    def _gone_error(self, exc: docker.errors.APIError) -> SandboxUnavailableError:
        return SandboxUnavailableError(f"{self.describe()} is gone: {_api_message(exc)}")

    async def stop_processes(self) -> int:
        """Kill every process commands started that is still running; return how many.

        In a container this runtime created, that is every process outside the
        keep-alive's session, however it detached itself (``setsid``, ``env -i``). In an
        attached container, only processes carrying this runtime's environment mark are
        killed (the container's own processes are not ours).

        Raises:
            SandboxUnavailableError: the sandbox is closed, stopped or removed.
        """
        if not self._owned:
            return await super().stop_processes()
        self._check_open()
        # Every exec is a session of its own (docker exec calls setsid); the keep-alive and
        # init are session 1. So in an owned container "every process not in session 1" is
        # exactly what commands started, including daemons that double-forked or scrubbed
        # their environment. The agent (a session leader, by docker exec) is spared.
        agent = self._channels.info.agent_pid
        request, sink = self._request(
            sweep_argv("all", f"{MARK_VAR}={self._mark}", keep=agent), user="0"
        )
        with self._guard("stop_processes"):
            code = await self._run(request, sink)
        return self._swept(code, sink)

    # ------------------------------------------------------------------ exec

    def _request(
        self,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        limit: int = 1 << 20,
        user: str | None = None,
    ) -> tuple[ExecRequest, OutputSink]:
        """A request for the runtime's own commands (cwd ``/``, so a deleted workdir
        cannot break them)."""
        request = ExecRequest(
            argv=tuple(argv),
            cwd="/",
            env={},
            stdin=stdin,
            user=user,
            timeout=None,
            output_limit=limit,
        )
        return request, OutputSink(limit)

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        if (
            request.user is not None
            and _is_root_user(request.user)
            and not _is_root_user(self._default_user)
        ):
            # docker exec could become root in any container; a sandbox configured to
            # run as a non-root user keeps that as its ceiling, like any other backend.
            raise SandboxPermissionError(
                request.argv[0],
                f"cannot run as {request.user!r}: the sandbox runs as {self._default_user!r}",
            )
        if self._orphans:
            await self._kill_orphans()
        return await self._channels.exec(request, sink, lambda: self._run(request, sink))

    async def _run(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run a command (the runtime's own ones too, which may use root)."""
        if self._orphans:
            await self._kill_orphans()
        with anyio.CancelScope(shield=True):
            # Once the engine started the command, nothing may lose the handle on it.
            hijacked = await self._start_exec(request)
            channel = await _open_channel(hijacked)
        output = _ExecOutput(sink)
        try:
            if hijacked.leftover:
                output.feed(hijacked.leftover)
            async with anyio.create_task_group() as tg:
                if request.stdin:
                    tg.start_soon(_send_stdin, channel, request.stdin)
                await _pump(channel, output)
                tg.cancel_scope.cancel()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._await_announcement(channel, output)
                await _close_channel(channel, hijacked)
                await self._kill_group(output.pid)
            raise
        with anyio.CancelScope(shield=True):
            await _close_channel(channel, hijacked)
        try:
            return await self._exit_code(hijacked.exec_id, output, request)
        except SandboxTransportError:
            if output.pid is not None:  # lost track of a command that may still run
                self._orphans.add(output.pid)
            raise

    async def _start_exec(self, request: ExecRequest) -> _Hijacked:
        import docker.errors

        api = self._require_client().api
        cid = self._require_id()
        user = request.user if request.user is not None else self.config.user
        command = ["sh", "-c", _PRELUDE, request.cwd, *request.argv]
        environment = [f"{key}={value}" for key, value in request.env.items()]
        for text in (*command, *environment):
            try:
                text.encode("utf-8")  # the engine would turn a lone surrogate into U+FFFD
            except UnicodeEncodeError as exc:
                raise _not_engine_text(exc, _engine_name(self.config)) from None

        def create_and_start() -> _Hijacked:
            created = api.exec_create(
                cid,
                command,
                stdout=True,
                stderr=True,
                stdin=bool(request.stdin),
                user=user or "",
                environment=environment or None,
                workdir="/",
            )
            return _hijack(api, str(created["Id"]))

        try:
            return await _blocking(create_and_start, self.config)
        except docker.errors.APIError as exc:
            if _container_is_gone(exc):
                raise self._gone_error(exc) from None
            message = _api_message(exc)
            raise _engine_exec_error(message, request, self.describe()) from exc

    async def _await_announcement(self, channel: _Channel, output: _ExecOutput) -> None:
        """Read on (bounded) until the prelude said its PID: it does so at once."""
        with anyio.move_on_after(_KILL_WAIT):
            while not output.announced:
                chunk = await channel.receive()
                if not chunk:
                    return
                output.feed(chunk)

    async def _kill_group(self, pid: int | None, *, orphan: bool = False) -> None:
        """Kill a command's process group inside the container, and wait for the kill.

        Runs after the command's stream was closed: the engine handles one container's
        exit events in order, and the exit of a command whose output nobody reads waits
        for its stream, so the kill's own exit could wait behind it.
        """
        if pid is None:
            return
        import docker.errors

        api = self._require_client().api
        cid = self._require_id()

        if orphan:
            argv = ["sh", "-c", _KILL_ORPHAN, "sh", str(pid), f"{MARK_VAR}={self._mark}"]
        else:
            argv = ["sh", "-c", _KILL_GROUP, "sh", str(pid)]

        def kill() -> None:
            created = api.exec_create(cid, argv, user="0")
            api.exec_start(str(created["Id"]))

        try:
            with anyio.move_on_after(_KILL_WAIT) as waited:
                await _blocking(kill, self.config, abandon_on_cancel=True)
        except (docker.errors.APIError, SandboxError) as exc:
            log.warning(
                "could not kill process group %s in %s (retried before the next command): %s",
                pid,
                self.describe(),
                exc,
            )
            self._orphans.add(pid)
        else:
            if waited.cancelled_caught:
                self._orphans.add(pid)

    async def _kill_orphans(self) -> None:
        """Kill the process groups earlier kills missed, if they are still this runtime's."""
        orphans, self._orphans = self._orphans, set()
        with anyio.CancelScope(shield=True):
            for pid in sorted(orphans):
                await self._kill_group(pid, orphan=True)

    async def _exit_code(self, exec_id: str, output: _ExecOutput, request: ExecRequest) -> int:
        import docker.errors
        from tenacity import AsyncRetrying, retry_if_result, wait_exponential

        api = self._require_client().api

        async def inspect() -> dict[str, Any]:
            info: dict[str, Any] = await _blocking(
                lambda: api.exec_inspect(exec_id), self.config, idempotent=True
            )
            return info

        # The output can end before the process does (it closed its stdout and stderr):
        # wait for the exit like a local wait() would; timeout= bounds it.
        polling = AsyncRetrying(
            retry=retry_if_result(lambda info: bool(info.get("Running"))),
            wait=wait_exponential(multiplier=0.005, max=0.25),
            sleep=anyio.sleep,
        )
        if output.error is not None:
            raise _prelude_error(output.error, request)
        if output.pid is None:
            await self._unavailable_if_dead()
            raise _engine_exec_error(output.foreign_text, request, self.describe())
        try:
            info: dict[str, Any] = await polling(inspect)
        except docker.errors.APIError as exc:
            await self._unavailable_if_dead()
            raise SandboxError(
                f"{self.describe()}: lost track of a command: {_api_message(exc)}"
            ) from exc
        code = info.get("ExitCode")
        if code is None or code >= 128:
            await self._unavailable_if_dead()
        if code is None:
            raise SandboxError(f"{self.describe()}: the engine reported no exit code")
        if code == _SIGKILLED and await self._died_with_container():
            raise SandboxUnavailableError(
                f"{self.describe()} died while running {request.argv[0]!r}"
            )
        return int(code)

    async def _open_agent_stream(self, interpreter: str | None = None) -> ChannelTransport:
        """Start the channel agent with stdin attached (as the sandbox's default user);
        ``interpreter``: the absolute path pinned at the first start (no shell, no PATH)."""
        import docker.errors

        api = self._require_client().api
        cid = self._require_id()

        def open_stream() -> _Hijacked:
            created = api.exec_create(
                cid,
                agent_command(interpreter),
                stdin=True,
                stdout=True,
                stderr=True,
                user=self.config.user or "",
                workdir="/",
            )
            return _hijack(api, str(created["Id"]))

        try:
            hijacked = await _blocking(open_stream, self.config)
        except docker.errors.APIError as exc:
            if _container_is_gone(exc):
                raise self._gone_error(exc) from None
            raise SandboxError(
                f"{self.describe()}: the engine refused the channel agent: {_api_message(exc)}"
            ) from exc
        return _AgentStream(hijacked)

    async def _verify_agent_files(self, digests: Mapping[str, bytes]) -> str | None:
        """Before the channel agent restarts: the engine's own diff of the container against
        its image (no sandbox code runs) shows no change to the files the first agent ran
        from, to the dynamic loader's configuration, or to a shared library. The image is
        trusted; whatever a command changed in those places is not."""
        return _untrusted_change(await self._changed_paths(), digests)

    async def _changed_paths(self) -> list[str]:
        """What the engine's diff of the container against its image lists, sorted."""
        import docker.errors

        api = self._require_client().api
        cid = self._require_id()
        try:
            changes = await _blocking(lambda: api.diff(cid), self.config, idempotent=True)
        except docker.errors.NotFound as exc:
            raise self._gone_error(exc) from None
        return sorted(str(change.get("Path", "")) for change in changes or [])

    async def _verify_attached_python(self) -> str | None:
        """Before the first agent starts in a container this runtime did not create
        (commands may have run there: a rollout's): no ``python*`` anywhere and no system
        library changed since the image (the engine's diff). A container of our own is new."""
        if self._owned:
            return None
        changed = await self._changed_paths()
        reason = _untrusted_change(changed, {})
        if reason is not None:
            return reason
        for path in changed:
            if posixpath.basename(path).startswith("python"):
                return f"{path} changed in the container (python3 on PATH may not be the image's)"
        return None

    async def _stopped(self) -> bool:
        """The channel's probe during a silence: stopped, paused or removed."""
        import docker.errors

        try:
            return not await self._alive()
        except docker.errors.APIError as exc:
            log.debug("%s: inspect failed during a channel probe: %s", self.describe(), exc)
            return False

    async def _died_with_container(self) -> bool:
        """After a command died of SIGKILL: was that the container going down?

        A killed or stopped container takes its commands with it (SIGKILL), and the
        engine may still call it running for a moment. A probe exec settles it: it works
        in a live container and fails in a dying one; if it fails, the container's state
        is watched (bounded) for the stop the engine is about to report.
        """
        from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_fixed

        request, sink = self._request(["true"], user="0")
        try:
            with anyio.fail_after(_KILL_WAIT):
                if await self._run(request, sink) == 0:
                    return False
        except SandboxUnavailableError:
            return True
        except (SandboxError, TimeoutError) as exc:
            log.debug("probe after SIGKILL failed in %s: %s", self.describe(), exc)
        watching = AsyncRetrying(
            retry=retry_if_result(lambda running: running),
            stop=stop_after_delay(_DEATH_WATCH),
            wait=wait_fixed(0.05),
            sleep=anyio.sleep,
            retry_error_callback=lambda state: True,
        )
        running: bool = await watching(self._alive)
        return not running

    # ------------------------------------------------------------------ files

    def _archive_url(self) -> str:
        api = self._require_client().api
        return f"{api.base_url}/v{api.api_version}/containers/{self._require_id()}/archive"

    def _stat_blocking(self, path: str) -> dict[str, Any] | None:
        """The archive API's stat of ``path`` (not following a final symlink); ``None``
        when nothing is there or a parent is not a directory."""
        api = self._require_client().api
        response = api.head(self._archive_url(), params={"path": path})
        with contextlib.closing(response):
            if response.status_code == 404:
                return None
            if response.status_code >= 400:
                # A HEAD answer has no body: ask again to learn what went wrong.
                error = self._archive_failure_blocking(path)
                if isinstance(error, SandboxNotADirectoryError):
                    return None
                raise error
            return _decode_stat(response.headers.get("X-Docker-Container-Path-Stat"))

    def _archive_failure_blocking(self, path: str) -> SandboxError:
        api = self._require_client().api
        response = api.get(self._archive_url(), params={"path": path}, stream=True, headers=_RAW)
        with contextlib.closing(response):
            if response.status_code < 400:
                return SandboxError(f"the engine could not stat {path!r}")
            return _archive_error(response.status_code, _response_message(response), path)

    def _resolved_stat_blocking(self, path: str) -> tuple[str, dict[str, Any] | None]:
        """Follow a final symlink once (the engine resolves the whole chain)."""
        stat = self._stat_blocking(path)
        if stat is not None and _is_symlink(stat) and stat.get("linkTarget"):
            target = str(stat["linkTarget"])
            return target, self._stat_blocking(target)
        return path, stat

    async def _read(self, path: str, limit: int) -> bytes:
        return await self._channels.read(path, limit, lambda: self._plain_read(path, limit))

    async def _plain_read(self, path: str, limit: int) -> bytes:
        if not self._files_as_root:
            return await self._read_by_exec(path, limit)
        return await _blocking(
            lambda: self._read_blocking(path, limit), self.config, idempotent=True
        )

    def _read_blocking(self, path: str, limit: int) -> bytes:
        self._check_running_blocking()
        api = self._require_client().api
        target = path
        for _ in range(3):
            response = api.get(
                self._archive_url(), params={"path": target}, stream=True, headers=_RAW
            )
            with contextlib.closing(response):
                if response.status_code >= 400:
                    raise _archive_error(response.status_code, _response_message(response), path)
                stat = _decode_stat(response.headers.get("X-Docker-Container-Path-Stat")) or {}
                if _is_symlink(stat) and stat.get("linkTarget"):
                    target = str(stat["linkTarget"])
                    continue
                if _is_dir(stat):
                    raise SandboxIsADirectoryError(path)
                if int(stat.get("mode", 0)) & _MODE_PIPE_OR_SOCKET:
                    raise SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
                if int(stat.get("size", 0)) > limit:
                    raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
                return _single_file(response, path, limit)
        raise error_for_errno(40, path, "too many levels of symbolic links")

    async def _write(self, path: str, data: bytes) -> None:
        await self._channels.write(path, data, lambda: self._plain_write(path, data))

    async def _plain_write(self, path: str, data: bytes) -> None:
        if not self._files_as_root:
            await self._write_by_exec(path, data)
            return
        temp, target = await _blocking(lambda: self._write_temp_blocking(path, data), self.config)
        await self._replace(temp, target, path)

    def _write_temp_blocking(self, path: str, data: bytes) -> tuple[str, str]:
        """Upload ``data`` as a fresh temporary file next to the target: the engine
        extracts an archive in place (the old file removed first), so a cut upload would
        otherwise leave a partial file. Returns (temporary file, target)."""
        self._check_running_blocking()
        target, stat = self._resolved_stat_blocking(path)
        if path.endswith("/") or (stat is not None and _is_dir(stat)):
            raise SandboxIsADirectoryError(path)
        mode = int(stat["mode"]) & 0o777 if stat is not None else 0o644
        # The archive API cleans paths lexically ("a/../f" is "f"); the rename must too.
        target = posixpath.normpath(target)
        parent = posixpath.dirname(target) or "/"
        name = f"{_TEMP_PREFIX}{uuid.uuid4().hex[:16]}"
        archive = _file_tar(name, data, mode)
        if not self._put_archive_blocking(parent, archive, path):
            self._make_dirs_blocking(parent, path)
            if not self._put_archive_blocking(parent, archive, path):
                raise SandboxFileNotFoundError(path, "the parent directory vanished")
        return posixpath.join(parent, name), target

    async def _replace(self, temp: str, target: str, shown: str) -> None:
        """Rename the uploaded temporary file over the target (one exec)."""
        request, sink = self._request(["sh", "-c", _REPLACE_SCRIPT, "sh", temp, target])
        code = await self._run(request, sink)
        if code != 0:
            raise shell_error(shown, sink)

    def _put_archive_blocking(self, directory: str, archive: bytes, shown: str) -> bool:
        """Extract ``archive`` into ``directory``; ``False`` if the directory is missing."""
        api = self._require_client().api
        response = api.put(
            self._archive_url(),
            params={"path": directory, "noOverwriteDirNonDir": "true"},
            data=archive,
            headers={"Content-Type": "application/x-tar"},
        )
        with contextlib.closing(response):
            if response.status_code == 404 and "no such container" not in response.text.lower():
                return False
            if response.status_code >= 400:
                raise _archive_error(response.status_code, _response_message(response), shown)
        return True

    def _make_dirs_blocking(self, directory: str, shown: str) -> None:
        """Create ``directory`` and its missing parents with one archive of directory
        entries, extracted into the deepest ancestor that exists (never re-created, so
        its owner and mode stay as they are)."""
        missing: list[str] = []
        current = directory.rstrip("/") or "/"
        while current != "/":
            _, stat = self._resolved_stat_blocking(current)
            if stat is not None:
                if not _is_dir(stat):
                    raise SandboxNotADirectoryError(shown, f"{current} is not a directory")
                break
            current, name = posixpath.split(current)
            missing.append(name)
        if not missing:
            return
        names = []
        prefix = ""
        for name in reversed(missing):
            prefix = f"{prefix}{name}/"
            names.append(prefix)
        if not self._put_archive_blocking(current, _dirs_tar(names), shown):
            raise SandboxFileNotFoundError(shown, "a parent directory vanished")

    async def _exists(self, path: str) -> bool:
        return await self._channels.exists(path, lambda: self._plain_exists(path))

    async def _remove(self, path: str) -> None:
        await self._channels.remove(path, lambda: super(DockerRuntime, self)._remove(path))

    async def _plain_exists(self, path: str) -> bool:
        if not self._files_as_root:
            return await super()._exists(path)

        def exists() -> bool:
            self._check_running_blocking()
            return self._stat_blocking(path) is not None

        return await _blocking(exists, self.config, idempotent=True)

    async def _upload(self, source: Path, remote: str) -> None:
        if not self._files_as_root or await anyio.Path(source).is_file():
            await super()._upload(source, remote)
            return
        archive = await anyio.to_thread.run_sync(_tree_tar, source)

        def upload() -> None:
            self._check_running_blocking()
            _, stat = self._resolved_stat_blocking(remote)
            if stat is None:
                self._make_dirs_blocking(remote, remote)
            elif not _is_dir(stat):
                raise SandboxNotADirectoryError(remote)
            if not self._put_archive_blocking(remote, archive, remote):
                raise SandboxFileNotFoundError(remote, "the directory vanished")

        await _blocking(upload, self.config)

    async def _download(self, remote: str, local: Path, *, skip_unsafe: bool = False) -> None:
        if not self._files_as_root:
            await super()._download(remote, local, skip_unsafe=skip_unsafe)
            return
        await _blocking(
            lambda: self._download_blocking(remote, local, skip_unsafe),
            self.config,
            idempotent=True,
        )

    def _download_blocking(self, remote: str, local: Path, skip_unsafe: bool = False) -> None:
        self._check_running_blocking()
        target, stat = self._resolved_stat_blocking(remote)
        if stat is None:
            raise SandboxFileNotFoundError(remote)
        limit = self.config.read_limit
        if not _is_dir(stat):
            _write_local_file(local, self._read_blocking(target, limit))
            return
        api = self._require_client().api
        response = api.get(self._archive_url(), params={"path": target}, stream=True, headers=_RAW)
        with contextlib.closing(response), tempfile.TemporaryFile() as spool:
            if response.status_code >= 400:
                raise _archive_error(response.status_code, _response_message(response), remote)
            size = 0
            for chunk in response.iter_content(_STREAM_CHUNK):
                size += len(chunk)
                if size > limit + _TAR_SLACK:
                    raise OutputLimitExceededError(f"download of {remote!r}", limit, path=remote)
                spool.write(chunk)
            spool.seek(0)
            top = posixpath.basename(target.rstrip("/")) or "."
            _extract_tree(spool, top, local, skip_unsafe=skip_unsafe)

    # ------------------------------------------------------------------ files as a non-root user

    async def _read_by_exec(self, path: str, limit: int) -> bytes:
        request, sink = self._request(
            ["sh", "-c", _READ_SCRIPT, "sh", path, str(limit)], limit=limit + 1
        )
        code = await self._run(request, sink)
        if code == 21:
            raise SandboxIsADirectoryError(path)
        if code == 27 or sink.overflowed:
            raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
        if code != 0:
            raise shell_error(path, sink)
        return bytes(sink.stdout)

    async def _write_by_exec(self, path: str, data: bytes) -> None:
        request, sink = self._request(["sh", "-c", _WRITE_SCRIPT, "sh", path], stdin=data)
        code = await self._run(request, sink)
        if code == 21:
            raise SandboxIsADirectoryError(path)
        if code == 20:
            raise SandboxNotADirectoryError(path, "a parent is not a directory")
        if code != 0:
            raise shell_error(path, sink)

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Every container carrying the ``vf-sandbox.session`` label on the engine.

        Raises:
            SandboxTransportError: the engine did not answer (after retries).
        """
        cfg = config if isinstance(config, DockerConfig) else DockerConfig()

        def listing() -> list[SandboxInfo]:
            api = _client_for(cfg).api
            found = []
            for entry in api.containers(all=True, filters={"label": ownership.SESSION}):
                labels = {str(k): str(v) for k, v in (entry.get("Labels") or {}).items()}
                found.append(
                    SandboxInfo(
                        backend=cls.name,
                        id=str(entry["Id"]),
                        labels=labels,
                        state=str(entry.get("State", "unknown")),
                        created=labels.get(ownership.CREATED),
                    )
                )
            return found

        return await _blocking(listing, cfg, idempotent=True)

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Force-remove one container found by :meth:`list_sandboxes` (gone already is fine).

        Raises:
            SandboxTransportError: the engine did not answer (after retries).
            SandboxError: the engine refused to remove it.
        """
        import docker.errors

        cfg = config if isinstance(config, DockerConfig) else DockerConfig()

        def remove() -> None:
            try:
                _client_for(cfg).api.remove_container(info.id, force=True, v=True)
            except docker.errors.NotFound:
                return
            except docker.errors.APIError as exc:
                if "already in progress" in _api_message(exc):
                    return
                raise SandboxError(
                    f"could not remove docker container {info.id}: {_api_message(exc)}"
                ) from exc

        await _blocking(remove, cfg, idempotent=True)


_LIBRARY_DIRS = (
    "/lib",
    "/lib32",
    "/lib64",
    "/usr/lib",
    "/usr/lib32",
    "/usr/lib64",
    "/usr/local/lib",
)


def _untrusted_change(changed: list[str], digests: Mapping[str, bytes]) -> str | None:
    """Why the container's changes (sorted paths, the engine's diff) make the channel agent's
    files untrustworthy, or ``None``."""
    for path in changed:
        if path in digests:
            return f"{path} changed in the container"
    # Leaves only: a directory listed because something under it changed says nothing.
    parents = set()
    for path in changed:
        parent = posixpath.dirname(path)
        while parent not in parents and parent != "/":
            parents.add(parent)
            parent = posixpath.dirname(parent)
    for path in changed:
        if path not in parents and _protected_system_path(path):
            return f"{path} changed in the container"
    return None


def _protected_system_path(path: str) -> bool:
    """A path whose change makes the channel agent's interpreter untrustworthy: a shared
    library or the Python standard library (site-/dist-packages aside: ``-I -S`` never
    imports from them), the dynamic loader's configuration, a ``python`` binary."""
    if path.startswith("/etc/ld.so"):
        return True
    name = posixpath.basename(path)
    if posixpath.dirname(path) in ("/bin", "/usr/bin", "/usr/local/bin") and name.startswith(
        "python"
    ):
        return True
    if not any(path == d or path.startswith(d + "/") for d in _LIBRARY_DIRS):
        return False
    return "/site-packages" not in path and "/dist-packages" not in path


async def _send_stdin(channel: _Channel, data: bytes) -> None:
    view = memoryview(data)
    for offset in range(0, len(view), _STDIN_CHUNK):
        if not await channel.send(bytes(view[offset : offset + _STDIN_CHUNK])):
            return
    await channel.send_eof()


async def _pump(channel: _Channel, output: _ExecOutput) -> None:
    """Feed the stream to the output until the engine closes it or the sink is full
    (then the sink has already cancelled the call)."""
    while True:
        chunk = await channel.receive()
        if not chunk:
            return
        if not output.feed(chunk):
            await anyio.lowlevel.checkpoint()


async def _close_channel(channel: _Channel, hijacked: _Hijacked) -> None:
    await channel.aclose()
    with contextlib.suppress(Exception):
        hijacked.response.close()


__all__ = ["DEFAULT_IMAGE", "DockerConfig", "DockerRuntime"]


def gateway_from_route_table(text: str) -> str | None:
    """The IPv4 default gateway in the text of a Linux ``/proc/net/route``, or ``None``."""
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 3 and fields[1] == "00000000" and fields[2] != "00000000":
            raw = bytes.fromhex(fields[2])
            return ".".join(str(b) for b in reversed(raw))
    return None


def _is_local_address(address: str) -> bool:
    """Whether ``address`` belongs to an interface of this host (it can be bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True
