"""The embedded default beside its peers (section ``embedded`` of ``python -m benchmarks``).

The subprocess runtime (``open_runtime("subprocess")``, no channel: the host runs its
commands and file operations itself) against what a caller would otherwise use on the same
host, every row measured interleaved in the same run:

* ``exec(["true"])`` vs ``subprocess.run(["true"])``;
* ``write`` then ``read`` of 1 KiB vs plain ``open()`` write and read, and vs inspect_ai's
  local sandbox (``LocalSandboxEnvironment``: ``write_file`` then ``read_file``);
* ``read`` of 10 MiB vs ``open().read()`` of the same file;
* ``close()`` of a started sandbox that ran one ``exec`` vs inspect local's
  ``sample_cleanup`` (of a sample that ran one ``exec``) and a ``TemporaryDirectory``'s
  cleanup (a directory holding one file);
* concurrent exec throughput: 8 tasks x 50 ``exec(["true"])`` on one sandbox, three
  rounds, each round's execs/s and the spread (max/min).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from runtimes import open_runtime
from runtimes.base import Runtime
from runtimes.subprocess import SubprocessConfig

from .stats import Call, Measure, Series, interleaved_measures, table, timed
from .suite import Environment, KiB, MiB, Row, rows_table

TASK = "vf-bench-embedded"
TASKS, EXECS, ROUNDS = 8, 50, 3
SPREAD_TARGET = 1.5


@contextlib.asynccontextmanager
async def _inspect_local() -> AsyncIterator[Any]:
    """One sample's inspect local sandbox, through inspect's lifecycle; None if inspect_ai
    is not installed."""
    try:
        from inspect_ai.util._sandbox.local import LocalSandboxEnvironment
    except ImportError:
        yield None
        return
    await LocalSandboxEnvironment.task_init(TASK, None)
    environments = await LocalSandboxEnvironment.sample_init(TASK, None, {})
    try:
        yield environments["default"]
    finally:
        with anyio.CancelScope(shield=True):
            await LocalSandboxEnvironment.sample_cleanup(TASK, None, environments, False)
            await LocalSandboxEnvironment.task_cleanup(TASK, None, True)


def _plain_write_read(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
    with open(path, "rb") as fh:
        got = fh.read()
    assert got == data


def _plain_read(path: Path, size: int) -> None:
    with open(path, "rb") as fh:
        assert len(fh.read()) == size


async def _close_measure(root: Path) -> float:
    rt = await open_runtime(SubprocessConfig(root=str(root))).start()
    await rt.exec(["true"])
    started = time.perf_counter()
    await rt.close()
    return time.perf_counter() - started


async def _inspect_cleanup_measure() -> float:
    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment

    environments = await LocalSandboxEnvironment.sample_init(TASK, None, {})
    result = await environments["default"].exec(["true"])
    assert result.success, result
    started = time.perf_counter()
    await LocalSandboxEnvironment.sample_cleanup(TASK, None, environments, False)
    return time.perf_counter() - started


async def _tempdir_cleanup_measure() -> float:
    directory = tempfile.TemporaryDirectory(prefix="vf-bench-")
    (Path(directory.name) / "work").mkdir()
    subprocess.run(["true"], check=True)  # noqa: ASYNC221 - as the sandbox's one exec
    started = time.perf_counter()
    directory.cleanup()
    return time.perf_counter() - started


async def _shuffled(calls: dict[str, Call], n: int) -> dict[str, Series]:
    """Every call ``n`` times, one of each per round in a new (seeded) order every round:
    the first call after an ``exec`` finds colder caches (a fork and an exec ran), and no
    call may always be the one that pays for it."""

    def measure(call: Call) -> Measure:
        return lambda: timed(call)

    return await interleaved_measures(
        {name: measure(call) for name, call in calls.items()}, n, shuffle=True
    )


async def _throughput(rt: Runtime) -> float:
    """Execs per second of ``TASKS`` tasks running ``EXECS`` ``exec(["true"])`` each."""

    async def worker() -> None:
        for _ in range(EXECS):
            result = await rt.exec(["true"])
            assert result.exit_code == 0, result

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(TASKS):
            tg.start_soon(worker)
    return TASKS * EXECS / (time.perf_counter() - started)


async def embedded_section(env: Environment) -> tuple[str, list[Row]]:
    """The tables of the section (markdown) and its rows."""
    options = env.options
    small, big = os.urandom(KiB), os.urandom(10 * MiB)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="vf-bench-embedded-") as tmp:
        local = Path(tmp)
        (local / "big.bin").write_bytes(big)
        root = local / "root"
        async with (
            open_runtime(SubprocessConfig(root=str(root))) as rt,
            _inspect_local() as inspect_local,
        ):
            await rt.write("big.bin", big)

            async def ours_small() -> None:
                await rt.write("small.bin", small)
                assert await rt.read("small.bin") == small

            calls: dict[str, Call] = {
                "exec": lambda: rt.exec(["true"]),
                "subprocess.run": lambda: subprocess.run(["true"], check=True),
                "write+read 1 KiB": ours_small,
                "open() write+read 1 KiB": lambda: _plain_write_read(local / "small.bin", small),
            }
            if inspect_local is not None:

                async def inspect_small() -> None:
                    await inspect_local.write_file("small.bin", small)
                    assert await inspect_local.read_file("small.bin", text=False) == small

                calls["inspect local write+read 1 KiB"] = inspect_small
            else:
                notes.append("inspect_ai is not installed: no inspect local rows")
            series = await _shuffled(calls, options.n_exec)

            async def ours_big() -> None:
                assert len(await rt.read("big.bin")) == len(big)

            big_series = await _shuffled(
                {
                    "read 10 MiB": ours_big,
                    "open().read() 10 MiB": lambda: _plain_read(local / "big.bin", len(big)),
                },
                max(30, options.n_big_file),
            )
            rounds = [await _throughput(rt) for _ in range(ROUNDS)]
        measures: dict[str, Measure] = {
            "close()": lambda: _close_measure(root),
            "TemporaryDirectory cleanup": _tempdir_cleanup_measure,
        }
        if inspect_local is not None:
            measures["inspect local sample_cleanup"] = _inspect_cleanup_measure
        close_series = await interleaved_measures(
            measures, max(30, options.n_small_file), shuffle=True
        )
        left = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
        if left:
            notes.append(f"WARNING: sandbox directories left behind: {left}")
    rows = _rows(series, big_series, close_series)
    spread = max(rounds) / min(rounds)
    throughput = table(
        ["round", "execs/s"],
        [[str(i + 1), f"{rate:.0f}"] for i, rate in enumerate(rounds)]
        + [
            [
                "max/min",
                f"{spread:.2f} (target <= {SPREAD_TARGET}x: "
                f"{'met' if spread <= SPREAD_TARGET else '**missed**'})",
            ]
        ],
    )
    text = (
        "The subprocess runtime (no channel) beside plain host calls and inspect_ai's local "
        "sandbox, interleaved call by call in the same run, in a new order every round "
        f"(n={options.n_exec} for exec and 1 KiB files, at least 30 for 10 MiB reads and "
        "closes; `close()` of a started sandbox that ran one `exec`).\n\n"
        + rows_table(rows, tail=0.9)
        + f"\n\nConcurrent exec throughput: {TASKS} tasks x {EXECS} `exec(['true'])` on one "
        f"sandbox, {ROUNDS} rounds.\n\n" + throughput
    )
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text, rows


def _rows(series: dict[str, Series], big: dict[str, Series], close: dict[str, Series]) -> list[Row]:
    exec_ours, exec_base = series["exec"], series["subprocess.run"]
    small, plain = series["write+read 1 KiB"], series["open() write+read 1 KiB"]
    rows = [
        Row(
            "exec(['true'])",
            exec_ours,
            "subprocess.run",
            exec_base,
            "<= 1.3x",
            exec_ours.median_ms <= 1.3 * exec_base.median_ms,
        ),
        Row("write+read 1 KiB", small, "open() write+read", plain),
    ]
    inspect_small = series.get("inspect local write+read 1 KiB")
    if inspect_small is not None:
        rows.append(
            Row(
                "write+read 1 KiB",
                small,
                "inspect local write_file+read_file",
                inspect_small,
                "<= 1.2x",
                small.median_ms <= 1.2 * inspect_small.median_ms,
            )
        )
    read_ours, read_base = big["read 10 MiB"], big["open().read() 10 MiB"]
    rows.append(
        Row(
            "read 10 MiB",
            read_ours,
            "open().read()",
            read_base,
            "<= 1.2x",
            read_ours.median_ms <= 1.2 * read_base.median_ms,
        )
    )
    closing = close["close()"]
    met = closing.median_ms <= 1.0
    rows.append(
        Row(
            "close()",
            closing,
            "TemporaryDirectory cleanup",
            close["TemporaryDirectory cleanup"],
            "median <= 1 ms",
            met,
        )
    )
    inspect_cleanup = close.get("inspect local sample_cleanup")
    if inspect_cleanup is not None:
        rows.append(
            Row(
                "close()",
                closing,
                "inspect local sample_cleanup",
                inspect_cleanup,
                "median <= 1 ms",
                met,
            )
        )
    return rows


__all__ = ["embedded_section"]
