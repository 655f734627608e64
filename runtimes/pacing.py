"""Adaptive creation: :class:`CreationPacer`, how many sandbox creations a pool lets run.

A fixed number of creations in flight is either too timid for a backend with room to spare
or too much for one that is struggling (Modal answering with its rate limit, a Docker engine
that starts timing out). A pool's creations therefore pass through a pacer, which adapts the
number it admits the way TCP adapts its window (AIMD):

* The **limit** starts at the ceiling (the pool's ``max_create_concurrency``) and never
  leaves ``[1, ceiling]``.
* A failure that says *too much* (:func:`is_overload`) **halves** it and starts a
  **cool-down**: no creation starts before it ends. The cool-down is the pool's retry
  backoff ``(first, longest)``: ``first`` doubled per overload in a row, never more than
  ``longest``, jittered (between half of it and all of it).
* A **success** raises the limit by one and ends the run of overloads.
* An outcome counts for the **round** it was admitted in: one admitted before the last
  halving is stale, so a burst of creations that all hit the same rate limit halves the
  limit once, and their stragglers' successes do not undo it at once.
* Any other failure (a bug, an invalid argument, cancellation) neither shrinks nor grows it.

:func:`create_paced` runs one creation, retried (tenacity), each attempt admitted by the
pacer; a creation that keeps failing ends in its last error after ``attempts`` tries, so an
overloaded backend makes acquirers wait a bounded time, never forever.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from .errors import (
    BuildContextError,
    ProvisioningError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
)
from .snapshot import SnapshotNotFoundError

__all__ = [
    "NOT_OVERLOAD",
    "OVERLOAD",
    "CreationPacer",
    "create_paced",
    "is_overload",
    "worth_retrying",
]

T = TypeVar("T")

OVERLOAD: tuple[type[BaseException], ...] = (
    ProvisioningError,  # Modal's rate limit / quota / capacity, a Docker engine that timed out
    SandboxTransportError,  # the engine or host did not answer
    TimeoutError,  # a creation that did not come up in time
    ConnectionError,
)
"""Failures that say the backend has too much to do (or is refusing us more)."""

NOT_OVERLOAD: tuple[type[BaseException], ...] = (
    SandboxInvalidArgumentError,  # the request itself is wrong: never a load signal
    BuildContextError,  # a Docker build context the host refuses to send
    SnapshotNotFoundError,  # the snapshot to fork from is gone
)
"""Failures that name something of the caller's, whatever else they are: checked first."""


def is_overload(exc: BaseException) -> bool:
    """Whether a failed creation says *too much*: :data:`OVERLOAD` but not
    :data:`NOT_OVERLOAD`."""
    return isinstance(exc, OVERLOAD) and not isinstance(exc, NOT_OVERLOAD)


def worth_retrying(exc: BaseException) -> bool:
    """Retry any failed creation but one that can never work (an invalid argument) and
    cancellation."""
    return isinstance(exc, Exception) and not isinstance(exc, SandboxInvalidArgumentError)


