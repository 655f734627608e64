"""``vf-sandbox judge``: judge a recorded rollout, print a verdict table, write the runs.

The runs file (``--out``) is never replaced silently: an existing file is refused before
any judging starts unless ``--force``. Each run is recorded with the judge's logical model
(the name its spec gives, the model table's key) in ``model``, and the model name sent to
the endpoint in ``endpoint_model``. ``--require EXPR`` (:mod:`placement.requirements`)
turns verdicts into an exit status for CI.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from harnesses.errors import HarnessConfigError, HarnessError, ModelConfigError, ModelError
from runtimes.cli import Command, CommandFactory, parse_runtime, run_interruptible
from runtimes.cli.output import print_json, print_table, say, shorten

from .errors import PlacementConfigError, PlacementError
from .requirements import Requirement, parse_requirement

if TYPE_CHECKING:  # imported when judging: the other commands start without them
    from harnesses.llm import ModelTable

    from .run import AgentRun
    from .specs import JudgeSpec

__all__ = [
    "EXIT_REQUIREMENT",
    "JUDGE_COMMAND",
    "add_judge_command",
    "cmd_judge",
    "print_judge_report",
    "require_argument",
]

EXIT_REQUIREMENT = 3
"""Every judge produced a verdict, but one does not meet a ``--require``."""

FULL_ERROR_CHARS = 4000
"""How much of each failed run's error the report prints in full below the table (``-v``:
all of it)."""


def require_argument(text: str) -> Requirement:
    """argparse type of ``--require``: a malformed expression is a usage error.

    Raises:
        argparse.ArgumentTypeError: not of the grammar of :mod:`placement.requirements`.
    """
    try:
        return parse_requirement(text)
    except PlacementConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _check_out(out: Path, force: bool) -> None:
    """Refuse to replace ``--out`` without ``--force`` (before any judging).

    Raises:
        PlacementConfigError: it exists (and no ``--force``), or is a directory.
    """
    if out.is_dir():
        raise PlacementConfigError(f"--out {out} is a directory: name a file")
    if out.exists() and not force:
        raise PlacementConfigError(
            f"--out {out} exists: pass --force to replace it, or --out another file"
        )


def _check_requirements(requirements: Sequence[Requirement], judges: Sequence[JudgeSpec]) -> None:
    """Raises PlacementConfigError: a requirement names a judge the file does not have."""
    from runtimes.plugins import did_you_mean

    names = [j.name for j in judges]
    for req in requirements:
        if req.judge is not None and req.judge not in names:
            hint = did_you_mean(req.judge, names)
            raise PlacementConfigError(
                f"--require {req.text!r}: no judge {req.judge!r} in the judges file{hint}"
            )


def run_records(
    runs: Sequence[AgentRun], logical: Mapping[str, str], models: ModelTable
) -> list[dict[str, Any]]:
    """The runs as ``--out`` records them: ``model`` is the judge's logical model (its
    spec's), ``endpoint_model`` the model name its endpoint was asked for (``None`` where no
    endpoint served it, e.g. ``policy``)."""
    records = []
    for run in runs:
        record = run.model_dump(mode="json")
        endpoint = models.models.get(run.model)
        record["model"] = logical.get(run.name, run.model)
        record["endpoint_model"] = endpoint.model if endpoint is not None else None
        records.append(record)
    return records


def unmet(runs: Sequence[AgentRun], requirements: Sequence[Requirement]) -> list[dict[str, str]]:
    """Each (requirement, judge) pair that fails, with why."""
    found = []
    for req in requirements:
        for run in runs:
            if req.applies_to(run.name):
                why = req.failure(run.verdict)
                if why is not None:
                    found.append({"requirement": req.text, "judge": run.name, "reason": why})
    return found


def cmd_judge(args: argparse.Namespace) -> int:
    """The whole ``judge`` command once its arguments are parsed.

    Raises:
        PlacementConfigError: an unreadable rollout or judges file, no model source, an
            existing ``--out`` without ``--force``, a ``--require`` naming no judge.
        SandboxError, HarnessError, ModelError: as :func:`placement.rollout.judge_rollout`.
    """
    from harnesses.llm import ModelTable

    from .rollout import environment_models, judge_rollout, load_rollout, scripted_models
    from .specs import load_judges

    rollout = load_rollout(args.rollout)
    judges = load_judges(args.judges)
    requirements: list[Requirement] = args.require or []
    _check_requirements(requirements, judges)
    runtime = parse_runtime(args.runtime)
    out = Path(args.out)
    _check_out(out, args.force)  # after the inputs' own errors, before any judging
    logical = {j.name: j.model for j in judges}

    def progress(run: AgentRun) -> None:
        status = "ok" if run.ok else f"FAILED ({run.error_type})"
        say(f"  judge {run.name}: {status} in {run.seconds:.1f}s", stderr=True, flush=True)

    def judge(specs: list[Any], models: ModelTable, label: str) -> list[AgentRun]:
        say(
            f"judging {args.rollout} with {len(specs)} judges on {runtime.type} ({label})",
            stderr=True,
            flush=True,
        )
        return anyio.run(
            run_interruptible,
            lambda: judge_rollout(rollout, specs, models, runtime, progress, args.deadline),
        )

    if args.models:
        models = ModelTable.from_file(args.models)
        runs = judge(judges, models, f"models from {args.models}")
    elif os.environ.get("OPENAI_BASE_URL"):
        models = environment_models(judges, os.environ)
        runs = judge(judges, models, "OPENAI_BASE_URL")
    elif args.scripted:
        with scripted_models(judges, args.scripted) as (specs, models):
            runs = judge(specs, models, f"SCRIPTED model replies from {args.scripted}")
    else:
        raise PlacementConfigError(
            "no model: pass --models FILE, set OPENAI_BASE_URL, or --scripted FILE"
        )
    out.write_text(json.dumps(run_records(runs, logical, models), indent=2))
    failed = unmet(runs, requirements)
    print_judge_report(args, runtime.type, runs, failed)
    say(f"\nagent runs written to {out}", stderr=True)
    if not all(r.ok for r in runs):
        return 1
    return EXIT_REQUIREMENT if failed else 0


def print_judge_report(
    args: argparse.Namespace,
    runtime_type: str,
    runs: Sequence[Any],
    failed: Sequence[Mapping[str, str]] = (),
) -> None:
    """The verdict table (failed runs' errors in full below it), or the ``--json`` document."""
    if args.json:
        keys = ("name", "placement", "verdict", "error_type", "error", "seconds")
        rows = [{"ok": r.ok, **{k: getattr(r, k) for k in keys}} for r in runs]
        body = {
            "rollout": str(args.rollout),
            "runtime": runtime_type,
            "out": str(args.out),
            "runs": rows,
            "unmet": list(failed),
        }
        print_json("judge", body)
        return
    print_table(
        ["judge", "placement", "verdict", "error"],
        [
            (
                r.name,
                r.placement,
                json.dumps(r.verdict) if r.verdict is not None else "-",
                shorten(f"{r.error_type}: {r.error}", args.verbose) if r.error else "",
            )
            for r in runs
        ],
    )
    errors = [
        r
        for r in runs
        if r.error
        and shorten(f"{r.error_type}: {r.error}", False) != (f"{r.error_type}: {r.error}")
    ]
    if errors and not args.verbose:
        # The table cuts long errors; their end (the variable or file they name) is here.
        say("\nerrors:")
        for r in errors:
            text = f"{r.error_type}: {r.error}"
            if len(text) > FULL_ERROR_CHARS:
                text = text[: FULL_ERROR_CHARS - 1] + "…"
            say(f"  {r.name}: {text}")
    for item in failed:
        say(f"requirement {item['requirement']!r} not met by {item['judge']}: {item['reason']}")


def add_judge_command(command: CommandFactory) -> None:
    """Register ``judge`` with the ``vf-sandbox`` parser's ``command``."""
    judge = command("judge", "judge a recorded rollout (the main job)", reporting=True)
    judge.add_argument("rollout", help="rollout directory: task.json, trace.json, files/")
    judge.add_argument("--judges", required=True, help="YAML/JSON file of judge specs")
    judge.add_argument(
        "--runtime",
        default="subprocess",
        help="where the rollout's world lives: a type name or a JSON config",
    )
    judge.add_argument("--models", help="YAML/JSON model table")
    judge.add_argument(
        "--scripted",
        help="offline: a JSON file of scripted replies per judge (format: docs/cli.md, "
        "'The --scripted replies file'; schema: harnesses.scripted.ScriptFile)",
    )
    judge.add_argument(
        "--out",
        default="agent-runs.json",
        help="where to write the runs (default: %(default)s; an existing file needs --force)",
    )
    judge.add_argument(
        "--force", action="store_true", help="replace --out when it exists (else: exit 2)"
    )
    judge.add_argument(
        "--require",
        action="append",
        type=require_argument,
        metavar="EXPR",
        help="exit 3 unless every verdict meets EXPR, [JUDGE:]FIELD OP VALUE "
        "(e.g. 'score>=0.5', 'passed==true'; repeatable; docs/cli.md)",
    )
    judge.add_argument(
        "--deadline",
        type=float,
        metavar="SECONDS",
        help="bound the whole judging: judges still running then fail (JudgeBudgetExceeded)",
    )
    judge.set_defaults(func=cmd_judge)


JUDGE_COMMAND = Command(
    name="judge",
    add=add_judge_command,
    summary="judge a recorded rollout with the judges of a file",
    intro='Its main job is "judge": judge a recorded rollout with the judges of a file, print a\n'
    "verdict table and write every agent run as JSON.",
    # A judges file, a model table or a --require the user wrote wrong: exit 2.
    usage_errors=(PlacementConfigError, HarnessConfigError, ModelConfigError),
    errors=(PlacementError, HarnessError, ModelError),
)
"""``judge``, as placement registers it in the ``vf_sandbox.commands`` entry-point group."""
