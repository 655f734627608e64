"""The pool section's recycling table (``runtimes.recycle``, ``docs/pools.md``).

On one recyclable Docker config (read-only root, the policy as ``nobody``, a 64 MiB tmpfs
workdir and ``/tmp``, no network), 1 and 4 workers loop (get a sandbox, ``EXECS`` x
``exec(['true'])``, give it back) in the order create-per-cycle, recycling, recycling,
create-per-cycle: ``open_runtime(config)`` per cycle (the baseline, closed after), against
``RuntimePool(config, size=SIZE, recycle=True)``, whose released sandboxes are reset and
proven clean in the background. Rates are means of the two runs of each; the sustained rate
counts the cycles after the first ``SIZE`` (the warm stock), up to the last removal. The
reset's own latency (release to back in stock) comes from the pools' ``recycling``.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from runtimes import open_runtime
from runtimes.base import Runtime
from runtimes.docker import DockerConfig
from runtimes.pool import POOL, RuntimePool
from runtimes.recycle import DEFAULT_AUDIT_EVERY

from .pool import EXECS, SIZE, Cycles, run_cycles
from .stats import Series, ratio, table, verdict
from .suite import Environment

TARGET_RECYCLE_RATE = 10.0
RECYCLE_CYCLES_FACTOR = 4
"""Recycling runs this many times the pool section's cycles (each cycle is short)."""


def recyclable(image: str) -> DockerConfig:
    return DockerConfig(
        image=image,
        read_only=True,
        policy_user="nobody",
        disk=64,
        creations_per_second=None,
    )


async def recycled_cycles(
    config: DockerConfig, total: int, workers: int, ids: list[str], resets: list[float]
) -> Cycles:
    async with RuntimePool(config, size=SIZE, recycle=True) as pool:
        ids.append(pool.id)
        await pool.wait_ready()
        cycles = await run_cycles(f"recycling pool of {SIZE}", pool.acquire, total, workers)
        assert pool.recycling is not None
        resets.extend(pool.recycling.reset_seconds)
        if pool.recycling.discarded:
            raise AssertionError(f"{pool.recycling.discarded} resets were not proven clean")
    return cycles


async def recycle_table(env: Environment, total: int) -> str:
    config = recyclable(env.options.image)
    many = total * RECYCLE_CYCLES_FACTOR
    ids: list[str] = []
    rows: list[list[str]] = []
    resets: list[float] = []

    def fresh() -> AbstractAsyncContextManager[Runtime]:
        return open_runtime(config)

    for workers in env.options.pool_workers:
        runs: dict[str, list[Cycles]] = {"create": [], "recycle": []}
        for kind in ("create", "recycle", "recycle", "create"):
            if kind == "create":
                runs[kind].append(await run_cycles("open_runtime", fresh, total, workers))
            else:
                runs[kind].append(await recycled_cycles(config, many, workers, ids, resets))
        sustained = {kind: _mean([c.sustained for c in found]) for kind, found in runs.items()}
        met = sustained["recycle"] >= TARGET_RECYCLE_RATE * sustained["create"]
        for kind, name, tail in (
            ("create", "`open_runtime(config)` per cycle (baseline)", ["-", "-", "-"]),
            (
                "recycle",
                f"`RuntimePool(config, size={SIZE}, recycle=True)`",
                [
                    ratio(sustained["recycle"], sustained["create"]),
                    f">= {TARGET_RECYCLE_RATE:g}x",
                    verdict(met),
                ],
            ),
        ):
            found = runs[kind]
            cycles = many if kind == "recycle" else total
            rows.append([name, str(workers), f"2 x {cycles}",
                         f"{_mean([c.seconds for c in found]):.1f}",
                         f"{_mean([c.rate for c in found]):.2f}",
                         f"{sustained[kind]:.2f}", *tail])  # fmt: skip
    reset = Series("reset", resets)
    left = sum(
        len(env.client.containers.list(all=True, filters={"label": f"{POOL}={pool_id}"}))
        for pool_id in ids
    )
    headers = ["variant", "workers", "cycles", "seconds (mean)", "cycles/s, all",
               f"cycles/s after the first {SIZE}", "ratio (sustained)", "target", ""]  # fmt: skip
    return (
        f"Recycling (`benchmarks.recycling`): the same loop ({EXECS} x `exec(['true'])` per "
        "cycle) on a recyclable config (`read_only=True`, `policy_user='nobody'`, `disk=64`, "
        "no network), creating a sandbox per cycle vs a pool that resets and proves each "
        "released sandbox clean (`recycle=True`; the engine's diff once every "
        f"{DEFAULT_AUDIT_EVERY} resets of a sandbox). Order: create, recycle, recycle, create; "
        f"means of two runs each. Containers of the pools left afterwards: {left}.\n\n"
        + table(headers, rows)
        + f"\n\nThe reset itself, release to back in stock (n={len(resets)}, every reset of "
        f"every recycling run): median {reset.median_ms:.1f} ms, p90 "
        f"{reset.percentile_ms(0.9):.1f} ms."
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


__all__ = ["recyclable", "recycle_table", "recycled_cycles"]
