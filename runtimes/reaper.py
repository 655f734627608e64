"""Removing closed sandboxes off the caller's path.

A backend whose removal is slow makes the sandbox inert on the caller's path (nothing in it
can run any more: Docker freezes the container) and hands the removal to this process-wide
reaper: a few daemon threads that run removals in the order they came. ``close()`` then
costs the caller the freeze, not the removal.

Guarantees, in order:

* a removal that fails is logged at WARNING with its remedy and kept for
  :func:`drain_removals`, which raises it (nothing is dropped silently);
* at interpreter exit the pending removals are finished, for at most :data:`EXIT_DRAIN`
  seconds in all; a sandbox still pending then (or when the process is killed) keeps its
  vf-sandbox labels, so ``vf-sandbox cleanup`` removes it once this process has ended.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from .errors import SandboxError, SandboxTransportError

__all__ = [
    "EXIT_DRAIN",
    "WORKERS",
    "drain_at_exit",
    "drain_removals",
    "drain_removals_blocking",
    "pending_removals",
    "remove_in_background",
    "wait_for_removals",
    "wait_for_removals_blocking",
]

log = logging.getLogger("runtimes")

WORKERS = 4
"""Removals run at once: the engine serialises much of a removal, more threads buy little."""
EXIT_DRAIN = 30.0
"""Seconds the exit handler waits for pending removals before leaving them to the sweep."""


@dataclass(frozen=True)
class _Removal:
    describe: str
    remove: Callable[[], None]


class _Reaper:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[_Removal] = deque()
        self._pending = 0
        self._failures: list[SandboxError] = []
        self._workers = 0
        self._owner_pid = os.getpid()
        self._exit_hook = False

    def submit(self, removal: _Removal) -> None:
        with self._cond:
            self._forget_parent_after_fork()
            self._queue.append(removal)
            self._pending += 1
            if not self._exit_hook:
                atexit.register(self.drain_at_exit)  # lifecycle's backstop drains too
                self._exit_hook = True
            if self._workers < min(WORKERS, self._pending):
                self._workers += 1
                name = f"vf-sandbox-reaper-{self._workers}"
                threading.Thread(target=self._work, name=name, daemon=True).start()
            self._cond.notify()

    def _forget_parent_after_fork(self) -> None:
        """A forked child inherits the queue but not the threads: it owns none of it."""
        if os.getpid() != self._owner_pid:
            self._owner_pid = os.getpid()
            self._queue.clear()
            self._pending = 0
            self._workers = 0
            self._failures.clear()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                removal = self._queue.popleft()
            failure = _run_removal(removal)
            with self._cond:
                self._pending -= 1
                if failure is not None:
                    self._failures.append(failure)
                self._cond.notify_all()

    @property
    def pending(self) -> int:
        with self._cond:
            return self._pending

    def wait(self, timeout: float | None) -> bool:
        """Block until nothing is pending; ``False`` if ``timeout`` ran out first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def take_failures(self) -> list[SandboxError]:
        with self._cond:
            failures, self._failures = self._failures, []
            return failures

    def drain_at_exit(self) -> None:
        if os.getpid() != self._owner_pid or not self.pending:
            return
        if not self.wait(EXIT_DRAIN):
            log.warning(
                "%d sandbox removal(s) still pending after %.0fs at exit: they keep their "
                "labels; `vf-sandbox cleanup` removes them",
                self.pending,
                EXIT_DRAIN,
            )


def _run_removal(removal: _Removal) -> SandboxError | None:
    try:
        removal.remove()
    except SandboxError as exc:
        failure = exc
    except Exception as exc:  # noqa: BLE001 - a worker thread must outlive any failure
        failure = SandboxError(f"removing {removal.describe} failed: {type(exc).__name__}: {exc}")
        failure.__cause__ = exc
    else:
        return None
    log.warning(
        "removing %s in the background failed (`vf-sandbox cleanup` removes it once this "
        "process has ended): %s",
        removal.describe,
        failure,
    )
    return failure


_REAPER = _Reaper()


def remove_in_background(describe: str, remove: Callable[[], None]) -> None:
    """Queue ``remove`` (blocking; raises :class:`SandboxError` on failure) for the reaper.

    ``describe`` names the sandbox in warnings and errors.
    """
    _REAPER.submit(_Removal(describe, remove))


def drain_at_exit() -> None:
    """Finish pending removals, for at most :data:`EXIT_DRAIN` seconds (exit handlers)."""
    _REAPER.drain_at_exit()


def pending_removals() -> int:
    """Removals queued or running in this process."""
    return _REAPER.pending


async def wait_for_removals(timeout: float | None = 60.0) -> bool:
    """Wait until nothing is pending (what a removal depends on: an image its container
    used); ``False`` if ``timeout`` ran out. Failures stay for :func:`drain_removals`."""
    return await anyio.to_thread.run_sync(_REAPER.wait, timeout, abandon_on_cancel=True)


def wait_for_removals_blocking(timeout: float | None = 60.0) -> bool:
    """:func:`wait_for_removals` for synchronous code (exit handlers)."""
    return _REAPER.wait(timeout)


async def drain_removals(timeout: float | None = 60.0) -> None:
    """Wait until every sandbox closed so far in this process is removed.

    ``close()`` returns once a sandbox is inert; call this where the removal itself must
    be complete (before counting containers, before an engine shuts down).

    Raises:
        SandboxTransportError: removals still pending after ``timeout`` seconds.
        SandboxError: a background removal failed since the last drain (that failure;
            several are named in one ``SandboxError``); the sandbox is left to
            ``vf-sandbox cleanup``.
    """
    await anyio.to_thread.run_sync(drain_removals_blocking, timeout, abandon_on_cancel=True)


def drain_removals_blocking(timeout: float | None = 60.0) -> None:
    """:func:`drain_removals` for synchronous code; raises the same errors."""
    if not _REAPER.wait(timeout):
        raise SandboxTransportError(
            f"{_REAPER.pending} sandbox removal(s) still pending after {timeout:g}s"
        )
    _raise_failures(_REAPER.take_failures())


def _raise_failures(failures: list[SandboxError]) -> None:
    if not failures:
        return
    if len(failures) == 1:
        raise failures[0]
    named = "; ".join(str(f) for f in failures)
    raise SandboxError(f"{len(failures)} background removals failed: {named}") from failures[0]
