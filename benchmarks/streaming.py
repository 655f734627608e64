"""First-chunk latency of a streamed exec on Docker (``python -m benchmarks --sections stream``).

Inside the container a ``python3`` program writes ``time.monotonic()`` with one ``os.write``
(unbuffered: written and flushed at once), then sleeps ``HOLD`` seconds before it exits. The
host records ``time.monotonic()`` when the first stdout chunk reaches the consumer: the
``on_output`` callback of ``Runtime.exec`` (through the channel and through the plain Docker
path), and the first item of the Docker SDK's ``exec_run(stream=True)`` generator (the
baseline). Host and containers share the kernel's ``CLOCK_MONOTONIC``, so ``arrival -
written`` is the latency. The sleep makes a chunk held back until the process exits show up
as a latency above ``HOLD``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio.to_thread

from runtimes.base import Runtime
from runtimes.docker import DockerConfig
from runtimes.models import Stream

from .stats import Measure, interleaved_measures
from .suite import Environment, Row, _check_channels, _remove, opened, rows_table

HOLD = 0.05
WRITER = (
    "import os, sys, time\n"
    "os.write(1, ('%.9f\\n' % time.monotonic()).encode())\n"
    "time.sleep(float(sys.argv[1]))\n"
)
ARGV = ["python3", "-c", WRITER, str(HOLD)]
TARGET_MS = 5.0
SDK = "docker SDK exec_run(stream=True)"


def _written_at(stdout: bytes) -> float:
    return float(stdout.split(b"\n", 1)[0])


def runtime_first_chunk(rt: Runtime) -> Measure:
    """Seconds from the write inside the sandbox to ``on_output`` seeing the first chunk."""

    async def measure() -> float:
        arrived: list[float] = []

        def on_output(stream: Stream, chunk: bytes) -> None:
            if stream == "stdout" and not arrived:
                arrived.append(time.monotonic())

        result = await rt.exec(ARGV, on_output=on_output, timeout=30)
        if result.exit_code != 0 or not arrived:
            raise RuntimeError(f"first-chunk writer failed in {rt.describe()}: {result!r}")
        return arrived[0] - _written_at(result.stdout_bytes)

    return measure


def sdk_first_chunk(container: Any) -> Measure:
    """The same through ``exec_run(stream=True)``, iterated in the event loop's thread (as
    a synchronous caller would), with nothing else running."""

    async def measure() -> float:
        stream = container.exec_run(ARGV, stream=True).output
        first: float | None = None
        data = b""
        for chunk in stream:
            if first is None:
                first = time.monotonic()
            data += chunk
        if first is None:
            raise RuntimeError("exec_run(stream=True) gave no output")
        return first - _written_at(data)

    return measure


async def stream_section(env: Environment) -> tuple[str, list[Row]]:
    n = env.options.n_stream
    image = env.options.image
    configs = {
        "docker, channel": DockerConfig(image=image, creations_per_second=None),
        "docker, no channel": DockerConfig(image=image, channel=False, creations_per_second=None),
    }
    container = env.bare_container()
    try:
        async with opened(configs) as runtimes:
            measures = {name: runtime_first_chunk(rt) for name, rt in runtimes.items()}
            measures[SDK] = sdk_first_chunk(container)
            series = await interleaved_measures(measures, n, warmup=3, shuffle=True)
            notes = _check_channels(runtimes)
    finally:
        await anyio.to_thread.run_sync(_remove, container)
    notes += [
        f"WARNING: {name}: a chunk arrived before it was written ({min(s.samples) * 1000:.2f} "
        "ms): host and container do not share CLOCK_MONOTONIC here; the rows mean nothing"
        for name, s in series.items()
        if min(s.samples) < 0
    ]
    sdk = series[SDK]
    rows = [
        Row(
            f"{name}: on_output first chunk",
            series[name],
            SDK,
            sdk,
            f"median <= {TARGET_MS:g} ms",
            series[name].median_ms <= TARGET_MS,
        )
        for name in configs
    ]
    text = (
        f"First chunk of a streamed exec (n={n} each, interleaved call by call in a new "
        "seeded random order each round): inside the container `python3` writes "
        "`time.monotonic()` with one unbuffered `os.write`, then sleeps "
        f"{HOLD * 1000:.0f} ms before exiting; the host takes `time.monotonic()` when the "
        "first stdout chunk reaches `exec(..., on_output=)` (the baseline: the first item of "
        "the Docker SDK's `exec_run(stream=True)` generator, read the same way). Host and "
        "container share `CLOCK_MONOTONIC`; the latency is arrival minus write "
        "(`benchmarks.streaming`). A chunk held until exit would show as more than "
        f"{HOLD * 1000:.0f} ms.\n\n" + rows_table(rows)
    )
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text, rows
