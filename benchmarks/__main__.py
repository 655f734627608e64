"""``python -m benchmarks``: the performance tables, each row beside a baseline of the same run.

    python -m benchmarks                  # full run (~5-10 minutes), writes benchmarks/RESULTS.md
    python -m benchmarks --quick          # few iterations, to check that everything runs
    python -m benchmarks --sections exec,files --no-modal-fake
    python -m benchmarks --wait-load 1.5  # first wait (up to --wait-max s) for a quiet machine
    python -m benchmarks --sections stream,shell --out ''  # two sections, no file written

Needs the Docker engine and the images of ``make images`` (``vf-sandbox/base:bookworm``,
``vf-sandbox/sshd``). The SSH rows run against a local ``vf-sandbox/sshd`` container; the
Modal rows against the FAKE Modal SDK of ``tests/modal`` (a Docker container behind Modal's
client code), labelled as such: they say nothing about real Modal latency. The SWE-ReX
baseline of the ``shell`` section needs ``vf-sandbox/swerex`` (``images/swerex``) and a venv
holding ``swe-rex`` (``--swerex-python``; ``make bench`` makes both); without them its rows
say what is missing. The ``inspect`` section needs ``inspect_ai`` and, for inspect's own
Docker sandbox, the ``docker compose`` v2 plugin (``make compose``; ``make bench`` tries it);
a sandbox that cannot run there is listed as not available, with the reason. The ``fork``
section forks a Docker sandbox holding 100 MiB (~5 rounds; 2 with ``--quick``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import anyio

from .stats import load, machine, table
from .suite import ALL_SECTIONS, Options, run

DEFAULT_SWEREX_PYTHON = Path(__file__).resolve().parent.parent / ".build/swerex-venv/bin/python"


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Options]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="few iterations (a smoke run)")
    parser.add_argument("--sections", default=",".join(ALL_SECTIONS))
    parser.add_argument("--image", default="vf-sandbox/base:bookworm")
    parser.add_argument("--n-exec", type=int, help="round trips per variant (300)")
    parser.add_argument("--n-create", type=int, help="creations per variant (15)")
    parser.add_argument("--sandboxes", type=int, help="concurrent sandboxes (32)")
    parser.add_argument("--execs-per-sandbox", type=int, help="execs in each (50)")
    parser.add_argument("--n-stream", type=int, help="first-chunk samples per variant (100)")
    parser.add_argument("--n-shell", type=int, help="session round trips per variant (200)")
    parser.add_argument("--n-inspect", type=int, help="inspect_ai ops per op and sandbox (100)")
    parser.add_argument(
        "--swerex-python",
        default=str(DEFAULT_SWEREX_PYTHON),
        help="python of the venv holding swe-rex (the SWE-ReX client)",
    )
    parser.add_argument("--no-ssh", action="store_true")
    parser.add_argument("--no-modal-fake", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).with_name("RESULTS.md")))
    parser.add_argument("--wait-load", type=float, default=0.0, help="wait for a 1-min load below")
    parser.add_argument("--wait-max", type=float, default=600.0)
    args = parser.parse_args(argv)
    options = Options(
        image=args.image,
        ssh=not args.no_ssh,
        modal_fake=not args.no_modal_fake,
        swerex_python=args.swerex_python or None,
    )
    if args.quick:
        options.n_exec, options.n_small_file, options.n_big_file = 30, 20, 3
        options.n_create, options.sandboxes, options.execs_per_sandbox = 3, 8, 10
        options.n_placement, options.proxy_turns = 5, 20
        options.n_stream, options.n_shell, options.n_inspect = 20, 30, 10
        options.n_pool, options.pool_cycles = 5, 20
        options.quick_scale = True
        options.n_ray_rollouts = 8
    for name in (
        "n_exec",
        "n_create",
        "sandboxes",
        "execs_per_sandbox",
        "n_stream",
        "n_shell",
        "n_inspect",
    ):
        if getattr(args, name) is not None:
            setattr(options, name, getattr(args, name))
    options.sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    unknown = options.sections - set(ALL_SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    return args, options


def wait_for_quiet(threshold: float, limit: float) -> None:
    deadline = time.monotonic() + limit
    while os.getloadavg()[0] >= threshold and time.monotonic() < deadline:
        print(f"load {load()}: waiting for < {threshold} ...", file=sys.stderr, flush=True)
        time.sleep(15)


def main(argv: list[str] | None = None) -> None:
    args, options = parse(argv)
    if args.wait_load:
        wait_for_quiet(args.wait_load, args.wait_max)
    load_start = load()
    started = time.monotonic()
    about, sections = anyio.run(run, options, backend="asyncio")
    elapsed = time.monotonic() - started
    described = machine(about[0][1])
    described += [
        ("load average (1/5/15 min) at start", load_start),
        ("load average (1/5/15 min) at end", load()),
        (
            "run",
            f"`python -m {' '.join(['benchmarks', *(argv or sys.argv[1:])])}`, "
            f"{elapsed:.0f} s, asyncio",
        ),
    ]
    parts = [
        "# vf-sandbox benchmarks",
        "",
        "Written by `python -m benchmarks` (`make bench`). Every row is measured beside its "
        "baseline in the same run, interleaved call by call where the section says so, so "
        "that both see the same load; read the ratios more than the absolute numbers on a "
        "shared machine. Times are wall-clock milliseconds unless stated. The SSH baseline "
        "is bare paramiko on a socket with `TCP_NODELAY` set (as `SSHRuntime` sets it). "
        "Rows marked `modal (FAKE SDK)` run Modal's client code against a local Docker "
        "container, not Modal.",
        "",
        table(["machine", ""], [[k, v] for k, v in described]),
    ]
    for title, text in sections:
        parts += ["", f"## {title}", "", text]
    report = "\n".join(parts) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
        print(f"written to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
