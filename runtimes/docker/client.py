"""Engine access for the ``docker`` runtime: one SDK client per engine, blocking SDK calls in
worker threads (with retries and transport-failure mapping), and the engine's answers read
as typed errors.

Everything goes through the docker SDK (``docker-py``) and the Engine API, never the
``docker`` CLI, so a remote engine (``tcp://``, ``ssh://``) works like the local socket.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel

from .. import ownership
from ..errors import (
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from ..models import SandboxInfo
from .config import DockerConfig

if TYPE_CHECKING:
    import docker
    import docker.errors

log = logging.getLogger("runtimes.docker")

T = TypeVar("T")

_THREADS = 64
KILL_WAIT = 10.0
"""Seconds a kill (or the wait for a command's announcement before one) may take."""

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


def close_idle_connections() -> None:
    """Close the engine connections the process-wide clients keep idle for reuse (up to
    ``_THREADS`` each); their next call opens new ones. Call it while no call is in flight
    (a leak check; a process about to fork)."""
    with _CLIENTS_LOCK:
        clients = list(_CLIENTS.values())
    for client in clients:
        client.close()


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
    # requests scans os.environ for proxy settings on every request: slower, and a KeyError
    # when another thread removes a variable during the scan (seen: a teardown's monkeypatch
    # under a removal in the reaper's thread). The engine is not reached through a proxy.
    client.api.trust_env = False
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
    from tenacity import AsyncRetrying

    return await AsyncRetrying(sleep=anyio.sleep, **_transport_retries(config))(once)


def _transport_retries(config: DockerConfig) -> dict[str, Any]:
    """tenacity's arguments for an idempotent engine call: transport errors only, bounded,
    exponential backoff."""
    from tenacity import retry_if_exception_type, stop_after_attempt, wait_exponential

    return {
        "retry": retry_if_exception_type(SandboxTransportError),
        "stop": stop_after_attempt(config.retries + 1),
        "wait": wait_exponential(multiplier=0.1, max=2.0),
        "reraise": True,
    }


def retried_in_this_thread(fn: Callable[[], T], config: DockerConfig) -> T:
    """An idempotent blocking SDK call made here (a worker thread of our own), with the
    same transport guard and bounded retries as :func:`_blocking`.

    Raises:
        SandboxTransportError: the engine did not answer (after retries).
    """
    guarded = _transport_guard(fn, _engine_name(config))
    if config.retries == 0:
        return guarded()
    from tenacity import Retrying

    return Retrying(**_transport_retries(config))(guarded)


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


@dataclass(frozen=True)
class _ContainerRef:
    """One container on its engine: what every call about it needs."""

    api: Any
    id: str
    config: DockerConfig
    describe: str
    """The runtime's name for it in messages (``Runtime.describe()``)."""
    user: str = ""
    """Who commands run as when the request names nobody: the sandbox's default user ("":
    the container's own, root)."""


def gone_error(ref: _ContainerRef, exc: docker.errors.APIError) -> SandboxUnavailableError:
    return SandboxUnavailableError(f"{ref.describe} is gone: {_api_message(exc)}")


def check_running_blocking(ref: _ContainerRef) -> None:
    """Raise SandboxUnavailableError unless the container is running (blocking)."""
    import docker.errors

    try:
        info = ref.api.inspect_container(ref.id)
    except docker.errors.NotFound:
        raise SandboxUnavailableError(f"{ref.describe} was removed") from None
    state = info.get("State") or {}
    if not state.get("Running") or state.get("Paused"):
        raise SandboxUnavailableError(
            f"{ref.describe} is not running ({state.get('Status', 'unknown')})"
        )


async def check_running(ref: _ContainerRef) -> None:
    """Raise SandboxUnavailableError unless the container is running."""
    await _blocking(lambda: check_running_blocking(ref), ref.config, idempotent=True)


async def inspect_container(ref: _ContainerRef) -> dict[str, Any]:
    """The engine's inspection of the container.

    Raises:
        SandboxUnavailableError: the container was removed.
        SandboxTransportError: the engine did not answer (after retries).
    """
    import docker.errors

    try:
        info: dict[str, Any] = await _blocking(
            lambda: ref.api.inspect_container(ref.id), ref.config, idempotent=True
        )
    except docker.errors.NotFound as exc:
        raise gone_error(ref, exc) from None
    return info


async def is_running(ref: _ContainerRef) -> bool:
    """Running and not paused; ``False`` once removed (docker.errors.APIError otherwise)."""
    import docker.errors

    try:
        info = await _blocking(
            lambda: ref.api.inspect_container(ref.id), ref.config, idempotent=True
        )
    except docker.errors.NotFound:
        return False
    state = info.get("State") or {}
    return bool(state.get("Running")) and not state.get("Paused")


async def changed_paths(ref: _ContainerRef) -> list[str]:
    """What the engine's diff of the container against its image lists, sorted."""
    import docker.errors

    try:
        changes = await _blocking(lambda: ref.api.diff(ref.id), ref.config, idempotent=True)
    except docker.errors.NotFound as exc:
        raise gone_error(ref, exc) from None
    return sorted(str(change.get("Path", "")) for change in changes or [])


async def kill_as_root(ref: _ContainerRef, argv: list[str]) -> None:
    """Run a kill as root (not through the wrapper) and wait for it, at most ``KILL_WAIT`` seconds.

    Raises:
        SandboxError: the engine refused the kill, or did not confirm it in time.
    """
    import docker.errors

    def kill() -> None:
        created = ref.api.exec_create(ref.id, argv, user="0")
        ref.api.exec_start(str(created["Id"]))

    try:
        with anyio.move_on_after(KILL_WAIT) as waited:
            await _blocking(kill, ref.config, abandon_on_cancel=True)
    except docker.errors.APIError as exc:
        raise SandboxError(f"the engine refused the kill: {_api_message(exc)}") from exc
    if waited.cancelled_caught:
        raise SandboxTransportError(f"the kill was not confirmed within {KILL_WAIT:g}s")


REMOVAL_WAIT = 60.0
"""How long a removal someone else started (the engine says "already in progress") is awaited."""


def remove_container_blocking(api: Any, container_id: str, describe: str) -> None:
    """Force-remove a container with its anonymous volumes; returns once it is gone.

    Gone already is fine. A removal already in progress (started by another process, or
    by one that was killed after asking) is waited for, so that nothing listed afterwards
    still shows the container.

    Raises:
        SandboxError: the engine refused to remove it, or a removal in progress did not
            end within ``REMOVAL_WAIT`` seconds.
    """
    import docker.errors

    try:
        api.remove_container(container_id, force=True, v=True)
    except docker.errors.NotFound:
        return
    except docker.errors.APIError as exc:
        if "already in progress" not in _api_message(exc):
            raise SandboxError(f"could not remove {describe}: {_api_message(exc)}") from exc
        _wait_until_removed(api, container_id, describe)


def _wait_until_removed(api: Any, container_id: str, describe: str) -> None:
    import docker.errors

    deadline = time.monotonic() + REMOVAL_WAIT
    gap = 0.02
    while time.monotonic() < deadline:
        try:
            api.inspect_container(container_id)
        except docker.errors.NotFound:
            return
        time.sleep(gap)
        gap = min(gap * 2, 0.5)
    raise SandboxError(f"the removal of {describe} did not end within {REMOVAL_WAIT:g}s")


def list_labelled_blocking(api: Any, backend: str) -> list[SandboxInfo]:
    """Every container carrying the ``vf-sandbox.session`` label on the engine (blocking)."""
    found = []
    for entry in api.containers(all=True, filters={"label": ownership.SESSION}):
        labels = {str(k): str(v) for k, v in (entry.get("Labels") or {}).items()}
        found.append(
            SandboxInfo(
                backend=backend,
                id=str(entry["Id"]),
                labels=labels,
                state=str(entry.get("State", "unknown")),
                created=labels.get(ownership.CREATED),
            )
        )
    return found
