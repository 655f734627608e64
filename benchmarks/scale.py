"""How many idle Docker sandboxes with the channel this machine holds, and what each costs
(``python -m benchmarks --sections scale``, or ``python -m benchmarks.scale 64 128 256``).

For each N: start N Docker sandboxes (the channel agent running in each), have every one answer
``exec(["true"])``, hold them idle, then close them all. Reported per N: how many started and
answered, the wall time to get there, exec latency while all N are open (each sandbox in turn),
and memory per sandbox four ways, each a difference over the same N measured in this run:

* host total: the drop of the kernel's ``MemAvailable`` while the N are open (everything: this
  process, dockerd, containerd, the shims, the containers' own processes and page cache);
* this process: the growth of the benchmark process's RSS (vf-sandbox's host side: runtimes,
  channel threads and buffers);
* engine: the growth of the RSS of ``dockerd``, ``containerd`` and the ``containerd-shim``
  processes (the engine's per-container cost, the same for any client);
* in the sandbox: the container's memory cgroup usage (the agent, the init, their page cache),
  and the channel agent's own RSS read from ``ps`` inside one container.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from runtimes import open_runtime
from runtimes.base import Runtime
from runtimes.models import MiB

from .stats import ms, table
from .suite import DEFAULT_SCALE_COUNTS

START_CONCURRENCY = 16
ENGINE_NAMES = ("dockerd", "containerd")


@dataclass
class ScaleResult:
    n: int
    started: int = 0
    answered: int = 0
    errors: list[str] = field(default_factory=list)
    ready_s: float = 0.0
    close_s: float = 0.0
    exec_ms: list[float] = field(default_factory=list)
    available_drop: int = 0
    own_growth: int = 0
    engine_growth: int = 0
    cgroup_bytes: list[int] = field(default_factory=list)
    agent_rss: int | None = None
    left: int = 0


def _meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/meminfo")


def _rss(pid: int | str) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _engine_rss() -> int:
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if name in ENGINE_NAMES or name.startswith("containerd-shim"):
            total += _rss(entry.name)
    return total


def _cgroup_usage(container_id: str) -> int | None:
    for path in (
        f"/sys/fs/cgroup/memory/docker/{container_id}/memory.usage_in_bytes",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/memory.current",
        f"/sys/fs/cgroup/docker/{container_id}/memory.current",
    ):
        try:
            return int(Path(path).read_text())
        except OSError:
            continue
    return None


async def _settle() -> None:
    await anyio.sleep(2)


async def _start_all(config: dict[str, object], n: int, result: ScaleResult) -> list[Runtime]:
    runtimes: list[Runtime] = []
    limiter = anyio.Semaphore(START_CONCURRENCY)

    async def start_one() -> None:
        async with limiter:
            rt = open_runtime(config)
            try:
                await rt.start()
            except Exception as exc:  # noqa: BLE001 - counted and reported per N
                result.errors.append(f"start: {type(exc).__name__}: {exc}")
                return
            runtimes.append(rt)
            try:
                answered = (await rt.exec(["true"], timeout=60)).exit_code == 0
            except Exception as exc:  # noqa: BLE001 - counted and reported per N
                result.errors.append(f"exec: {type(exc).__name__}: {exc}")
                return
            result.answered += answered

    async with anyio.create_task_group() as tg:
        for _ in range(n):
            tg.start_soon(start_one)
    result.started = len(runtimes)
    return runtimes


async def _agent_rss(rt: Runtime) -> int | None:
    listing = await rt.exec(["ps", "-eo", "rss=,args="], timeout=30)
    for line in listing.stdout.splitlines():
        rss, _, args = line.strip().partition(" ")
        if "python3" in args and "ps -eo" not in args:
            return int(rss) * 1024
    return None


async def measure(n: int, image: str) -> ScaleResult:
    result = ScaleResult(n)
    config: dict[str, object] = {
        "type": "docker",
        "image": image,
        "max_live": max(n, 64),
        "creations_per_second": None,
    }
    await _settle()
    available, own, engine = _meminfo("MemAvailable"), _rss("self"), _engine_rss()
    started = time.monotonic()
    runtimes = await _start_all(config, n, result)
    result.ready_s = time.monotonic() - started
    try:
        await _settle()
        result.available_drop = available - _meminfo("MemAvailable")
        result.own_growth = _rss("self") - own
        result.engine_growth = _engine_rss() - engine
        for rt in runtimes:
            usage = _cgroup_usage(str(rt.sandbox_id))
            if usage is not None:
                result.cgroup_bytes.append(usage)
            begun = time.monotonic()
            await rt.exec(["true"], timeout=60)
            result.exec_ms.append((time.monotonic() - begun) * 1000)
        if runtimes:
            result.agent_rss = await _agent_rss(runtimes[0])
    finally:
        closing = time.monotonic()
        async with anyio.create_task_group() as tg:
            for rt in runtimes:
                tg.start_soon(rt.close)
        result.close_s = time.monotonic() - closing
    result.left = await _labelled_left(runtimes)
    return result


async def _labelled_left(runtimes: Sequence[Runtime]) -> int:
    import docker

    client = docker.from_env()
    ids = {str(rt.sandbox_id) for rt in runtimes}
    return sum(1 for c in client.containers.list(all=True) if c.id in ids)


def _per(total: int, n: int) -> str:
    return f"{total / max(n, 1) / MiB:.1f}"


def _median_mib(values: Sequence[int]) -> str:
    return f"{statistics.median(values) / MiB:.1f}" if values else "n/a"


def report(results: Sequence[ScaleResult]) -> str:
    headers = [
        "N",
        "started / answered",
        "errors",
        "ready (s)",
        "exec p50 ms (all open)",
        "host MiB/sandbox",
        "this process MiB/sandbox",
        "engine MiB/sandbox",
        "container cgroup MiB (median)",
        "agent RSS MiB",
        "close all (s)",
        "left",
    ]
    rows = []
    for r in results:
        p50 = ms(statistics.median(r.exec_ms)) if r.exec_ms else "n/a"
        agent = f"{r.agent_rss / MiB:.1f}" if r.agent_rss is not None else "n/a"
        rows.append(
            [
                str(r.n),
                f"{r.started} / {r.answered}",
                str(len(r.errors)),
                f"{r.ready_s:.1f}",
                p50,
                _per(r.available_drop, r.started),
                _per(r.own_growth, r.started),
                _per(r.engine_growth, r.started),
                _median_mib(r.cgroup_bytes),
                agent,
                f"{r.close_s:.1f}",
                str(r.left),
            ]
        )
    notes = [f"- N={r.n}: first error: {r.errors[0]}" for r in results if r.errors]
    return table(headers, rows) + ("\n" + "\n".join(notes) + "\n" if notes else "")


async def scale_section(counts: Sequence[int], image: str) -> str:
    results = [await measure(n, image) for n in counts]
    return report(results)


def main(argv: Sequence[str]) -> None:
    counts = [int(a) for a in argv] or list(DEFAULT_SCALE_COUNTS)
    image = os.environ.get("VF_BENCH_IMAGE", "vf-sandbox/base:bookworm")
    print(anyio.run(scale_section, counts, image))


if __name__ == "__main__":
    main(sys.argv[1:])
