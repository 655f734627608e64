"""``vf-sandbox shell ID``: an interactive shell inside a sandbox, typically one kept with
``exec --keep`` (or ``keep=True``); and the notice ``exec --keep`` prints on stderr.

The shell is the backend's host command (:meth:`runtimes.Runtime.shell_argv`: ``docker
exec``, ``ssh``, a local shell), run in place of this process (``os.execvp``), so the exit
status is the shell's. Any error finding the sandbox exits 1 with one line on stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from runtimes import RuntimeConfig, SandboxError
from runtimes.locate import shell_argv_for

from .commands import CommandFactory
from .output import TerminalSafeFormatter, say
from .targets import runtime_targets

EXIT_NO_SHELL = 1

SHELL_DESCRIPTION = (
    "Open an interactive shell inside sandbox ID, in its workdir: `docker exec` for Docker,\n"
    "`ssh` for SSH (pass the SSH config as --runtime), a host shell for subprocess; Modal\n"
    "sandboxes are opened with Modal's own `modal shell ID`. ID is what `ls` and `exec --keep`\n"
    "print, or a unique prefix of it. Piped stdin is read as the shell's commands.\n"
    "Exit: the shell's; 1 when the sandbox cannot be found or opened.\n\n"
    "example: vf-sandbox exec --keep --runtime docker -- sh -c 'echo hi > f'\n"
    "         vf-sandbox shell <id printed by the command above>"
)


def add_shell_command(command: CommandFactory) -> None:
    """Register ``shell`` with ``command(name, summary, description)`` (``build_parser``'s)."""
    shell = command("shell", "open an interactive shell inside a sandbox", SHELL_DESCRIPTION)
    shell.add_argument("sandbox", metavar="ID", help="the sandbox's id, or a unique prefix of it")
    shell.add_argument(
        "--runtime",
        action="append",
        help="look only in this backend: type name or JSON config (repeatable; "
        "default: every backend with its default config)",
    )
    shell.set_defaults(func=cmd_shell)


def cmd_shell(args: argparse.Namespace) -> int:
    """Find the sandbox and replace this process by a shell in it.

    Raises:
        SandboxInvalidArgumentError: a malformed ``--runtime`` (a usage error).
    """
    targets = runtime_targets(args.runtime)
    tty = sys.stdin.isatty()
    try:
        argv = anyio.run(lambda: shell_argv_for(args.sandbox, targets, tty=tty))
    except SandboxError as exc:
        say(f"vf-sandbox: shell: {type(exc).__name__}: {exc}", stderr=True)
        return EXIT_NO_SHELL
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        say(f"vf-sandbox: shell: cannot run {argv[0]}: {exc.strerror}", stderr=True)
    return EXIT_NO_SHELL


def keep_config(config: RuntimeConfig, keep: bool) -> RuntimeConfig:
    """``config`` with ``keep`` set when ``exec --keep`` asked for it."""
    return config.model_copy(update={"keep": True}) if keep else config


@contextmanager
def kept_notices() -> Iterator[None]:
    """Print the notice of a kept sandbox (its id, the ``shell`` command) on stderr as
    ``vf-sandbox: kept ...``, whatever logging is configured."""
    logger = logging.getLogger("runtimes.keep")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TerminalSafeFormatter("vf-sandbox: %(message)s"))
    handler.setLevel(logging.WARNING)
    saved = logger.propagate, logger.level
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate, level = saved
        logger.setLevel(level)
