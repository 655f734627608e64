"""The ``vf-sandbox`` command's table, its parser and :func:`main`: the runtime commands,
and first the commands installed packages add (:mod:`runtimes.cli.commands`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from runtimes import SandboxError, SandboxInvalidArgumentError

from .check import add_check_command
from .commands import Command, CommandFactory, installed_commands
from .doctor import add_doctor_command
from .exec import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    Interrupted,
    add_exec_command,
    strip_separator,
)
from .output import package_version, say, terminal_safe_logging
from .rm import add_rm_command
from .sandboxes import add_cleanup_command, add_ls_command
from .shell import add_shell_command

RUNTIME_COMMANDS = (
    ("check", "the conformance suite against any backend", add_check_command),
    ("cleanup", "sweep leaked sandboxes", add_cleanup_command),
    ("ls", "labelled sandboxes of every backend", add_ls_command),
    ("doctor", "which backends work here, and why not", add_doctor_command),
    ("exec", "one command in a fresh sandbox, like a local command", add_exec_command),
    (
        "shell",
        "an interactive shell inside a sandbox (one kept with exec --keep)",
        add_shell_command,
    ),
    ("rm", "remove sandboxes by id (what ls prints)", add_rm_command),
)
"""The package's own commands: name, line in the top help, registration."""

HELP_TAIL = (
    "Reporting commands take --json (one JSON document on stdout) and -v (full details).\n"
    "Exit codes and JSON schemas: docs/cli.md.\n"
)


def description(added: Sequence[Command]) -> str:
    """The top help's text: the added commands' intros, then the list of the others."""
    intros = [c.intro for c in added if c.intro]
    lead = "\n\n".join(intros) + " The other subcommands:" if intros else "The subcommands:"
    listed = [(c.name, c.summary) for c in added if not c.intro]
    listed += [(name, summary) for name, summary, _ in RUNTIME_COMMANDS]
    width = max(len(name) for name, _ in listed)
    lines = "".join(f"  {name.ljust(width)}  {summary}\n" for name, summary in listed)
    return f"The vf-sandbox command.\n\n{lead}\n\n{lines}\n{HELP_TAIL}"


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


def build_parser(added: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    """The parser of every command: ``added`` (default: the installed ones) first, then the
    runtime commands."""
    if added is None:
        added = installed_commands(frozenset(name for name, _, _ in RUNTIME_COMMANDS))
    plain = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="vf-sandbox", description=description(added), formatter_class=plain
    )
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

    factory: CommandFactory = command
    for extra in added:
        extra.add(factory)
    for _, _, add in RUNTIME_COMMANDS:
        add(factory)
    return parser


def report_error(exc: BaseException) -> None:
    say(f"vf-sandbox: {type(exc).__name__}: {exc}", stderr=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns its exit status (table in docs/cli.md).

    vf-sandbox errors and those an added command declares, Ctrl-C and a closed stdout
    become exit statuses with a one-line message, never a traceback; usage errors exit 2
    through argparse (``SystemExit``).
    """
    added = installed_commands(frozenset(name for name, _, _ in RUNTIME_COMMANDS))
    # Errors in what the user typed or wrote in a config file: exit 2, like argparse's own.
    usage_errors: tuple[type[Exception], ...] = (SandboxInvalidArgumentError,)
    command_errors: tuple[type[Exception], ...] = (SandboxError,)
    for extra in added:
        usage_errors += extra.usage_errors
        command_errors += extra.errors
    parser = build_parser(added)
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
    except usage_errors as exc:
        report_error(exc)
        return EXIT_USAGE
    except command_errors as exc:
        report_error(exc)
        return EXIT_ERROR
    return code
