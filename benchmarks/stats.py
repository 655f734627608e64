"""Timing, statistics, markdown tables and the machine description for the benchmarks."""

from __future__ import annotations

import datetime
import inspect
import os
import platform
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

Call = Callable[[], Awaitable[object] | object]
Measure = Callable[[], Awaitable[float]]


@dataclass
class Series:
    """Samples of one measured thing, in seconds."""

    name: str
    samples: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples) * 1000

    def percentile_ms(self, fraction: float) -> float:
        ordered = sorted(self.samples)
        return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))] * 1000

    @property
    def p99_ms(self) -> float:
        return self.percentile_ms(0.99)


async def timed(call: Call) -> float:
    """Seconds one call takes (awaited if it returns an awaitable; blocking calls are timed
    in the event loop's thread, with nothing else running)."""
    started = time.perf_counter()
    outcome = call()
    if inspect.isawaitable(outcome):
        await outcome
    return time.perf_counter() - started


async def interleaved(calls: dict[str, Call], n: int, warmup: int = 5) -> dict[str, Series]:
    """Time every call ``n`` times, one of each in turn, so that all see the same load."""
    for _ in range(warmup):
        for call in calls.values():
            await timed(call)
    series = {name: Series(name) for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            series[name].samples.append(await timed(call))
    return series


async def interleaved_measures(
    measures: dict[str, Measure], n: int, warmup: int = 5, *, shuffle: bool = False
) -> dict[str, Series]:
    """Like :func:`interleaved`, for calls that measure themselves (a latency inside the
    call, a time taken in another process): each returns its own sample, in seconds.
    ``shuffle`` takes them in a new (seeded) order every round, so that no call always
    comes right after a slow one that leaves work behind (a busy engine or server)."""
    series = {name: Series(name) for name in measures}
    order = list(measures)
    rng = random.Random(0)
    for index in range(warmup + n):
        if shuffle:
            rng.shuffle(order)
        for name in order:
            sample = await measures[name]()
            if index >= warmup:
                series[name].samples.append(sample)
    return series


def ms(value: float) -> str:
    return f"{value:.2f}" if value < 100 else f"{value:.0f}"


def ratio(ours: float, base: float) -> str:
    return f"{ours / base:.2f}x" if base > 0 else "-"


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(met: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "-"}[met]


# ---------------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory() -> str:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"


def machine(docker_version: str) -> list[tuple[str, str]]:
    return [
        ("date", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")),
        ("CPU", f"{cpu_model()}, {os.cpu_count()} cores"),
        ("memory", memory()),
        ("kernel", f"{platform.system()} {platform.release()}"),
        ("Docker", docker_version),
        ("Python", platform.python_version()),
    ]
