"""A runtime's lifecycle state, the one registry of runtimes still open at exit, and
:func:`close_all` (several runtimes closed at once).

Every started runtime is held (strongly: one nobody closed must still be reachable) in a
process-wide registry until it closes; an ``atexit`` handler closes what is left, each runtime
through its own :meth:`~runtimes.base.Runtime.close_at_exit`.
"""

from __future__ import annotations

import atexit
import enum
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio

from . import reaper

if TYPE_CHECKING:
    from .base import Runtime

__all__ = ["State", "close_all", "live_runtimes"]

log = logging.getLogger("runtimes")


class State(enum.StrEnum):
    """Where a runtime is in its life. Only :class:`~runtimes.base.Runtime` moves it on."""

    NEW = "new"
    STARTING = "starting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


_LIVE: set[Runtime] = set()
_LIVE_LOCK = threading.Lock()


def live_runtimes() -> list[Runtime]:
    """Runtimes of this process that are open right now."""
    with _LIVE_LOCK:
        return list(_LIVE)


def hold(runtime: Runtime) -> None:
    """Keep ``runtime`` for the exit backstop until :func:`release`."""
    with _LIVE_LOCK:
        _LIVE.add(runtime)
    _register_backstop_last()


def release(runtime: Runtime) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(runtime)


def _close_leftovers() -> None:
    for runtime in live_runtimes():
        try:
            runtime.close_at_exit()
        except Exception:
            log.warning("atexit: could not close %s", runtime.describe(), exc_info=True)
    reaper.drain_at_exit()  # what those closes (and earlier ones) queued for removal


def _register_backstop_last() -> None:
    """atexit runs the last-registered handler first. Backend SDKs imported lazily (in
    ``_start``) register handlers that tear down their own clients; re-registering after
    each start keeps the backstop ahead of them, while their clients still work."""
    atexit.unregister(_close_leftovers)
    atexit.register(_close_leftovers)


atexit.register(_close_leftovers)


async def close_all(runtimes: Sequence[Runtime]) -> list[Exception]:
    """Close ``runtimes`` concurrently; the errors of those that failed."""
    failures: list[Exception] = []

    async def close(runtime: Runtime) -> None:
        try:
            await runtime.close()
        except Exception as exc:  # noqa: BLE001 - every one is closed; the first is raised
            failures.append(exc)

    async with anyio.create_task_group() as group:
        for runtime in runtimes:
            group.start_soon(close, runtime)
    return failures