class CreationPacer:
    """The number of creations admitted at once, adapted to the backend's answers (see the
    module doc). It lives in one event loop; it is not thread-safe.

    Args:
        ceiling: the most creations ever admitted at once (and the starting limit).
        backoff: ``(first, longest)`` seconds: the cool-down after an overload.
    """

    def __init__(self, ceiling: int, backoff: tuple[float, float] = (0.5, 10.0)) -> None:
        """Validate; nothing waits before :meth:`attempt`.

        Raises:
            SandboxInvalidArgumentError: ``ceiling`` below 1, or ``backoff`` not
                ``0 <= first <= longest``.
        """
        if ceiling < 1:
            raise SandboxInvalidArgumentError(f"ceiling must be >= 1, got {ceiling}")
        first, longest = backoff
        if not 0 <= first <= longest:
            raise SandboxInvalidArgumentError(
                f"backoff must be (first, longest), 0 <= first <= longest, got {backoff}"
            )
        self.ceiling = ceiling
        self.backoff = backoff
        self._limit = ceiling
        self._in_flight = 0
        self._round = 0
        self._overloads = 0
        """Overloads in a row (the cool-down's exponent); a success of the round ends it."""
        self._resume_at = -float("inf")
        self._changed: anyio.Event | None = None
        """Made by the first admission that waits (an event needs the running loop)."""

    def __repr__(self) -> str:
        return (
            f"CreationPacer(limit={self._limit}/{self.ceiling}, in_flight={self._in_flight}, "
            f"round={self._round})"
        )

    @property
    def limit(self) -> int:
        """Creations admitted at once now: between 1 and :attr:`ceiling`."""
        return self._limit

    @property
    def in_flight(self) -> int:
        """Creations admitted and not yet finished."""
        return self._in_flight

    @property
    def round(self) -> int:
        """How many times the limit was halved: an outcome counts only for its own round."""
        return self._round

    @property
    def resume_at(self) -> float:
        """``anyio.current_time()`` at which the cool-down ends (in the past: none)."""
        return self._resume_at

    def cooling(self) -> bool:
        """Whether a cool-down holds back every admission now (call it in the loop)."""
        return anyio.current_time() < self._resume_at

    # ------------------------------------------------------------------ admitting

    @asynccontextmanager
    async def attempt(self) -> AsyncIterator[None]:
        """Wait until no cool-down holds and fewer than :attr:`limit` creations are in
        flight, then count one in flight for the block; its outcome (the block returning,
        or raising an ``Exception``) adapts the limit. Cancellation only frees the place.

        Raises:
            BaseException: whatever the block raises, unchanged.
        """
        await self._admitted()
        admitted = self._round
        self._in_flight += 1
        try:
            yield
        except Exception as exc:
            self.failed(exc, admitted=admitted)
            raise
        else:
            self.succeeded(admitted=admitted)
        finally:
            self._in_flight -= 1
            self._wake()

    async def _admitted(self) -> None:
        while True:
            if anyio.current_time() < self._resume_at:
                await anyio.sleep_until(self._resume_at)
            elif self._in_flight < self._limit:
                return
            else:
                if self._changed is None:
                    self._changed = anyio.Event()
                await self._changed.wait()

    def _wake(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    # ------------------------------------------------------------------ outcomes

    def succeeded(self, *, admitted: int | None = None) -> None:
        """A creation admitted in round ``admitted`` (default: this one) worked: one more
        may run at once, and the run of overloads ends. A stale success changes nothing."""
        if admitted is not None and admitted != self._round:
            return
        self._overloads = 0
        self._limit = min(self.ceiling, self._limit + 1)
        self._wake()

    def failed(self, exc: BaseException, *, admitted: int | None = None) -> bool:
        """A creation admitted in round ``admitted`` (default: this one) failed with
        ``exc``. An overload of the current round halves the limit (never below 1), starts
        the next round and a cool-down; return whether it did (``exc`` is only read)."""
        if not is_overload(exc) or (admitted is not None and admitted != self._round):
            return False
        self._limit = max(1, self._limit // 2)
        self._round += 1
        self._overloads += 1
        first, longest = self.backoff
        full = min(longest, first * 2 ** min(self._overloads - 1, 64))
        cool_down = random.uniform(full / 2, full)  # jitter: pools that failed together
        self._resume_at = max(self._resume_at, anyio.current_time() + cool_down)
        return True


async def create_paced(
    pacer: CreationPacer,
    create: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    backoff: tuple[float, float],
    before_retry: Callable[[RetryCallState], None] | None = None,
) -> T:
    """``await create()``, each attempt admitted by ``pacer``; a failure worth retrying
    (:func:`worth_retrying`) is retried after a random exponential wait (``backoff``:
    ``(first, longest)`` seconds) and the pacer's cool-down, up to ``attempts`` tries.

    Raises:
        Exception: the last attempt's error, unchanged (or the first that is not worth
            retrying).
    """
    first, longest = backoff
    retrying = AsyncRetrying(
        retry=retry_if_exception(worth_retrying),
        stop=stop_after_attempt(attempts),
        wait=wait_random_exponential(multiplier=first, max=longest),
        sleep=anyio.sleep,
        before_sleep=before_retry,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            async with pacer.attempt():
                return await create()
    raise AssertionError("unreachable: tenacity reraises")
