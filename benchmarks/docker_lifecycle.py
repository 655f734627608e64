"""DockerRuntime vs the plain docker SDK, measured in the same run against the same engine.

    python -m benchmarks.docker_lifecycle [-n 15] [--execs 200] [--image vf-sandbox/base:bookworm]

* create-to-ready: ``DockerRuntime.start()`` (live-slot and pace check, image check,
  labelled container created then started) and then one ``exec(["true"])`` returning, vs
  ``containers.run(image, keep-alive, detach=True)`` + a first ``exec_run(["true"])``.
  The two are interleaved so both see the same load; removal is not timed.
  Round trips are interleaved the same way.
* exec round trip of ``true`` in one live container: ``DockerRuntime.exec`` (sh prelude,
  hijacked stream, exit code) vs ``Container.exec_run`` (create + start + inspect).
* a 1 KiB file written then read: ``write`` + ``read`` (each checks the container runs,
  then uses the archive API) vs ``put_archive`` + ``get_archive``.

Prints a markdown table: medians, p90 (creation) or p99 (round trips) in milliseconds and
the ratio DockerRuntime / SDK.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tarfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from runtimes.docker import DEFAULT_IMAGE, DockerConfig, DockerRuntime

_KEEP_ALIVE = ["sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _row(name: str, ours: list[float], base: list[float], tail: float) -> list[str]:
    ms = [1000 * x for x in ours]
    bs = [1000 * x for x in base]
    ours_med, base_med = statistics.median(ms), statistics.median(bs)
    ours_tail, base_tail = _percentile(ms, tail), _percentile(bs, tail)
    return [
        name,
        f"{ours_med:.1f}",
        f"{base_med:.1f}",
        f"{ours_med / base_med:.2f}x",
        f"{ours_tail:.1f}",
        f"{base_tail:.1f}",
        f"{ours_tail / base_tail:.2f}x",
        f"p{round(tail * 100)}",
        str(len(ms)),
    ]


def _sdk_create_to_ready(client: Any, image: str) -> tuple[float, Any]:
    started = time.perf_counter()
    container = client.containers.run(
        image, _KEEP_ALIVE, detach=True, network_mode="none", init=True
    )
    result = container.exec_run(["true"])
    elapsed = time.perf_counter() - started
    assert result.exit_code == 0, result
    return elapsed, container


async def _runtime_create_to_ready(config: DockerConfig) -> tuple[float, DockerRuntime]:
    started = time.perf_counter()
    rt = DockerRuntime(config)
    await rt.start()
    result = await rt.exec(["true"])
    elapsed = time.perf_counter() - started
    assert result.exit_code == 0, result
    return elapsed, rt


async def _creation(client: Any, image: str, n: int) -> tuple[list[float], list[float]]:
    config = DockerConfig(image=image, creations_per_second=None)
    ours: list[float] = []
    base: list[float] = []
    for _ in range(n):
        elapsed, rt = await _runtime_create_to_ready(config)
        ours.append(elapsed)
        await rt.close()
        elapsed, container = await anyio.to_thread.run_sync(_sdk_create_to_ready, client, image)
        base.append(elapsed)
        await anyio.to_thread.run_sync(_remove, container)
    return ours, base


def _remove(container: Any) -> None:
    container.remove(force=True)


def _time_sync(fn: Callable[[], object], n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return samples


def _one_file_tar(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def _interleaved(
    ours: Callable[[], Awaitable[object]], base: Callable[[], object], n: int
) -> tuple[list[float], list[float]]:
    """Alternate one timed call of each, so both see the same load; the SDK call is
    timed inside its worker thread (the thread hop is not charged to it)."""
    ours_samples: list[float] = []
    base_samples: list[float] = []
    for _ in range(n):
        started = time.perf_counter()
        await ours()
        ours_samples.append(time.perf_counter() - started)
        base_samples.extend(await anyio.to_thread.run_sync(_time_sync, base, 1))
    return ours_samples, base_samples


async def _round_trips(
    client: Any, image: str, n: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    async with DockerRuntime(DockerConfig(image=image)) as rt:
        container = client.containers.get(rt.sandbox_id)
        for _ in range(10):  # warm both paths (connections, page cache)
            await rt.exec(["true"])
            container.exec_run(["true"])
        exec_ours, exec_base = await _interleaved(
            lambda: rt.exec(["true"]), lambda: container.exec_run(["true"]), n
        )
        payload = b"x" * 1024
        archive = _one_file_tar("plain.txt", payload)

        async def runtime_file() -> None:
            await rt.write("/work/bench.txt", payload)
            assert await rt.read("/work/bench.txt") == payload

        def plain_file() -> None:
            container.put_archive("/work", archive)
            stream, _ = container.get_archive("/work/plain.txt")
            b"".join(stream)

        file_ours, file_base = await _interleaved(runtime_file, plain_file, n)
    return exec_ours, exec_base, file_ours, file_base


async def main(n: int, execs: int, image: str) -> None:
    import docker

    client = docker.from_env()
    try:
        create_ours, create_base = await _creation(client, image, n)
        exec_ours, exec_base, file_ours, file_base = await _round_trips(client, image, execs)
    finally:
        client.close()
    headers = [
        "measure",
        "DockerRuntime median ms",
        "SDK median ms",
        "ratio",
        "DockerRuntime tail ms",
        "SDK tail ms",
        "ratio",
        "tail",
        "n",
    ]
    rows = [
        _row("create-to-ready", create_ours, create_base, 0.90),
        _row("exec `true` round trip", exec_ours, exec_base, 0.99),
        _row("write+read 1 KiB", file_ours, file_base, 0.99),
    ]
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---" for _ in headers) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=15, help="containers per side")
    parser.add_argument("--execs", type=int, default=200, help="round trips per side")
    parser.add_argument("--image", default=DEFAULT_IMAGE)
    args = parser.parse_args()
    anyio.run(main, args.n, args.execs, args.image)
