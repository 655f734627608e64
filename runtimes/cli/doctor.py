"""``vf-sandbox doctor``: can each backend start a sandbox and run ``true``?

Each probe runs in its own daemon thread with its own event loop, all at once. A
backend whose client blocks in a library call that ignores cancellation (an SSH
handshake, a Docker socket) cannot hold the report past ``--timeout``: the doctor stops
waiting for it and reports it as not answering; the thread is abandoned at exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import threading
import time
from typing import Any

import anyio

from runtimes import SandboxError, available_runtimes, open_runtime

from .commands import CommandFactory
from .output import print_json, print_table, shorten
from .targets import parse_runtime_target

# Time a probe still gets after its timeout to close what it opened, before it is abandoned.
CLOSE_GRACE = 2.0

Target = str | dict[str, Any]


def target_name(target: Target) -> str:
    return target if isinstance(target, str) else str(target.get("type", "?"))


def _row(target: Target, status: str, detail: str, started: float) -> dict[str, Any]:
    plugin = available_runtimes().get(target_name(target))
    return {
        "name": target_name(target),
        "package": plugin.distribution if plugin else None,
        "status": status,
        "detail": detail,
        "seconds": round(time.monotonic() - started, 3),
    }


async def probe_backend(target: Target, timeout: float) -> dict[str, Any]:
    """Start a sandbox and run ``true`` in it within ``timeout``; the outcome as a row.

    Never raises: a failure of any kind is the backend's row, so one broken plugin
    cannot hide the others. ``ray`` is :func:`probe_cluster`.
    """
    if target_name(target) == "ray":
        return await probe_cluster(target, timeout)
    return await probe_sandbox(target, timeout)


async def probe_sandbox(target: Target, timeout: float) -> dict[str, Any]:
    """:func:`probe_backend` of any backend: a sandbox started, ``true`` run in it."""
    started = time.monotonic()
    try:
        with anyio.fail_after(timeout):
            async with open_runtime(target) as rt:
                result = await rt.exec(["true"], timeout=timeout)
        ok = result.exit_code == 0
        status, detail = ("ok" if ok else "unavailable"), f"exec of true exited {result.exit_code}"
    except SandboxError as exc:
        status, detail = "unavailable", f"{type(exc).__name__}: {exc}"
    except TimeoutError:
        status, detail = "unavailable", f"no answer within {timeout:g}s"
    except Exception as exc:  # noqa: BLE001 - a plugin's own bug is reported in its row
        status, detail = "unavailable", f"plugin bug: {type(exc).__name__}: {exc}"
    return _row(target, status, detail, started)


async def probe_cluster(target: Target, timeout: float) -> dict[str, Any]:
    """The ``ray`` backend's row: its cluster's nodes (alive and dead, their addresses, their
    free/total ``vf_sandbox`` slots) in ``detail`` and ``cluster``, after the usual probe
    through it when the target names a sandbox's runtime. ``ok`` when that probe passed (or
    there was none) and an alive node offers slots. Never raises.
    """
    from runtimes.ray.cluster import cluster_nodes, describe_nodes, where

    started = time.monotonic()
    fields = {} if isinstance(target, str) else target
    row = await probe_sandbox(target, timeout) if "runtime" in fields else None
    try:
        with anyio.fail_after(timeout):
            nodes = await cluster_nodes(fields or None)
    except SandboxError as exc:
        status, detail, report = "unavailable", f"{type(exc).__name__}: {exc}", None
    except TimeoutError:
        status, detail, report = "unavailable", f"no answer within {timeout:g}s", None
    else:
        serving = any(node.alive and node.slots_total > 0 for node in nodes)
        status = "ok" if serving else "unavailable"
        detail = describe_nodes(nodes) + ("" if serving else "; no alive node offers slots")
        address = where(fields)[0] or os.environ.get("RAY_ADDRESS") or "auto"
        report = {"address": address, "nodes": [dataclasses.asdict(n) for n in nodes]}
    cluster_row = _row(target, status, detail, started)
    if row is not None:
        cluster_row["status"] = "ok" if row["status"] == status == "ok" else "unavailable"
        cluster_row["detail"] = f"{row['detail']}; cluster: {detail}"
    cluster_row["cluster"] = report
    return cluster_row


async def probe_until_stopped(
    target: Target, timeout: float, stop: threading.Event
) -> dict[str, Any] | None:
    """:func:`probe_backend`, cancelled (closing what it opened) once ``stop`` is set;
    ``None`` then."""
    rows: list[dict[str, Any]] = []
    async with anyio.create_task_group() as tg:

        async def cancel_on_stop() -> None:
            while not stop.is_set():  # noqa: ASYNC110 - a threading.Event, set by the main thread
                await anyio.sleep(0.1)
            tg.cancel_scope.cancel()

        tg.start_soon(cancel_on_stop)
        rows.append(await probe_backend(target, timeout))
        tg.cancel_scope.cancel()
    return None if stop.is_set() else rows[0]


def wait_all(events: list[threading.Event], deadline: float) -> None:
    for event in events:
        event.wait(max(0.0, deadline - time.monotonic()))


def probe_all(targets: list[Target], timeout: float) -> list[dict[str, Any]]:
    """Every target probed at once; returns within ``timeout`` plus :data:`CLOSE_GRACE`.

    Raises:
        KeyboardInterrupt: Ctrl-C; the probes were cancelled and given the grace to close.
    """
    rows: list[dict[str, Any] | None] = [None] * len(targets)
    stop = threading.Event()
    # Events, not Thread.join: on Python 3.11 a join interrupted by Ctrl-C returns at once
    # from then on, which would skip the probes' closing grace.
    done = [threading.Event() for _ in targets]

    def probe_into(i: int) -> None:
        # Ctrl-C must reach the main thread: a SIGINT the kernel hands to another thread
        # would not wake the main thread's wait. Threads started from here inherit the mask.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            rows[i] = anyio.run(probe_until_stopped, targets[i], timeout, stop)
        finally:
            done[i].set()

    started = time.monotonic()
    try:
        for i, target in enumerate(targets):
            name = f"doctor-{target_name(target)}"
            threading.Thread(target=probe_into, args=(i,), name=name, daemon=True).start()
        wait_all(done, started + timeout + CLOSE_GRACE)
    except KeyboardInterrupt:  # also while the threads start: the started ones must stop
        stop.set()
        wait_all(done, time.monotonic() + CLOSE_GRACE)
        raise
    return [
        row or _row(target, "unavailable", f"no answer within {timeout:g}s", started)
        for row, target in zip(list(rows), targets, strict=True)
    ]


def cmd_doctor(args: argparse.Namespace) -> int:
    requested = [parse_runtime_target(r) for r in args.runtime or []]
    targets: list[str | dict[str, Any]] = requested or list(available_runtimes())
    rows = probe_all(targets, args.timeout)
    ok = [row["status"] == "ok" for row in rows]
    code = 0 if (all(ok) if requested else any(ok)) else 1
    if args.json:
        names = [target_name(t) for t in requested]
        print_json("doctor", {"requested": names, "timeout": args.timeout, "backends": rows})
    else:
        print_table(
            ["backend", "package", "status", "seconds", "detail"],
            [
                (
                    r["name"],
                    r["package"] or "-",
                    r["status"],
                    f"{r['seconds']:.1f}",
                    shorten(r["detail"], args.verbose),
                )
                for r in rows
            ],
        )
    return code


def add_doctor_command(command: CommandFactory) -> None:
    """Register ``doctor`` with ``build_parser``'s ``command``."""
    doctor = command(
        "doctor",
        "which backends work on this machine, and why not",
        "Probe backends in parallel: start a sandbox and run `true` in it.\n"
        "Exit 1 when a requested (--runtime) backend is unavailable; without --runtime,\n"
        "every registered backend is probed and the exit is 1 only if none works.",
        reporting=True,
    )
    doctor.add_argument(
        "--runtime",
        action="append",
        help="probe only this backend: type name or JSON config (repeatable)",
    )
    doctor.add_argument(
        "--timeout",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="per-backend bound (default: %(default)s)",
    )
    doctor.set_defaults(func=cmd_doctor)
