"""Process-wide limits on sandbox creation, shared by the backends that create sandboxes.

Two independent limits, each keyed by a name (the backend's, e.g. ``"docker"``):

* :func:`live_cap` -- how many sandboxes may be *live* at once in this process. A runtime
  takes a slot before it creates its sandbox and gives it back when it closes it.
* :func:`creation_rate` -- how many sandboxes may be *created per second* in this process
  (a token bucket: a burst of ``rate`` creations, then one every ``1 / rate`` seconds).

Both are process-wide on purpose: one engine or one cloud account serves every event loop
and every thread of the process, so the counters live behind a ``threading.Lock`` and
waiting is done with ``anyio.sleep``, which works under asyncio and trio alike and is
cancellable (a cancelled waiter holds nothing). They are not global across processes.
"""

from __future__ import annotations

import collections
import threading
import time

import anyio

from .errors import SandboxInvalidArgumentError

__all__ = ["CreationRateLimiter", "LiveSandboxCap", "creation_rate", "live_cap"]

_POLL_INTERVAL = 0.02
"""How often a waiter for a live slot looks again (seconds)."""


class LiveSandboxCap:
    """A first-come-first-served cap on the number of live sandboxes under one key.

    The limit is given per :meth:`acquire`, so runtimes whose configs ask for different
    caps share one count: a runtime configured with ``max_live=N`` is created only while
    fewer than ``N`` sandboxes of this key are live in the process.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._lock = threading.Lock()
        self._live = 0
        self._queue: collections.deque[object] = collections.deque()

    @property
    def live(self) -> int:
        """Slots held right now."""
        with self._lock:
            return self._live

    @property
    def waiting(self) -> int:
        """Callers waiting for a slot right now."""
        with self._lock:
            return len(self._queue)

    def _try_take(self, limit: int, ticket: object | None) -> bool:
        with self._lock:
            first = self._queue[0] if self._queue else None
            if self._live >= limit or (first is not None and first is not ticket):
                return False
            if ticket is not None:
                self._queue.popleft()
            self._live += 1
            return True

    async def acquire(self, limit: int) -> None:
        """Wait until fewer than ``limit`` slots are held, then take one.

        Waiters are served in arrival order. Cancellation while waiting takes nothing.
        """
        if limit < 1:
            raise SandboxInvalidArgumentError(f"a live-sandbox limit must be >= 1, got {limit}")
        if self._try_take(limit, None):
            return
        ticket = object()
        with self._lock:
            self._queue.append(ticket)
        try:
            # Polling, not an anyio.Event: the cap spans event loops and threads, and an
            # Event belongs to one loop. Waiting only happens at the cap, so it is cheap.
            while not self._try_take(limit, ticket):  # noqa: ASYNC110
                await anyio.sleep(_POLL_INTERVAL)
        except BaseException:
            with self._lock:
                if ticket in self._queue:
                    self._queue.remove(ticket)
            raise

    def release(self) -> None:
        """Give a slot back (safe from any thread, and from atexit handlers)."""
        with self._lock:
            if self._live > 0:
                self._live -= 1


class CreationRateLimiter:
    """A token bucket of creations per second under one key (GCRA form).

    Each call to :meth:`wait` reserves the next free creation time and sleeps until it;
    ``rate`` creations may happen back to back after an idle period, then one every
    ``1 / rate`` seconds.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._lock = threading.Lock()
        self._theoretical_arrival = 0.0

    def _reserve(self, rate: float) -> float:
        """Book one creation; return how long the caller must wait for it."""
        interval = 1.0 / rate
        burst = max(1.0, rate)
        now = time.monotonic()
        with self._lock:
            arrival = max(self._theoretical_arrival, now)
            delay = max(0.0, arrival - now - (burst - 1.0) * interval)
            self._theoretical_arrival = arrival + interval
        return delay

    async def wait(self, rate: float | None) -> None:
        """Sleep until one more creation is allowed at ``rate`` per second (``None``: no limit).

        A cancelled waiter's booking is not given back: the limiter errs on the slow side.
        """
        if rate is None:
            return
        if rate <= 0:
            raise SandboxInvalidArgumentError(f"a creation rate must be > 0 per second, got {rate}")
        delay = self._reserve(rate)
        if delay > 0:
            await anyio.sleep(delay)


_CAPS: dict[str, LiveSandboxCap] = {}
_RATES: dict[str, CreationRateLimiter] = {}
_REGISTRY_LOCK = threading.Lock()


def live_cap(key: str) -> LiveSandboxCap:
    """The process-wide live-sandbox cap for ``key`` (created on first use)."""
    with _REGISTRY_LOCK:
        cap = _CAPS.get(key)
        if cap is None:
            cap = _CAPS[key] = LiveSandboxCap(key)
        return cap


def creation_rate(key: str) -> CreationRateLimiter:
    """The process-wide creations-per-second limiter for ``key`` (created on first use)."""
    with _REGISTRY_LOCK:
        limiter = _RATES.get(key)
        if limiter is None:
            limiter = _RATES[key] = CreationRateLimiter(key)
        return limiter
