"""Where a sandbox comes from when pools may serve it: :func:`pool_for` finds the
:class:`~runtimes.pool.RuntimePool` serving a config, :func:`open_pooled` acquires from it
or opens a fresh runtime (the rollout and judge placement use these).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from .base import Runtime
from .config import RuntimeConfig
from .registry import open_runtime, resolve_runtime_config

if TYPE_CHECKING:
    from .pool import RuntimePool

__all__ = ["open_pooled", "pool_for"]


def pool_for(
    pools: Sequence[RuntimePool] | None, config: RuntimeConfig | Mapping[str, Any] | str
) -> RuntimePool | None:
    """The first of ``pools`` whose config is ``config`` (resolved), or ``None``.

    Raises:
        RuntimeConfigError / UnknownRuntimeError / RuntimePluginError: ``config`` is invalid.
    """
    if not pools:
        return None
    resolved = resolve_runtime_config(config)
    return next((pool for pool in pools if pool.config == resolved), None)


def open_pooled(
    config: RuntimeConfig | Mapping[str, Any] | str, pools: Sequence[RuntimePool] | None
) -> AbstractAsyncContextManager[Runtime]:
    """``async with open_pooled(config, pools) as rt``: a sandbox acquired from the pool
    serving ``config`` when one does (:func:`pool_for`), else a fresh
    ``open_runtime(config)``; closed when the block ends, either way.

    Raises:
        RuntimeConfigError / UnknownRuntimeError / RuntimePluginError: ``config`` is invalid.
        On entering, what :meth:`RuntimePool.acquire` or ``Runtime.start`` raises.
    """
    pool = pool_for(pools, config)
    return pool.acquire() if pool is not None else open_runtime(config)
