"""Warm pools of started sandboxes: :class:`RuntimePool`.

Creating a sandbox takes hundreds of milliseconds on Docker and seconds on Modal; a pool
keeps ``size`` of them started ahead of time, so that the sandbox a rollout or a judge
asks for is already there::

    async with RuntimePool({"type": "docker"}, size=16) as pool:
        async with pool.acquire() as rt:   # a started sandbox, for this block only
            await rt.exec(["true"])
        # closed here; a replacement is already being started in the background

What a pool guarantees (``docs/pools.md`` has the whole contract): a pooled sandbox serves
one acquirer and is closed when its block ends, never handed out twice (with
``recycle=True``, :mod:`runtimes.recycle`, it serves the next acquirer only once a reset
proved it back to its state after start); creations are paced (:mod:`runtimes.pacing`),
retried, and their last failure reaches every waiting acquirer as
:class:`~runtimes.errors.ProvisioningError`; an idle pool shrinks to nothing; every pooled
sandbox carries :data:`POOL` for ``vf-sandbox cleanup``; leaving the pool's block closes
what is in stock and cancels the creations in flight.

A pool lives in the event loop (and the task) that entered it; it is not thread-safe.
"""

from __future__ import annotations

import collections
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup
from tenacity import RetryCallState

from .base import Runtime
from .config import RuntimeConfig
from .errors import (
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from .lifecycle import State, close_all
from .ownership import LABEL_PREFIX
from .pacing import CreationPacer, create_paced
from .pool_checks import check_numbers, check_poolable, provisioning_error, recycler_for
from .pooled import open_pooled, pool_for
from .recycle import DEFAULT_AUDIT_EVERY, Recycler
from .registry import open_runtime, resolve_runtime_config

__all__ = [
    "POOL",
    "PoolClosedError",
    "PoolTimeoutError",
    "RuntimePool",
    "open_pooled",
    "pool_for",
]

log = logging.getLogger("runtimes.pool")

POOL = LABEL_PREFIX + "pool"
"""The label naming the pool a sandbox was made for (its value: :attr:`RuntimePool.id`)."""

DEFAULT_MAX_CREATE_CONCURRENCY = 4
DEFAULT_IDLE_TIMEOUT = 300.0
DEFAULT_CREATE_ATTEMPTS = 3
DEFAULT_RETRY_BACKOFF = (0.5, 10.0)
"""Seconds: the first retry waits up to the first number (random, exponential), no retry
waits longer than the second."""


class PoolTimeoutError(SandboxError, TimeoutError):
    """``acquire(timeout=)`` / ``take(timeout=)`` expired before a sandbox was ready."""


class PoolClosedError(SandboxUnavailableError):
    """The pool is not open: never entered, or its ``async with`` block has ended."""


@dataclass(eq=False)
class _Waiter:
    """An acquirer waiting for the next ready sandbox (or for the reason there is none)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    runtime: Runtime | None = None
    failure: BaseException | None = None
    pool_closed: bool = False


@dataclass(frozen=True)
class _Ready:
    runtime: Runtime
    since: float
    """``anyio.current_time()`` when it became ready."""


class RuntimePool:
    """``size`` sandboxes of one config kept started, each handed to one acquirer.

    Use it as ``async with RuntimePool(config, size=16) as pool:``, then
    ``async with pool.acquire() as rt:`` (or :meth:`take` and close the runtime yourself).

    Args:
        config: any runtime config (a model, a dict with ``type``, or a type name).
        size: how many sandboxes to keep ready (0: none; each acquire creates one).
        max_create_concurrency: the ceiling of creations in flight at once; the pool backs
            off below it on overload (:attr:`create_limit`, :mod:`runtimes.pacing`).
        idle_timeout: seconds a ready sandbox may wait before it is closed (``None``:
            never). Keep it below any lifetime the backend enforces itself (Modal's
            ``idle_timeout`` and ``timeout``).
        create_attempts: attempts per creation (the first included) before giving up.
        retry_backoff: ``(first, longest)`` seconds between attempts (random exponential).
        recycle: reset a sandbox released by ``acquire()`` and hand it to the next acquirer
            once the reset is proven (:mod:`runtimes.recycle`); else it is destroyed.
        audit_every: with ``recycle``, every Nth reset of a sandbox also reads what the host
            sees of it (Docker: the engine's diff).
        prepare: run on every new sandbox before it is stocked (and before its baseline):
            a task's files, say; a failure counts as a failed creation.
    """

    def __init__(
        self,
        config: RuntimeConfig | Mapping[str, Any] | str,
        *,
        size: int,
        max_create_concurrency: int = DEFAULT_MAX_CREATE_CONCURRENCY,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        create_attempts: int = DEFAULT_CREATE_ATTEMPTS,
        retry_backoff: tuple[float, float] = DEFAULT_RETRY_BACKOFF,
        recycle: bool = False,
        audit_every: int = DEFAULT_AUDIT_EVERY,
        prepare: Callable[[Runtime], Awaitable[None]] | None = None,
    ):
        """Validate; nothing is created before ``async with``.

        Raises:
            RuntimeConfigError / UnknownRuntimeError / RuntimePluginError: an invalid
                config (as :func:`~runtimes.registry.resolve_runtime_config`), or one whose
                sandboxes cannot be pooled: ``keep=True``, or a backend that borrows an
                existing sandbox (Docker's ``container=``), which every acquirer would share.
                With ``recycle=True``: a config whose sandboxes cannot be proven clean
                after use (:func:`~runtimes.recycle.recycle_refusal` says why).
            SandboxInvalidArgumentError: a size, limit, timeout or backoff out of range.
        """
        check_numbers(size, max_create_concurrency, idle_timeout, create_attempts, retry_backoff)
        self.config = resolve_runtime_config(config)
        check_poolable(self.config)
        self._recycler = recycler_for(self.config, audit_every) if recycle else None
        self._prepare = prepare
        self._resetting = 0
        self.id = uuid.uuid4().hex[:16]
        self.size = size
        self.max_create_concurrency = max_create_concurrency
        self.idle_timeout = idle_timeout
        self.create_attempts = create_attempts
        self.retry_backoff = retry_backoff
        labels = {**self.config.labels, POOL: self.id}
        self._pooled_config = self.config.model_copy(update={"labels": labels})
        self._state = State.NEW
        self._stack: AsyncExitStack | None = None
        self._group: TaskGroup | None = None
        self._ready: collections.deque[_Ready] = collections.deque()
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._creating = 0
        self._pacer = CreationPacer(max_create_concurrency, retry_backoff)
        self._dormant = False
        """Refill only for waiting acquirers (not up to ``size``) until the next acquire:
        set when an idle sandbox expired or a creation failed for good."""
        self._failures = 0
        self._last_failure: BaseException | None = None
        self._handed_out = 0
        self._changed: anyio.Event
        """Set (and replaced) on every change waiters may look for; made in the event loop."""

    def __repr__(self) -> str:
        return (
            f"RuntimePool({self.config.type!r}, id={self.id}, size={self.size}, "
            f"ready={self.ready}, creating={self.creating}, {self._state.value})"
        )

    # ------------------------------------------------------------------ state

    @property
    def ready(self) -> int:
        """Sandboxes started and waiting for an acquirer."""
        return len(self._ready)

    @property
    def creating(self) -> int:
        """Creations in flight (never more than :attr:`create_limit` when each started)."""
        return self._creating

    @property
    def create_limit(self) -> int:
        """Creations allowed in flight now: ``max_create_concurrency`` (the ceiling), halved
        by each overload, one more per success (:class:`~runtimes.pacing.CreationPacer`)."""
        return self._pacer.limit

    @property
    def waiting(self) -> int:
        """Acquirers waiting for a sandbox."""
        return len(self._waiters)

    @property
    def resetting(self) -> int:
        """Released sandboxes being reset (``recycle=True``) before they are back in stock."""
        return self._resetting

    @property
    def recycling(self) -> Recycler | None:
        """With ``recycle=True``: the resets' counts and durations
        (:class:`~runtimes.recycle.Recycler`); else ``None``."""
        return self._recycler

    @property
    def handed_out(self) -> int:
        """Sandboxes handed to acquirers since the pool opened."""
        return self._handed_out

    @property
    def state(self) -> State:
        """Where the pool is in its life: ``NEW`` until ``async with`` opens it, ``OPEN``
        inside the block, ``CLOSED`` after (:class:`~runtimes.lifecycle.State`; a pool is
        never ``STARTING`` or ``CLOSING``)."""
        return self._state

    @property
    def closed(self) -> bool:
        return self._state == State.CLOSED

    def serves(self, config: RuntimeConfig | Mapping[str, Any] | str) -> bool:
        """Whether ``config`` (resolved) is this pool's config.

        Raises:
            RuntimeConfigError / UnknownRuntimeError / RuntimePluginError: ``config`` is invalid.
        """
        return resolve_runtime_config(config) == self.config

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        """Open the pool and start filling it in the background (:meth:`wait_ready` waits).

        Raises:
            PoolClosedError: the pool was already entered (a pool opens once).
        """
        if self._state != State.NEW:
            raise PoolClosedError(f"{self._name()} was already opened; make a new pool")
        self._changed = anyio.Event()
        async with AsyncExitStack() as stack:
            self._group = await stack.enter_async_context(anyio.create_task_group())
            self._stack = stack.pop_all()
        self._state = State.OPEN
        self._group.start_soon(self._expire_idle)
        self._refill()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close every ready sandbox and cancel the creations in flight (what a cancelled
        creation made is closed by ``Runtime.start``). Waiting acquirers get
        :class:`PoolClosedError`; acquired sandboxes are their acquirers' to close.
        Closing the ready sandboxes is shielded from cancellation.

        Raises:
            SandboxTransportError: some ready sandboxes could not be confirmed gone (they
                are left to ``vf-sandbox cleanup``); every other one was still closed.
        """
        self._state = State.CLOSED
        for waiter in self._take_waiters():
            waiter.pool_closed = True
            waiter.done.set()
        self._notify()
        assert self._group is not None and self._stack is not None
        self._group.cancel_scope.cancel()
        try:
            # The body's own exception is not handed to the group, or it would come out
            # wrapped in an ExceptionGroup; the group's tasks never raise.
            await self._stack.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                failures = await close_all([entry.runtime for entry in self._ready])
                self._ready.clear()
        if failures:
            raise SandboxTransportError(
                f"{self._name()}: {len(failures)} ready sandboxes could not be confirmed "
                f"gone; `vf-sandbox cleanup` removes them once this process has exited"
            ) from failures[0]

    # ------------------------------------------------------------------ acquiring

    @asynccontextmanager
    async def acquire(self, *, timeout: float | None = None) -> AsyncIterator[Runtime]:
        """A started sandbox of this pool's config for the block, closed when it ends (with
        ``recycle=True``: reset, and back in stock once proven clean); a replacement starts.

        An empty pool makes the caller wait for the next ready sandbox (a creation is
        started if none is in flight for it).

        Raises:
            PoolTimeoutError: ``timeout`` seconds passed and no sandbox was ready.
            ProvisioningError: creating a sandbox failed ``create_attempts`` times (the last
                attempt's error chained); a later acquire tries again.
            PoolClosedError: the pool is not open, or closed while the caller waited.
            SandboxInvalidArgumentError: a negative ``timeout``.
            SandboxTransportError: closing the sandbox at the end of the block failed (as
                ``Runtime.close``).
        """
        runtime = await self.take(timeout=timeout)
        try:
            yield runtime
        finally:
            await self._release(runtime)

    async def _release(self, runtime: Runtime) -> None:
        """The end of an ``acquire()`` block: the sandbox is closed, or, recycling, reset
        in the background and back in stock once proven clean (else destroyed)."""
        recycler, group = self._recycler, self._group
        usable = self._state == State.OPEN and not runtime.closed
        if recycler is None or group is None or not usable or not recycler.knows(runtime):
            await runtime.close()
            return
        self._resetting += 1
        group.start_soon(self._restore, recycler, runtime)

    async def _restore(self, recycler: Recycler, runtime: Runtime) -> None:
        try:
            clean = await recycler.restore(runtime)  # destroys it when not clean
        finally:
            self._resetting -= 1
        if clean:
            self._deliver(runtime)
        self._refill()

    async def take(self, *, timeout: float | None = None) -> Runtime:
        """A started sandbox that now belongs to the caller, who must close it (it is never
        put back). :meth:`acquire` is this plus the close.

        Raises:
            PoolTimeoutError / ProvisioningError / PoolClosedError /
            SandboxInvalidArgumentError: as :meth:`acquire`.
        """
        if timeout is not None and not timeout >= 0:
            raise SandboxInvalidArgumentError(f"timeout must be >= 0, got {timeout}")
        self._check_open()
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._dormant = False  # used again: keep it full
        while self._ready:
            runtime = self._ready.popleft().runtime  # the oldest: the nearest to expiring
            if (lost := runtime.lost()) is None:
                self._handed_out += 1
                self._refill()
                return runtime  # no checkpoint between taking it and returning it
            self._drop(runtime, lost)  # known gone (its node left the cluster): never handed out
        return await self._wait_for_one(timeout)

    async def _wait_for_one(self, timeout: float | None) -> Runtime:
        waiter = _Waiter()
        self._waiters.append(waiter)
        self._refill()
        try:
            with anyio.move_on_after(math.inf if timeout is None else timeout):
                await waiter.done.wait()
        except BaseException:  # cancelled: a sandbox handed over meanwhile was never used
            await self._withdraw(waiter)
            raise
        if not waiter.done.is_set():
            await self._withdraw(waiter)
            raise PoolTimeoutError(
                f"{self._name()}: no sandbox was ready within {timeout}s "
                f"({self._creating} creations in flight)"
            )
        if waiter.runtime is not None:
            self._handed_out += 1
            return waiter.runtime
        if waiter.pool_closed:
            raise PoolClosedError(f"{self._name()} was closed while waiting for a sandbox")
        raise provisioning_error(self._name(), self.create_attempts, waiter.failure)

    async def _withdraw(self, waiter: _Waiter) -> None:
        """An acquirer stopped waiting: forget it, and put back (or, in a closed pool,
        close) a sandbox that was handed to it but never reached it."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        runtime, waiter.runtime = waiter.runtime, None
        if runtime is None:
            return
        if self._state == State.OPEN:
            self._stock(runtime)
        else:
            await close_all([runtime])

    async def wait_ready(self, count: int | None = None) -> None:
        """Wait until ``count`` (default: ``size``) sandboxes are ready; refills a pool
        that went dormant (idle expiry, a failed creation).

        Raises:
            ProvisioningError: a creation failed ``create_attempts`` times meanwhile.
            PoolClosedError: the pool is not open, or closed meanwhile.
            SandboxInvalidArgumentError: ``count`` is negative or above ``size``.
        """
        want = self.size if count is None else count
        if not 0 <= want <= self.size:
            raise SandboxInvalidArgumentError(
                f"count must be between 0 and the pool's size {self.size}, got {count}"
            )
        self._check_open()
        self._dormant = False
        self._refill()
        failures = self._failures
        while len(self._ready) < want:
            if self._state != State.OPEN:
                raise PoolClosedError(f"{self._name()} was closed while filling")
            if self._failures != failures:
                raise provisioning_error(self._name(), self.create_attempts, self._last_failure)
            changed = self._changed
            await changed.wait()

    # ------------------------------------------------------------------ filling

    def _refill(self) -> None:
        """Start creations until ``size`` (none while dormant) plus one per waiting
        acquirer are ready or in flight, never more than :attr:`create_limit` (each
        attempt also waits for the pacer: its limit and its cool-down)."""
        if self._state != State.OPEN or self._group is None:
            return
        wanted = len(self._waiters) + (0 if self._dormant else self.size)
        missing = wanted - len(self._ready) - self._creating - self._resetting
        room = self._pacer.limit - self._creating
        for _ in range(max(0, min(missing, room))):
            self._creating += 1
            self._group.start_soon(self._create_one)

    async def _create_one(self) -> None:
        """One creation (retried); never raises but cancellation, which ``Runtime.start``
        survives without leaking."""
        try:
            runtime = await self._start_with_retries()
        except Exception as exc:  # noqa: BLE001 - handed to the waiters, typed, chained
            self._creating -= 1
            self._give_up(exc)
            return
        except BaseException:
            self._creating -= 1
            raise
        self._creating -= 1
        self._deliver(runtime)
        self._refill()

    async def _start_with_retries(self) -> Runtime:
        """A started runtime: each attempt admitted by the pacer, retried with backoff
        (``Runtime.start`` closes what a failed or cancelled attempt made).

        Raises:
            Exception: the last attempt's error (or the first not worth retrying).
        """
        return await create_paced(
            self._pacer,
            self._open_one,
            attempts=self.create_attempts,
            backoff=self.retry_backoff,
            before_retry=self._log_retry,
        )

    async def _open_one(self) -> Runtime:
        """One attempt: a started sandbox, prepared, its baseline recorded when recycling
        (what the attempt made is closed if any of that fails)."""
        runtime = await open_runtime(self._pooled_config).start()
        try:
            if self._prepare is not None:
                await self._prepare(runtime)
            if self._recycler is not None:
                await self._recycler.admit(runtime)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await runtime.close()
            raise
        return runtime

    def _log_retry(self, state: RetryCallState) -> None:
        failure = state.outcome.exception() if state.outcome is not None else None
        log.info(
            "%s: creating a sandbox failed (attempt %d of %d), retrying (at most %d at "
            "once now): %s",
            self._name(),
            state.attempt_number,
            self.create_attempts,
            self._pacer.limit,
            failure,
        )

    def _deliver(self, runtime: Runtime) -> None:
        """A new sandbox: to the first waiting acquirer, else to the stock."""
        if self._waiters:
            waiter = self._waiters.popleft()
            waiter.runtime = runtime
            waiter.done.set()
            return
        self._stock(runtime)

    def _stock(self, runtime: Runtime) -> None:
        self._ready.append(_Ready(runtime, anyio.current_time()))
        self._notify()

    def _give_up(self, failure: BaseException) -> None:
        """A creation failed for good: every waiting acquirer gets it, and the pool stops
        refilling until the next acquire (a broken image must not be retried forever)."""
        self._failures += 1
        self._last_failure = failure
        self._dormant = True
        waiters = self._take_waiters()
        for waiter in waiters:
            waiter.failure = failure
            waiter.done.set()
        self._notify()
        log.warning(
            "%s: could not create a sandbox in %d attempts (%s acquirers told; at most %d "
            "at once now): %s; the pool tries again at the next acquire",
            self._name(),
            self.create_attempts,
            len(waiters),
            self._pacer.limit,
            failure,
        )

    # ------------------------------------------------------------------ expiry

    async def _expire_idle(self) -> None:
        """Close ready sandboxes older than ``idle_timeout``; the pool then goes dormant."""
        if self.idle_timeout is None:
            return
        while True:
            if not self._ready:
                changed = self._changed
                await changed.wait()
                continue
            await anyio.sleep_until(self._ready[0].since + self.idle_timeout)
            self._expire(anyio.current_time() - self.idle_timeout)

    def _expire(self, born_before: float) -> None:
        expired = [entry for entry in self._ready if entry.since <= born_before]
        if not expired:
            return
        self._ready = collections.deque(e for e in self._ready if e.since > born_before)
        self._dormant = True
        assert self._group is not None
        for entry in expired:
            self._group.start_soon(self._discard_idle, entry.runtime)
        self._notify()

    def _drop(self, runtime: Runtime, lost: str) -> None:
        log.info("%s: dropped the lost %s: %s", self._name(), runtime.describe(), lost)
        assert self._group is not None
        self._group.start_soon(self._discard_idle, runtime)

    async def _discard_idle(self, runtime: Runtime) -> None:
        try:
            await runtime.close()
        except Exception as exc:  # noqa: BLE001 - logged: no caller to raise it to
            log.warning(
                "%s: closing the idle %s failed: %s; `vf-sandbox cleanup` removes it once "
                "this process has exited",
                self._name(),
                runtime.describe(),
                exc,
            )

    # ------------------------------------------------------------------ helpers

    def _take_waiters(self) -> list[_Waiter]:
        waiters = list(self._waiters)
        self._waiters.clear()
        return waiters

    def _notify(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def _check_open(self) -> None:
        if self._state != State.OPEN:
            what = (
                "was never opened (use `async with`)" if self._state == State.NEW else "is closed"
            )
            raise PoolClosedError(f"{self._name()} {what}")

    def _name(self) -> str:
        return f"{self.config.type} pool {self.id}"
