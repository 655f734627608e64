"""Engine access for the ``docker`` runtime: one SDK client per engine, blocking SDK calls in
worker threads (with retries; their exceptions read by :mod:`.sdk_errors`), and the
container-level calls every module needs (inspect, diff, kill, remove, list).

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
    ProvisioningError,
    SandboxError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from ..models import SandboxInfo
from .config import DockerConfig
from .sdk_errors import Refusal, api_message, engine_answers, gone_error, refused, sdk_errors

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


def thread_limiter() -> anyio.CapacityLimiter:
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


def engine_name(config: DockerConfig) -> str:
    return config.base_url or "the default Docker engine"


def client_for(config: DockerConfig) -> docker.DockerClient:
    """A process-wide client per engine (blocking: asks the engine for its API version).

    Raises:
        ProvisioningError: the docker SDK is not installed (every SDK call starts here, so a
            missing extra is this one typed error, never an ImportError).
    """
    try:
        import docker
    except ImportError as exc:
        raise ProvisioningError(
            "the docker runtime needs the docker SDK: pip install 'vf-sandbox[docker]'"
        ) from exc

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


def _guard(fn: Callable[[], T], engine: str, refusal: Refusal | None) -> Callable[[], T]:
    def guarded() -> T:
        with sdk_errors(engine, refusal):
            return fn()

    return guarded


async def engine_call(
    fn: Callable[[], T],
    config: DockerConfig,
    *,
    idempotent: bool = False,
    abandon_on_cancel: bool = False,
    refusal: Refusal | None = None,
) -> T:
    """Run a blocking SDK call in a worker thread, its exceptions read by the one table
    (:func:`.sdk_errors.sdk_errors`; ``refusal`` says what an engine's "no" means here).

    A failure to reach the engine becomes :class:`SandboxTransportError`; idempotent
    calls are retried (bounded, exponential backoff) before it surfaces. With
    ``abandon_on_cancel`` a cancelled caller stops waiting for the thread (which then
    ends on the engine's answer or the client's timeout).
    """
    guarded = _guard(fn, engine_name(config), refusal)

    async def once() -> T:
        return await anyio.to_thread.run_sync(
            guarded, abandon_on_cancel=abandon_on_cancel, limiter=thread_limiter()
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
    same transport guard and bounded retries as :func:`engine_call`.

    Raises:
        SandboxTransportError: the engine did not answer (after retries).
    """
    guarded = _guard(fn, engine_name(config), None)
    if config.retries == 0:
        return guarded()
    from tenacity import Retrying

    return Retrying(**_transport_retries(config))(guarded)


def engine_has_init(client: docker.DockerClient) -> bool:
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
class ContainerRef:
    """One container on its engine: what every call about it needs."""

    api: Any
    id: str
    config: DockerConfig
    describe: str
    """The runtime's name for it in messages (``Runtime.describe()``)."""
    user: str = ""
    """Who commands run as when the request names nobody: the sandbox's default user ("":
    the container's own, root)."""


def check_running_blocking(ref: ContainerRef) -> None:
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


async def check_running(ref: ContainerRef) -> None:
    """Raise SandboxUnavailableError unless the container is running."""
    await engine_call(lambda: check_running_blocking(ref), ref.config, idempotent=True)


async def inspect_container(ref: ContainerRef) -> dict[str, Any]:
    """The engine's inspection of the container.

    Raises:
        SandboxUnavailableError: the container was removed.
        SandboxTransportError: the engine did not answer (after retries).
    """
    import docker.errors

    try:
        info: dict[str, Any] = await engine_call(
            lambda: ref.api.inspect_container(ref.id), ref.config, idempotent=True
        )
    except docker.errors.NotFound as exc:
        raise gone_error(ref.describe, exc) from None
    return info


async def is_running(ref: ContainerRef) -> bool:
    """Running and not paused; ``False`` once removed (docker.errors.APIError otherwise)."""
    import docker.errors

    try:
        info = await engine_call(
            lambda: ref.api.inspect_container(ref.id), ref.config, idempotent=True
        )
    except docker.errors.NotFound:
        return False
    state = info.get("State") or {}
    return bool(state.get("Running")) and not state.get("Paused")


async def is_stopped(ref: ContainerRef) -> bool:
    """The channel's probe during a silence: stopped, paused or removed (an engine that
    answers with an error says nothing: ``False``)."""
    import docker.errors

    try:
        return not await is_running(ref)
    except docker.errors.APIError as exc:
        log.debug("%s: inspect failed during a channel probe: %s", ref.describe, exc)
        return False


async def changed_paths(ref: ContainerRef) -> list[str]:
    """What the engine's diff of the container against its image lists, sorted."""
    import docker.errors

    try:
        changes = await engine_call(lambda: ref.api.diff(ref.id), ref.config, idempotent=True)
    except docker.errors.NotFound as exc:
        raise gone_error(ref.describe, exc) from None
    return sorted(str(change.get("Path", "")) for change in changes or [])


async def kill_as_root(ref: ContainerRef, argv: list[str]) -> None:
    """Run a kill as root (not through the wrapper) and wait for it, at most ``KILL_WAIT`` seconds.

    Raises:
        SandboxError: the engine refused the kill, or did not confirm it in time.
    """

    def kill() -> None:
        created = ref.api.exec_create(ref.id, argv, user="0")
        ref.api.exec_start(str(created["Id"]))

    with anyio.move_on_after(KILL_WAIT) as waited:
        refusal = refused("the engine refused the kill")
        await engine_call(kill, ref.config, abandon_on_cancel=True, refusal=refusal)
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

    def remove() -> bool:
        try:
            api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            return True
        except docker.errors.APIError as exc:
            if "already in progress" in api_message(exc):
                return False
            raise
        return True

    with engine_answers(refused(f"could not remove {describe}")):
        removed = remove()
    if not removed:
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
    for entry in api.containers(all=True, filters={"label": ownership.CREATOR}):
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
