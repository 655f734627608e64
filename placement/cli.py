"""The vf-sandbox command.

Its main job is "judge": judge a recorded rollout with the judges of a file, print a
verdict table and write every agent run as JSON. The other subcommands:

  check    the conformance suite against any backend
  cleanup  sweep leaked sandboxes
  ls       labelled sandboxes of every backend
  doctor   which backends work here, and why not
  exec     one command in a fresh sandbox, like a local command
  shell    an interactive shell inside a sandbox (one kept with exec --keep)
  rm       remove sandboxes by id (what ls prints)

Reporting commands take --json (one JSON document on stdout) and -v (full details).
Exit codes and JSON schemas: docs/cli.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from harnesses.errors import HarnessConfigError, HarnessError, ModelConfigError, ModelError
from runtimes import (
    RuntimeConfig,
    RuntimeConfigError,
    SandboxError,
    SandboxInfo,
    SandboxInvalidArgumentError,
    available_runtimes,
    resolve_runtime_config,
)
from runtimes.cleanup import (
    NOT_LISTABLE,
    SweepResult,
    cleanup_sandboxes,
    list_target,
    snapshot_info,
)

from .cli_check import check_runtime, known_check, print_check_list
from .cli_doctor import probe_all, target_name
from .cli_exec import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Interrupted,
    parse_env,
    parse_size,
    run_exec,
    run_interruptible,
    strip_separator,
    with_image,
)
from .cli_judge import cmd_judge, require_argument
from .cli_judge import print_judge_report as print_judge_report
from .cli_output import (
    package_version,
    print_json,
    print_table,
    say,
    shorten,
    terminal_safe_logging,
)
from .cli_rm import add_rm_command
from .cli_shell import add_shell_command, keep_config, kept_notices
from .errors import PlacementConfigError, PlacementError

# Errors in what the user typed or wrote in a config file: exit 2, like argparse's own.
USAGE_ERRORS = (
    SandboxInvalidArgumentError,
    PlacementConfigError,
    HarnessConfigError,
    ModelConfigError,
)
COMMAND_ERRORS = (SandboxError, PlacementError, HarnessError, ModelError)


def parse_runtime_target(text: str) -> str | dict[str, Any]:
    """A runtime given on the command line, unvalidated: a bare type name or a JSON object.

    Raises:
        RuntimeConfigError: the text starts like JSON but is not a JSON object.
    """
    stripped = text.strip()
    if not stripped.startswith("{"):
        return stripped
    try:
        data: dict[str, Any] = json.loads(stripped)  # starts with "{": an object or invalid
    except json.JSONDecodeError as exc:
        raise RuntimeConfigError(f"--runtime is not valid JSON: {exc}") from None
    return data


def parse_runtime(text: str) -> RuntimeConfig:
    """A runtime given on the command line, validated.

    Raises:
        RuntimeConfigError, UnknownRuntimeError, RuntimePluginError: as
            :func:`runtimes.resolve_runtime_config`.
    """
    return resolve_runtime_config(parse_runtime_target(text))


# ---------------------------------------------------------------------- check


def cmd_check(args: argparse.Namespace) -> int:
    if args.list:
        return print_check_list(args)
    return check_runtime(args, parse_runtime(args.runtime))


# ---------------------------------------------------------------------- cleanup / ls


def _targets(runtimes: list[str] | None) -> list[RuntimeConfig | str] | None:
    if not runtimes:
        return None
    return [
        r if isinstance(r, str) else resolve_runtime_config(r)
        for r in map(parse_runtime_target, runtimes)
    ]


def cmd_cleanup(args: argparse.Namespace) -> int:
    results = anyio.run(
        run_interruptible,
        lambda: cleanup_sandboxes(
            _targets(args.runtime),
            all_sessions=args.all,
            older_than=args.older_than,
            dry_run=args.dry_run,
            kept=args.kept,
        ),
    )
    counts = {
        action: sum(r.action == action for r in results)
        for action in ("removed", "would remove", "failed", "kept")
    }
    if args.json:
        rows = {
            kind: [
                {"backend": r.info.backend, "id": r.info.id, "action": r.action, "reason": r.reason}
                for r in results
                if r.kind == kind
            ]
            for kind in ("sandbox", "snapshot")
        }
        summary = {key.replace(" ", "_"): n for key, n in counts.items()}
        document = {"dry_run": args.dry_run, "results": rows["sandbox"], "summary": summary}
        print_json("cleanup", {**document, "snapshots": rows["snapshot"]})
    else:
        print_table(
            ["backend", "sandbox", "action", "reason"],
            [
                (r.info.backend, _shown_id(r), r.action, shorten(r.reason, args.verbose))
                for r in results
            ],
        )
        print("\n" + ", ".join(f"{n} {action}" for action, n in counts.items()))
    return 1 if counts["failed"] else 0


def _shown_id(result: SweepResult) -> str:
    return f"snapshot {result.info.id}" if result.kind == "snapshot" else result.info.id


def _listed(info: SandboxInfo) -> dict[str, Any]:
    from runtimes import ownership

    dead = ownership.session_is_dead(info.labels)
    return {
        "backend": info.backend,
        "id": info.id,
        "state": info.state,
        "created": info.created,
        "session": {True: "dead", False: "alive", None: "unknown"}[dead],
        "kept": ownership.is_kept(info.labels),
        "labels": dict(info.labels),
    }


async def list_labelled(
    targets: list[RuntimeConfig | str],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, str]]]:
    """Every labelled sandbox of ``targets``, their snapshots (with ``source`` and
    ``holds``), and the backends that could not be listed."""
    found: list[dict[str, Any]] = []
    snapshots: list[dict[str, Any]] = []
    unlisted: list[dict[str, str]] = []
    for target in targets:
        name = target if isinstance(target, str) else target.type
        try:
            cls, config, infos = await list_target(target)
        except SandboxError as exc:
            reason = str(exc) if str(exc) == NOT_LISTABLE else f"{type(exc).__name__}: {exc}"
            say(f"{name}: not listed ({reason})", stderr=True)
            unlisted.append({"backend": name, "error": reason})
            continue
        found += [_listed(info) for info in infos]
        try:
            taken = await cls.list_snapshots(config)
        except SandboxError as exc:
            say(f"{name}: snapshots not listed ({type(exc).__name__}: {exc})", stderr=True)
            continue
        for snap in taken:
            snapshots.append(
                {**_listed(snapshot_info(snap)), "source": snap.source, "holds": snap.holds}
            )
    return found, snapshots, unlisted


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def cmd_ls(args: argparse.Namespace) -> int:
    targets = _targets(args.runtime) or list(available_runtimes())
    found, snapshots, unlisted = anyio.run(run_interruptible, lambda: list_labelled(targets))
    if args.json:
        print_json("ls", {"sandboxes": found, "snapshots": snapshots, "unlisted": unlisted})
        return 0
    headers = ["backend", "sandbox", "state", "created", "session", "kept"]
    rows = [
        [s["backend"], s["id"], s["state"], s["created"] or "", s["session"], _yes(s["kept"])]
        for s in found
    ]
    if args.verbose:
        headers.append("labels")
        for row, s in zip(rows, found, strict=True):
            row.append(",".join(f"{k}={v}" for k, v in sorted(s["labels"].items())))
    print_table(headers, rows)
    if snapshots:
        print("\nsnapshots:")
        print_table(
            ["backend", "snapshot", "holds", "of sandbox", "created", "session", "kept"],
            [
                [
                    s["backend"],
                    s["id"],
                    s["holds"],
                    s["source"],
                    s["created"] or "",
                    s["session"],
                    _yes(s["kept"]),
                ]
                for s in snapshots
            ],
        )
    return 0


# ---------------------------------------------------------------------- doctor


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


# ---------------------------------------------------------------------- exec


def cmd_exec(args: argparse.Namespace) -> int:
    with kept_notices():
        config = with_image(parse_runtime(args.runtime), args.image)
        return run_exec(keep_config(config, args.keep), args)


# ---------------------------------------------------------------------- judge


# cmd_judge and print_judge_report: placement/cli_judge.py


# ---------------------------------------------------------------------- main


def reporting_options() -> argparse.ArgumentParser:
    """``--json`` and ``-v``, shared by every listing and reporting command."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--json", action="store_true", help="print one JSON document on stdout (see docs/cli.md)"
    )
    parent.add_argument(
        "-v", "--verbose", action="store_true", help="show details in full, never cut"
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    plain = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="vf-sandbox", description=__doc__, formatter_class=plain)
    parser.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {package_version()}",
        help="print the installed vf-sandbox version and exit",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="one of the commands below"
    )
    report = [reporting_options()]

    def command(
        name: str, summary: str, description: str = "", reporting: bool = False
    ) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=summary,
            description=description or summary,
            formatter_class=plain,
            parents=report if reporting else [],
        )

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

    cleanup = command("cleanup", "remove sandboxes whose session is dead", reporting=True)
    cleanup.add_argument(
        "--runtime",
        action="append",
        help="type name or JSON config (repeatable; default: every backend)",
    )
    cleanup.add_argument(
        "--all", action="store_true", help="remove every labelled sandbox, live sessions too"
    )
    cleanup.add_argument(
        "--older-than",
        type=float,
        metavar="SECONDS",
        help="also remove sandboxes created more than SECONDS ago",
    )
    cleanup.add_argument(
        "--dry-run", action="store_true", help="report what would be removed, remove nothing"
    )
    cleanup.add_argument(
        "--kept", action="store_true", help="also remove sandboxes kept with keep=True/--keep"
    )
    cleanup.set_defaults(func=cmd_cleanup)

    ls = command("ls", "list labelled sandboxes of every backend", reporting=True)
    ls.add_argument(
        "--runtime",
        action="append",
        help="type name or JSON config (repeatable; default: every backend)",
    )
    ls.set_defaults(func=cmd_ls)

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

    exec_ = command(
        "exec",
        "run one command in a fresh sandbox",
        "Run ARGV in a fresh sandbox, then remove it. Piped stdin is forwarded, output is\n"
        "streamed as it comes. Exit: the command's code; 124 timeout, 126 not executable,\n"
        "127 not found, 130 Ctrl-C, 2 usage, 1 other errors.\n\n"
        "example: vf-sandbox exec --env A=1 -- sh -c 'echo $A'",
    )
    exec_.add_argument(
        "--runtime",
        default="subprocess",
        help="a type name or a JSON config (default: %(default)s)",
    )
    exec_.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="kill the command's process tree after SECONDS (exit 124)",
    )
    exec_.add_argument(
        "--env",
        action="append",
        type=parse_env,
        metavar="NAME=VALUE",
        help="set a variable for the command (repeatable)",
    )
    exec_.add_argument(
        "--cwd", help="working directory: absolute, or relative to the sandbox workdir"
    )
    exec_.add_argument("--user", help="run as this user inside the sandbox")
    exec_.add_argument(
        "--image",
        help="run in this image: sets the image of the --runtime config (docker, modal)",
    )
    exec_.add_argument(
        "--output-limit",
        type=parse_size,
        metavar="SIZE",
        help="kill the command once stdout + stderr pass SIZE (bytes, or 64KiB, 1GiB...; "
        "default: no cap, the output is streamed, not kept; exit 1)",
    )
    exec_.add_argument(
        "--keep",
        action="store_true",
        help="keep the sandbox running afterwards (its id and `vf-sandbox shell` on stderr)",
    )
    exec_.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- ARGV",
        help="the command and its arguments, after the first --",
    )
    exec_.set_defaults(func=cmd_exec)
    add_shell_command(command)
    add_rm_command(command)
    return parser


def report_error(exc: BaseException) -> None:
    say(f"vf-sandbox: {type(exc).__name__}: {exc}", stderr=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (table in docs/cli.md).

    vf-sandbox, placement, harness and model errors, Ctrl-C and a closed stdout become
    exit statuses with a one-line message, never a traceback; usage errors exit 2 through
    argparse (``SystemExit``).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    # paramiko logs a failed handshake's traceback from its own thread; the SSH backend
    # already turns it into a typed one-line error.
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    terminal_safe_logging()
    if args.command == "exec":
        args.argv = strip_separator(args.argv)
        if not args.argv:
            parser.error(
                "exec: no command given (argv is empty): vf-sandbox exec [OPTIONS] -- ARGV..."
            )
    try:
        code: int = args.func(args)
    except (Interrupted, KeyboardInterrupt):
        say("vf-sandbox: interrupted", stderr=True)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): stay quiet, like a local command killed by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except USAGE_ERRORS as exc:
        report_error(exc)
        return EXIT_USAGE
    except COMMAND_ERRORS as exc:
        report_error(exc)
        return EXIT_ERROR
    return code


if __name__ == "__main__":
    sys.exit(main())
