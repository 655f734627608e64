"""The boundary to Ray: connecting, awaiting a call from any event loop, and the one table
that reads Ray's exceptions as typed errors.

Ray is imported here, lazily (:func:`ray_module`): ``import runtimes`` never imports it.
A call's reference is awaited directly under asyncio and through a worker thread under trio
(:func:`settle`); while a call waits longer than a moment, the sandbox's actor is probed, so
a node that died or went silent ends the call with
:class:`~runtimes.errors.SandboxUnavailableError` within ``dead_after`` seconds, never a hang.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable
from types import ModuleType
from typing import Any, TypeVar

import anyio
from anyio.lowlevel import RunVar

from ..errors import (
    ProvisioningError,
    SandboxError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from ..portal import running_event_loop

__all__ = [
    "connect",
    "node_alive",
    "probe_after",
    "ray_error",
    "ray_module",
    "retried",
    "settle",
    "watched",
]

log = logging.getLogger("runtimes.ray")

T = TypeVar("T")

probe_after = 1.0
"""Seconds a call may wait before its actor is probed (a quick call never is)."""

_THREADS: RunVar[anyio.CapacityLimiter] = RunVar("vf_sandbox_ray_threads")
"""Per event loop: the worker threads its calls may hold (one per call a trio caller has in
flight, and the node table's lookups)."""


def _limiter() -> anyio.CapacityLimiter:
    try:
        return _THREADS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(512)
        _THREADS.set(limiter)
        return limiter


_CONNECT = threading.Lock()


def ray_module() -> ModuleType:
    """Ray, imported now.

    Raises:
        ProvisioningError: Ray is not installed (``pip install 'vf-sandbox[ray]'``).
    """
    try:
        import ray
    except ImportError as exc:
        raise ProvisioningError(
            "the ray runtime needs Ray: pip install 'vf-sandbox[ray]' (docs/ray.md)"
        ) from exc
    return ray


def connect(address: str | None, namespace: str | None) -> ModuleType:
    """Ray, connected to the cluster: the one this process joined already, else ``address``
    (``None``: ``"auto"``, the cluster this machine is a node of).

    Raises:
        SandboxTransportError: the cluster cannot be reached.
    """
    ray = ray_module()
    with _CONNECT:
        if ray.is_initialized():
            return ray
        try:
            ray.init(
                address=address or "auto",
                namespace=namespace,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise SandboxTransportError(
                f"cannot connect to the Ray cluster at {address or 'auto'}: {exc}"
            ) from exc
    return ray


def ray_error(exc: BaseException, what: str) -> BaseException:
    """The typed error for what Ray raised while ``what`` waited (the one table).

    A typed error the node raised is itself; an actor or node that died, or an object lost
    with it, is :class:`SandboxUnavailableError`; any other Ray error (the cluster connection)
    is :class:`SandboxTransportError`; anything else the node raised is a
    :class:`SandboxError` with it attached.
    """
    from ray import exceptions as rx

    if isinstance(exc, rx.RayTaskError):  # before SandboxError: Ray's copy subclasses the cause
        cause = exc.cause
        if isinstance(cause, SandboxError):
            return cause
        if isinstance(cause, rx.RayError):
            return ray_error(cause, what)
        return SandboxError(f"{what} failed unexpectedly on its node: {cause!r}")
    gone = (
        rx.ActorDiedError,
        rx.OwnerDiedError,
        rx.ObjectLostError,
        rx.NodeDiedError,
        rx.WorkerCrashedError,
        rx.TaskCancelledError,
    )
    if isinstance(exc, SandboxError):
        return exc
    if isinstance(exc, gone):
        return SandboxUnavailableError(f"{what}: the sandbox's node or actor is gone ({exc})")
    if isinstance(exc, rx.RayError | ConnectionError | OSError):
        return SandboxTransportError(f"{what}: the Ray cluster failed the call ({exc})")
    return exc


async def node_alive(node_id: str) -> bool:
    """Whether the cluster still lists the node alive (asked of the GCS in a worker thread).

    Raises:
        SandboxTransportError: the cluster cannot be reached.
    """
    ray = ray_module()

    def alive() -> bool:
        return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())

    try:
        return await anyio.to_thread.run_sync(alive, limiter=_limiter())
    except Exception as exc:
        raise ray_error(exc, "listing the cluster's nodes") from exc


async def settle(ref: Any, what: str) -> Any:
    """The value of one Ray call, awaited on the caller's event loop; Ray's errors typed
    (:func:`ray_error`)."""
    try:
        if running_event_loop() == "asyncio":
            return await ref
        future = ref.future()
        return await anyio.to_thread.run_sync(
            future.result, abandon_on_cancel=True, limiter=_limiter()
        )
    except Exception as exc:
        raise ray_error(exc, what) from exc


async def watched(
    call: Callable[[], Awaitable[T]],
    probe: Callable[[], Awaitable[object]],
    *,
    what: str,
    dead_after: float,
) -> T:
    """``call()``, with ``probe()`` run while it waits (after :data:`probe_after`, then every
    ``dead_after / 2`` seconds): a probe that fails or stays unanswered for ``dead_after``
    seconds ends the call with :class:`SandboxUnavailableError`."""
    result: list[T] = []
    failure: list[BaseException] = []
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            try:
                result.append(await call())
            except Exception as exc:  # noqa: BLE001 -- re-raised below, outside the group
                failure.append(exc)
            finally:
                tg.cancel_scope.cancel()

        async def watch() -> None:
            await anyio.sleep(probe_after)
            while True:
                try:
                    with anyio.fail_after(dead_after):
                        await probe()
                except TimeoutError:
                    failure.append(
                        SandboxUnavailableError(
                            f"{what}: the sandbox's node did not answer for {dead_after:g} s"
                        )
                    )
                    tg.cancel_scope.cancel()
                    return
                except SandboxError as exc:
                    failure.append(exc)
                    tg.cancel_scope.cancel()
                    return
                await anyio.sleep(dead_after / 2)

        tg.start_soon(watch)
        tg.start_soon(run)
    if failure:
        raise failure[0]
    return result[0]


async def retried(fn: Callable[[], Awaitable[T]], attempts: int) -> T:
    """``fn()``, an idempotent call, retried after a cluster connection failure
    (:class:`SandboxTransportError`; bounded, backed off)."""
    from tenacity import (
        AsyncRetrying,
        retry_if_exception_type,
        stop_after_attempt,
        wait_exponential,
    )

    retrying = AsyncRetrying(
        stop=stop_after_attempt(attempts + 1),
        wait=wait_exponential(multiplier=0.05, max=1.0),
        retry=retry_if_exception_type(SandboxTransportError),
        sleep=anyio.sleep,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            return await fn()
    raise AssertionError("unreachable: tenacity reraises")
