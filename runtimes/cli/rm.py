"""``vf-sandbox rm ID...``: remove sandboxes by id, as ``ls`` prints them.

Each ID (or a unique prefix of one) is looked up among the labelled sandboxes of the
``--runtime`` backends (default: every backend with its default config), like ``shell``
does, and removed with its backend's ``destroy_sandbox``, whatever its session or ``keep``
label: naming it is the decision. Every ID is tried; the exit is 1 when any was not found,
was ambiguous or could not be removed (one line each on stderr), 0 otherwise.
"""

from __future__ import annotations

import argparse
from functools import partial

import anyio

from runtimes import RuntimeConfig, SandboxError
from runtimes.locate import find_sandbox

from .commands import CommandFactory
from .exec import run_interruptible
from .output import say
from .targets import runtime_targets

EXIT_NOT_REMOVED = 1

RM_DESCRIPTION = (
    "Remove sandboxes by id: what `vf-sandbox ls` and `exec --keep` print, or a unique prefix\n"
    "of it. Kept sandboxes and those of live sessions are removed too: naming one is the\n"
    "decision. Exit 1 when an ID was not found, was ambiguous or could not be removed.\n\n"
    "example: vf-sandbox rm 07bf96 --runtime docker"
)


def add_rm_command(command: CommandFactory) -> None:
    """Register ``rm`` with ``command(name, summary, description)`` (``build_parser``'s)."""
    rm = command("rm", "remove sandboxes by id", RM_DESCRIPTION)
    rm.add_argument("sandboxes", nargs="+", metavar="ID", help="a sandbox id, or a unique prefix")
    rm.add_argument(
        "--runtime",
        action="append",
        help="look only in this backend: type name or JSON config (repeatable; "
        "default: every backend with its default config)",
    )
    rm.set_defaults(func=cmd_rm)


async def remove_sandbox(sandbox_id: str, targets: list[RuntimeConfig | str] | None) -> str:
    """Find and remove one sandbox; returns ``"BACKEND ID"`` of what was removed.

    Raises:
        SandboxUnavailableError: no such sandbox on the searched backends.
        SandboxInvalidArgumentError: an empty id, or a prefix of several sandboxes' ids.
        SandboxError: the backend could not remove it.
    """
    cls, config, info = await find_sandbox(sandbox_id, targets)
    await cls.destroy_sandbox(info, config)
    return f"{info.backend} {info.id}"


def cmd_rm(args: argparse.Namespace) -> int:
    """Remove each ID; report each on stdout (removed) or stderr (not).

    Raises:
        SandboxInvalidArgumentError: a malformed ``--runtime`` (a usage error).
        Interrupted: Ctrl-C.
    """
    targets = runtime_targets(args.runtime)
    code = 0
    for sandbox_id in args.sandboxes:
        try:
            removed = anyio.run(run_interruptible, partial(remove_sandbox, sandbox_id, targets))
        except SandboxError as exc:
            say(f"vf-sandbox: rm: {type(exc).__name__}: {exc}", stderr=True)
            code = EXIT_NOT_REMOVED
            continue
        say(f"removed {removed}")
    return code
