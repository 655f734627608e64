"""Warm pools on Docker (``python -m benchmarks --sections pool``).

Three measurements, each beside its baseline in the same run:

* acquire latency: entering ``pool.acquire()`` on a warm pool of ``SIZE`` (every sample is
  taken with the pool full and no creation in flight), interleaved sample by sample with
  ``open_runtime(config).start()``, the sandbox a caller without a pool waits for;
* cycle rate: 1, then 4 concurrent workers (``Options.pool_workers``) each looping (get a
  sandbox, ``EXECS`` execs of ``true``, close it) for ``pool_cycles`` cycles in all, through
  a pool of ``SIZE`` and through ``open_runtime`` alone, in the order no pool, pool, pool,
  no pool (so that drift in the machine's load falls on both). The sustained rate counts
  only the cycles after the first ``SIZE``, which the pool's warm stock serves: from there
  the pool can only be as fast as it refills. A run ends when the background removals of its
  sandboxes are done too (``drain_removals``): the rate includes every removal;
* close latency: ``close()`` of a started sandbox (channel up, one exec done) on the caller's
  path, interleaved with the Docker SDK's ``remove(force=True)`` of a container started the
  same way, and the time the background removal then takes (``drain_removals``).

Creation pacing (``creations_per_second``) is off for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

import anyio

from runtimes import drain_removals, open_runtime
from runtimes.base import Runtime
from runtimes.docker import DockerConfig
from runtimes.pool import DEFAULT_MAX_CREATE_CONCURRENCY, POOL, RuntimePool

from .stats import Series, ratio, table, verdict
from .suite import Environment, Row, rows_table

SIZE = 16
EXECS = 10
TARGET_ACQUIRE_MS = 5.0
TARGET_RATE = 3.0
TARGET_CLOSE_MS = 10.0

Opener = Callable[[], AbstractAsyncContextManager[Runtime]]


@dataclass
class Cycles:
    """One run of the cycle loop."""

    name: str
    workers: int
    started: float
    finished: list[float]
    drained: float

    @property
    def seconds(self) -> float:
        """From the start to the last background removal done."""
        return self.drained - self.started

    @property
    def rate(self) -> float:
        return len(self.finished) / self.seconds

    @property
    def sustained(self) -> float:
        """Cycles per second after the first ``SIZE`` finished, up to the last removal."""
        later = self.finished[SIZE - 1 :]
        span = self.drained - later[0]
        return (len(later) - 1) / span if len(later) > 1 and span > 0 else 0.0


async def acquire_latency(config: DockerConfig, n: int) -> tuple[Series, Series]:
    """``pool.acquire()`` on a full pool vs ``open_runtime(config).start()``, interleaved."""
    pooled = Series("pool.acquire()")
    fresh = Series("open_runtime(config).start()")
    async with RuntimePool(config, size=SIZE) as pool:
        for index in range(n + 1):  # the first round warms caches up
            await pool.wait_ready()  # full, nothing in flight
            started = time.perf_counter()
            async with pool.acquire() as rt:
                elapsed = time.perf_counter() - started
                assert (await rt.exec(["true"])).exit_code == 0
            await pool.wait_ready()  # the replacement is in: quiet again
            runtime = open_runtime(config)
            begun = time.perf_counter()
            await runtime.start()
            baseline = time.perf_counter() - begun
            await runtime.close()
            if index:
                pooled.samples.append(elapsed)
                fresh.samples.append(baseline)
    return pooled, fresh


async def close_latency(env: Environment, config: DockerConfig, n: int) -> tuple[Series, ...]:
    """``close()`` on the caller's path and its background removal, vs the SDK's
    ``remove(force=True)`` of a container started alike, interleaved."""
    closing = Series("close()")
    removal = Series("close() + drain_removals()")
    baseline = Series("SDK container.remove(force=True)")
    for index in range(n + 1):  # the first round warms caches up
        rt = open_runtime(config)
        await rt.start()
        assert (await rt.exec(["true"])).exit_code == 0
        begun = time.perf_counter()
        await rt.close()
        closed = time.perf_counter()
        await drain_removals()
        drained = time.perf_counter()
        removed = await anyio.to_thread.run_sync(_sdk_remove_seconds, env, config.image)
        if index:
            closing.samples.append(closed - begun)
            removal.samples.append(drained - begun)
            baseline.samples.append(removed)
    return closing, removal, baseline


def _sdk_remove_seconds(env: Environment, image: str) -> float:
    container = env.client.containers.run(
        image, ["sleep", "infinity"], detach=True, labels={"vf-sandbox.benchmark": "pool"}
    )
    container.exec_run(["true"])
    begun = time.perf_counter()
    container.remove(force=True)
    return time.perf_counter() - begun


async def run_cycles(name: str, open_one: Opener, total: int, workers: int) -> Cycles:
    """``workers`` loops of (get a sandbox, ``EXECS`` x ``true``, close) until ``total``."""
    claimed = 0
    finished: list[float] = []

    async def worker() -> None:
        nonlocal claimed
        while claimed < total:
            claimed += 1
            async with open_one() as rt:
                for _ in range(EXECS):
                    result = await rt.exec(["true"])
                    assert result.exit_code == 0, result
            finished.append(time.perf_counter())

    await drain_removals()  # nothing of an earlier run left to remove on this run's clock
    started = time.perf_counter()
    async with anyio.create_task_group() as group:
        for _ in range(workers):
            group.start_soon(worker)
    await drain_removals()
    return Cycles(name, workers, started, finished, time.perf_counter())


async def pooled_cycles(config: DockerConfig, total: int, workers: int, ids: list[str]) -> Cycles:
    async with RuntimePool(config, size=SIZE) as pool:
        ids.append(pool.id)
        await pool.wait_ready()
        return await run_cycles(f"pool of {SIZE}", pool.acquire, total, workers)


def _left(env: Environment, pool_ids: list[str]) -> int:
    return sum(
        len(env.client.containers.list(all=True, filters={"label": f"{POOL}={pool_id}"}))
        for pool_id in pool_ids
    )


async def pool_section(env: Environment) -> tuple[str, list[Row]]:
    options = env.options
    config = DockerConfig(image=options.image, creations_per_second=None)
    n, total = options.n_pool, options.pool_cycles
    pooled, fresh = await acquire_latency(config, n)
    latency = Row(
        "pool.acquire(), warm pool",
        pooled,
        "open_runtime(config).start()",
        fresh,
        f"median <= {TARGET_ACQUIRE_MS:g} ms",
        pooled.median_ms <= TARGET_ACQUIRE_MS,
    )
    closing, removal, removed = await close_latency(env, config, n)
    close_row = Row(
        "close() on the caller's path",
        closing,
        "SDK container.remove(force=True)",
        removed,
        f"median <= {TARGET_CLOSE_MS:g} ms",
        closing.median_ms <= TARGET_CLOSE_MS,
    )
    drain_row = Row(
        "close() + drain_removals()",
        removal,
        "SDK container.remove(force=True)",
        removed,
        "-",
        None,
    )
    ids: list[str] = []
    rows: list[list[str]] = []
    for workers in options.pool_workers:
        rows += await _rate_rows(config, total, workers, ids)
    headers = [
        "variant",
        "workers",
        "cycles",
        "seconds (mean)",
        "cycles/s, all",
        f"cycles/s after the first {SIZE}",
        "ratio (sustained)",
        "target",
        "",
    ]
    left = await anyio.to_thread.run_sync(_left, env, ids)
    from .recycling import recycle_table  # it builds on this module's loop

    recycling = await recycle_table(env, total)
    counts = " and ".join(str(w) for w in options.pool_workers)
    text = (
        f"Warm pools on Docker (`{options.image}`, creation pacing off; `benchmarks.pool`). "
        f"Acquire latency (n={n}, interleaved sample by sample): entering `pool.acquire()` "
        f"on a pool of {SIZE} kept full (each sample taken with no creation in flight), vs "
        "`open_runtime(config).start()`, what a caller without a pool waits for.\n\n"
        + rows_table([latency], tail=0.9)
        + f"\n\nClose latency (n={n}, interleaved): `close()` of a started sandbox (channel up, "
        "one exec done) returns once the root agent killed every process of it (`HALT`); "
        "its removal runs in the "
        "background (`runtimes.reaper`), measured here to its end with `drain_removals()`; "
        "the baseline is the SDK's `remove(force=True)` of a container started with "
        "`containers.run` and one `exec_run`.\n\n"
        + rows_table([close_row, drain_row], tail=0.9)
        + f"\n\nCycle rate: {counts} concurrent workers loop (get a sandbox, {EXECS} x "
        f"`exec(['true'])`, close it) for {total} cycles in all, without a pool and through "
        f"a pool of {SIZE} (max_create_concurrency {DEFAULT_MAX_CREATE_CONCURRENCY}, filled "
        "before the clock starts; a run ends when the last background removal is done), run "
        "in the order no pool, pool, pool, no pool for each "
        "worker count; rates are means of the two runs. The sustained rate counts only the "
        f"cycles after the first {SIZE}, which the warm stock serves; from there a pool is as "
        "fast as it refills, and every cycle still creates and removes one container, in the "
        "background instead of in the worker's loop: a pool hides the creation's latency, "
        "it adds no creation capacity to the engine. Containers of the pools left "
        f"afterwards: {left}.\n\n" + table(headers, rows) + "\n\n" + recycling
    )
    return text, [latency, close_row]


async def _rate_rows(
    config: DockerConfig, total: int, workers: int, ids: list[str]
) -> list[list[str]]:
    """The baseline's row and the pool's, for ``workers`` concurrent workers."""

    def unpooled() -> AbstractAsyncContextManager[Runtime]:
        return open_runtime(config)

    runs: dict[str, list[Cycles]] = {"no pool": [], "pool": []}
    for kind in ("no pool", "pool", "pool", "no pool"):
        if kind == "pool":
            runs[kind].append(await pooled_cycles(config, total, workers, ids))
        else:
            runs[kind].append(await run_cycles("open_runtime", unpooled, total, workers))
    sustained = {kind: _mean([c.sustained for c in found]) for kind, found in runs.items()}

    def row(kind: str, name: str, tail: list[str]) -> list[str]:
        found = runs[kind]
        seconds, rate = _mean([c.seconds for c in found]), _mean([c.rate for c in found])
        return [name, str(workers), f"2 x {total}", f"{seconds:.1f}", f"{rate:.2f}",
                f"{sustained[kind]:.2f}", *tail]  # fmt: skip

    met = sustained["pool"] >= TARGET_RATE * sustained["no pool"]
    return [
        row("no pool", "`open_runtime(config)` (baseline)", ["-", "-", "-"]),
        row(
            "pool",
            f"`RuntimePool(config, size={SIZE})`",
            [ratio(sustained["pool"], sustained["no pool"]), f">= {TARGET_RATE:g}x", verdict(met)],
        ),
    ]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


__all__ = ["Cycles", "acquire_latency", "close_latency", "pool_section", "run_cycles"]
