"""The event loop that owns a trainer's sandboxes: :class:`SandboxHost`.

Trainers call environments synchronously (OpenEnv's ``ResourceSession`` methods, TRL's
``rollout_func`` and tool methods), often from several threads at once; vf-sandbox's runtimes
are async and live in the event loop that started them. A host is one event loop on a daemon
thread (:class:`runtimes.portal.PortalThread`) holding, optionally, a warm
:class:`~runtimes.pool.RuntimePool`; every adapter runs its sandbox work there through
:meth:`SandboxHost.call`::

    with SandboxHost({"type": "docker", "image": "vf-sandbox/python"}, pool_size=8) as host:
        runtime = host.call(host.open_sandbox)         # a started sandbox, yours to close
        host.call(runtime.exec, ["true"])
        host.call(runtime.close)

Leaving the block (or the interpreter exiting) closes the pool and stops the loop; every
sandbox still open is closed by its runtime's own exit backstop and swept by
``vf-sandbox cleanup`` if the process was killed.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Self, TypeVar

from runtimes import Runtime, RuntimeConfig
from runtimes.errors import SandboxUnavailableError
from runtimes.pool import RuntimePool
from runtimes.portal import HeldContext, PortalThread, call_through
from runtimes.registry import open_runtime, resolve_runtime_config

__all__ = ["RuntimeSpec", "SandboxHost"]

log = logging.getLogger("placement.trainers")

T = TypeVar("T")
RuntimeSpec = RuntimeConfig | Mapping[str, Any] | str
"""A runtime config as every adapter takes it: a model, a dict or a type name."""


class SandboxHost:
    """One event loop on its own thread, the sandboxes' home for synchronous callers.

    Args:
        runtime: the runtime config every sandbox is made from (a model, dict or type name).
        pool_size: keep this many started sandboxes ready (a :class:`RuntimePool`); 0: start
            each sandbox when asked for.
        pool_options: more :class:`RuntimePool` arguments (``max_create_concurrency``, ...).
        backend: the event loop library (``"asyncio"`` or ``"trio"``).

    Raises:
        RuntimeConfigError / UnknownRuntimeError: an invalid runtime config.
    """

    def __init__(
        self,
        runtime: RuntimeConfig | Mapping[str, Any] | str,
        *,
        pool_size: int = 0,
        pool_options: Mapping[str, Any] | None = None,
        backend: str = "asyncio",
    ):
        self.config = resolve_runtime_config(runtime)
        self._pool_size = pool_size
        self._pool_options = dict(pool_options or {})
        self._backend = backend
        self._thread: PortalThread | None = None
        self._pool: RuntimePool | None = None
        self._held: HeldContext[RuntimePool] | None = None
        self._contexts: list[HeldContext[Any]] = []
        self._lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def pool(self) -> RuntimePool | None:
        return self._pool

    def start(self) -> Self:
        """Start the loop (and the pool); idempotent.

        Raises:
            SandboxInvalidArgumentError: the event loop library cannot run.
        """
        with self._lock:
            if self._thread is not None:
                return self
            thread = PortalThread(self._backend, {}, name="vf-sandbox-trainer-host")
            if self._pool_size > 0:
                pool = RuntimePool(self.config, size=self._pool_size, **self._pool_options)
                held = HeldContext(thread.portal, pool)
                try:
                    self._pool = held.enter()
                except BaseException:
                    thread.stop(10)
                    raise
                self._held = held
            self._thread = thread
            atexit.register(self.close)
        return self

    def close(self) -> None:
        """Close the pool's ready sandboxes and stop the loop; idempotent."""
        with self._lock:
            thread, held = self._thread, self._held
            contexts, self._contexts = self._contexts, []
            self._thread = self._held = self._pool = None
        if thread is None:
            return
        atexit.unregister(self.close)
        try:
            for context in reversed(contexts):
                try:
                    context.exit()
                except Exception:  # logged; the pool and the loop still close
                    log.warning("leaving a context held on the sandbox host failed", exc_info=True)
            if held is not None:
                held.exit()
        finally:
            thread.stop(30)

    def hold(self, context: AbstractAsyncContextManager[T]) -> T:
        """Enter ``context`` (an async context manager, e.g. an
        :class:`~harnesses.session.AgentSessionFactory`) on the host's loop and keep it open
        until :meth:`close`, which leaves it first; what its ``__aenter__`` returns.

        Raises:
            SandboxUnavailableError: the host is not started.
            Whatever entering ``context`` raises.
        """
        thread = self._thread
        if thread is None:
            raise self._closed_error()
        held = HeldContext(thread.portal, context)
        value = held.enter()
        with self._lock:
            self._contexts.append(held)
        return value

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def call(self, func: Callable[..., Awaitable[T]], /, *args: Any, **kwargs: Any) -> T:
        """``await func(*args, **kwargs)`` on the host's loop, from any other thread.

        Raises:
            SandboxUnavailableError: the host is not started, or was closed meanwhile.
            Whatever ``func`` raises.
        """
        thread = self._thread
        if thread is None:
            raise self._closed_error()
        return call_through(thread.portal, func, args, kwargs, self._closed_error)

    async def open_sandbox(self) -> Runtime:
        """A started sandbox that belongs to the caller (close it): from the pool when there
        is one, else started now. Call it on the host's loop (``host.call(host.open_sandbox)``).

        Raises:
            ProvisioningError: the sandbox could not be made (the pool's retries included).
            PoolClosedError / SandboxUnavailableError: the host was closed.
        """
        if self._pool is not None:
            return await self._pool.take()
        runtime = open_runtime(self.config)
        await runtime.start()
        return runtime

    def _closed_error(self) -> SandboxUnavailableError:
        return SandboxUnavailableError("the sandbox host is closed (use `with SandboxHost(...)`)")
