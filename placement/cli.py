"""The ``vf-sandbox`` command.

Its main job is ``judge``: judge a recorded rollout with the judges of a file, print a
verdict table and write every agent run as JSON. Other subcommands: ``check`` (the
conformance suite against any backend), ``cleanup`` (sweep leaked sandboxes), ``ls``
(labelled sandboxes of every backend), ``doctor`` (which backends work here, and why
not), ``exec`` (one command in a fresh sandbox).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from harnesses.errors import HarnessError, ModelError
from runtimes import (
    RuntimeConfig,
    SandboxError,
    available_runtimes,
    load_runtime_class,
    open_runtime,
    resolve_runtime_config,
)
from runtimes.cleanup import cleanup_sandboxes

from .errors import PlacementError


def parse_runtime(text: str) -> RuntimeConfig:
    """A runtime given on the command line: a JSON object, or a bare type name."""
    stripped = text.strip()
    if stripped.startswith("{"):
        try:
            data: Any = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise SandboxError(f"--runtime is not valid JSON: {exc}") from None
        return resolve_runtime_config(data)
    return resolve_runtime_config(stripped)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


# ---------------------------------------------------------------------- check


def cmd_check(args: argparse.Namespace) -> int:
    from runtimes.testing import run_conformance

    config = parse_runtime(args.runtime)
    outcomes = run_conformance(config, backend=args.backend, select=args.select or None)
    print_table(
        ["check", "result", "seconds", "detail"],
        [(o.name, o.status.upper(), f"{o.seconds:.2f}", o.detail[:100]) for o in outcomes],
    )
    passed = sum(o.status == "pass" for o in outcomes)
    failed = sum(o.status == "fail" for o in outcomes)
    skipped = sum(o.status == "skip" for o in outcomes)
    print(f"\n{config.type}: {passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or not outcomes else 0


# ---------------------------------------------------------------------- cleanup / ls


def _targets(runtimes: list[str] | None) -> list[RuntimeConfig | str] | None:
    if not runtimes:
        return None
    return [parse_runtime(r) if r.strip().startswith("{") else r for r in runtimes]


def cmd_cleanup(args: argparse.Namespace) -> int:
    results = anyio.run(
        lambda: cleanup_sandboxes(
            _targets(args.runtime),
            all_sessions=args.all,
            older_than=args.older_than,
            dry_run=args.dry_run,
        )
    )
    print_table(
        ["backend", "sandbox", "action", "reason"],
        [(r.info.backend, r.info.id[:24], r.action, r.reason) for r in results],
    )
    removed = sum(r.action == "removed" for r in results)
    failed = sum(r.action == "failed" for r in results)
    print(f"\n{removed} removed, {failed} failed, {len(results) - removed - failed} kept")
    return 1 if failed else 0


def cmd_ls(args: argparse.Namespace) -> int:
    from runtimes import ownership

    async def gather() -> list[tuple[str, str, str, str, str]]:
        rows = []
        for target in _targets(args.runtime) or list(available_runtimes()):
            config = None if isinstance(target, str) else target
            name = target if isinstance(target, str) else target.type
            try:
                found = await load_runtime_class(name).list_sandboxes(config)
            except SandboxError as exc:
                print(f"{name}: not listed ({exc})", file=sys.stderr)
                continue
            for info in found:
                dead = ownership.session_is_dead(info.labels)
                status = {True: "dead", False: "alive", None: "unknown"}[dead]
                rows.append((info.backend, info.id[:24], info.state, info.created or "", status))
        return rows

    rows = anyio.run(gather)
    print_table(["backend", "sandbox", "state", "created", "session"], rows)
    return 0


# ---------------------------------------------------------------------- doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    async def probe(name: str) -> tuple[str, str]:
        try:
            with anyio.fail_after(args.timeout):
                async with open_runtime(name) as rt:
                    result = await rt.exec(["true"], timeout=args.timeout)
            return ("ok", f"exec exit {result.exit_code}")
        except SandboxError as exc:
            return ("unavailable", f"{type(exc).__name__}: {exc}".splitlines()[0][:120])
        except TimeoutError:
            return ("unavailable", f"no answer within {args.timeout}s")

    rows = []
    for name, plugin in available_runtimes().items():
        status, why = anyio.run(probe, name)
        rows.append((name, plugin.distribution, status, why))
    print_table(["backend", "package", "status", "detail"], rows)
    return 0


# ---------------------------------------------------------------------- exec


def cmd_exec(args: argparse.Namespace) -> int:
    async def run() -> int:
        async with open_runtime(parse_runtime(args.runtime)) as rt:
            result = await rt.exec(args.argv, timeout=args.timeout)
        sys.stdout.buffer.write(result.stdout_bytes)
        sys.stderr.buffer.write(result.stderr_bytes)
        return result.exit_code

    return anyio.run(run)


# ---------------------------------------------------------------------- judge


def cmd_judge(args: argparse.Namespace) -> int:
    from harnesses.llm import ModelTable

    from .rollout import environment_models, judge_rollout, load_rollout, scripted_models
    from .run import AgentRun
    from .specs import load_judges

    rollout = load_rollout(args.rollout)
    judges = load_judges(args.judges)
    runtime = parse_runtime(args.runtime)

    def progress(run: AgentRun) -> None:
        status = "ok" if run.ok else f"FAILED ({run.error_type})"
        print(f"  judge {run.name}: {status} in {run.seconds:.1f}s", file=sys.stderr, flush=True)

    def judge(specs: list[Any], models: ModelTable, label: str) -> list[AgentRun]:
        print(
            f"judging {args.rollout} with {len(specs)} judges on {runtime.type} ({label})",
            file=sys.stderr,
            flush=True,
        )
        return anyio.run(
            lambda: judge_rollout(rollout, specs, models, runtime, progress, args.deadline)
        )

    if args.models:
        runs = judge(judges, ModelTable.from_file(args.models), f"models from {args.models}")
    elif os.environ.get("OPENAI_BASE_URL"):
        runs = judge(judges, environment_models(judges, os.environ), "OPENAI_BASE_URL")
    elif args.scripted:
        with scripted_models(judges, args.scripted) as (specs, models):
            runs = judge(specs, models, f"SCRIPTED model replies from {args.scripted}")
    else:
        raise SandboxError("no model: pass --models FILE, set OPENAI_BASE_URL, or --scripted FILE")
    print_table(
        ["judge", "placement", "verdict", "error"],
        [
            (
                r.name,
                r.placement,
                json.dumps(r.verdict) if r.verdict is not None else "-",
                f"{r.error_type}: {r.error}"[:90] if r.error else "",
            )
            for r in runs
        ],
    )
    out = Path(args.out)
    out.write_text(json.dumps([r.model_dump(mode="json") for r in runs], indent=2))
    print(f"\nagent runs written to {out}", file=sys.stderr)
    return 0 if all(r.ok for r in runs) else 1


# ---------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vf-sandbox", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    judge = sub.add_parser("judge", help="judge a recorded rollout (the main job)")
    judge.add_argument("rollout", help="rollout directory: task.json, trace.json, files/")
    judge.add_argument("--judges", required=True, help="YAML/JSON file of judge specs")
    judge.add_argument("--runtime", default="subprocess", help="where the rollout's world lives")
    judge.add_argument("--models", help="YAML/JSON model table")
    judge.add_argument("--scripted", help="offline: a JSON file of scripted replies per judge")
    judge.add_argument("--out", default="agent-runs.json", help="where to write the runs")
    judge.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="bound the whole judging: judges still running then fail (JudgeBudgetExceeded)",
    )
    judge.set_defaults(func=cmd_judge)

    check = sub.add_parser("check", help="run the conformance suite against a backend")
    check.add_argument("--runtime", required=True, help="a type name or a JSON config")
    check.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    check.add_argument("--select", action="append", help="run only this check (repeatable)")
    check.set_defaults(func=cmd_check)

    cleanup = sub.add_parser("cleanup", help="remove sandboxes whose session is dead")
    cleanup.add_argument("--runtime", action="append", help="type name or JSON config (repeatable)")
    cleanup.add_argument("--all", action="store_true", help="remove every labelled sandbox")
    cleanup.add_argument("--older-than", type=float, metavar="SECONDS")
    cleanup.add_argument("--dry-run", action="store_true")
    cleanup.set_defaults(func=cmd_cleanup)

    ls = sub.add_parser("ls", help="list labelled sandboxes of every backend")
    ls.add_argument("--runtime", action="append")
    ls.set_defaults(func=cmd_ls)

    doctor = sub.add_parser("doctor", help="which backends work on this machine, and why not")
    doctor.add_argument("--timeout", type=float, default=60.0)
    doctor.set_defaults(func=cmd_doctor)

    exec_ = sub.add_parser("exec", help="run one command in a fresh sandbox")
    exec_.add_argument("--runtime", default="subprocess")
    exec_.add_argument("--timeout", type=float)
    exec_.add_argument("argv", nargs=argparse.REMAINDER)
    exec_.set_defaults(func=cmd_exec)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "argv", None) is not None:
        args.argv = [a for a in args.argv if a != "--"] if args.argv[:1] == ["--"] else args.argv
    try:
        code: int = args.func(args)
    except (SandboxError, PlacementError, HarnessError, ModelError) as exc:
        print(f"vf-sandbox: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
