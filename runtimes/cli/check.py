"""``vf-sandbox check``: the conformance suite of ``runtimes.testing`` from the shell.

Checks run one by one, each in a fresh sandbox, as :func:`runtimes.testing.run_conformance`
runs them, but each under the CLI's Ctrl-C handling: an interrupt stops the suite after
closing the current check's sandbox, instead of failing one check and going on.
"""

from __future__ import annotations

import argparse
import time
import traceback

import anyio

from runtimes import RuntimeConfig
from runtimes.plugins import did_you_mean
from runtimes.testing import CHECKS, Check, CheckOutcome, CheckSkipped, run_check

from .commands import CommandFactory
from .exec import Interrupted, run_interruptible
from .output import print_json, print_table, say, shorten
from .targets import parse_runtime


def known_check(name: str) -> str:
    """argparse type of ``--select``: an unknown name is a usage error suggesting close ones."""
    names = [c.name for c in CHECKS]
    if name in names:
        return name
    hint = did_you_mean(name, names) or "; see check --list"
    raise argparse.ArgumentTypeError(f"unknown check {name!r}{hint}")


def run_one(chk: Check, config: RuntimeConfig, backend: str) -> CheckOutcome:
    """One check in a fresh sandbox, its failure or skip as the outcome.

    Raises:
        Interrupted: Ctrl-C; the check's sandbox was closed first.
    """

    async def body() -> int:
        await run_check(chk, config)
        return 0

    started = time.monotonic()
    try:
        anyio.run(run_interruptible, body, backend=backend)
    except Interrupted:
        raise
    except CheckSkipped as exc:
        return CheckOutcome(chk.name, "skip", str(exc), time.monotonic() - started)
    except Exception as exc:  # noqa: BLE001 - a failed check is a reported outcome
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return CheckOutcome(chk.name, "fail", detail, time.monotonic() - started)
    return CheckOutcome(chk.name, "pass", "", time.monotonic() - started)


def print_check_list(args: argparse.Namespace) -> int:
    if args.json:
        print_json("check", {"checks": [{"name": c.name, "doc": c.doc} for c in CHECKS]})
    else:
        rows = [(c.name, shorten(c.doc, args.verbose)) for c in CHECKS]
        print_table(["check", "what it asserts"], rows)
    return 0


def check_runtime(args: argparse.Namespace, config: RuntimeConfig) -> int:
    """Run the selected checks against ``config`` and report them; 1 if any failed.

    Raises:
        Interrupted: Ctrl-C; nothing is reported.
    """
    selected = [c for c in CHECKS if not args.select or c.name in args.select]
    outcomes = [run_one(chk, config, args.backend) for chk in selected]
    passed = sum(o.status == "pass" for o in outcomes)
    failed = sum(o.status == "fail" for o in outcomes)
    skipped = sum(o.status == "skip" for o in outcomes)
    if args.json:
        checks = [
            {"name": o.name, "status": o.status, "seconds": round(o.seconds, 3), "detail": o.detail}
            for o in outcomes
        ]
        summary = {"passed": passed, "failed": failed, "skipped": skipped}
        body = {"runtime": config.type, "backend": args.backend, "checks": checks}
        print_json("check", {**body, "summary": summary})
    else:
        print_table(
            ["check", "result", "seconds", "detail"],
            [
                (o.name, o.status.upper(), f"{o.seconds:.2f}", shorten(o.detail, args.verbose))
                for o in outcomes
            ],
        )
        say(f"\n{config.type}: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or not outcomes else 0


def cmd_check(args: argparse.Namespace) -> int:
    if args.list:
        return print_check_list(args)
    return check_runtime(args, parse_runtime(args.runtime))


def add_check_command(command: CommandFactory) -> None:
    """Register ``check`` with ``build_parser``'s ``command``."""
    check = command("check", "run the conformance suite against a backend", reporting=True)
    what = check.add_mutually_exclusive_group(required=True)
    what.add_argument("--runtime", help="the backend to check: a type name or a JSON config")
    what.add_argument("--list", action="store_true", help="list the check names and exit")
    check.add_argument(
        "--backend",
        default="asyncio",
        choices=["asyncio", "trio"],
        help="async library to run the checks on (default: %(default)s)",
    )
    check.add_argument(
        "--select",
        action="append",
        type=known_check,
        metavar="CHECK",
        help="run only this check (repeatable; names from --list)",
    )
    check.set_defaults(func=cmd_check)
