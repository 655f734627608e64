"""The ``vf-sandbox`` command (``python -m runtimes.cli``): the runtime commands, one
module each, and the commands installed packages add.

* :mod:`.app` -- the command table, the parser, :func:`main` and its exit statuses;
* :mod:`.commands` -- :class:`Command`, what the ``vf_sandbox.commands`` entry-point group
  registers (``placement`` adds ``judge``);
* :mod:`.check`, :mod:`.sandboxes` (``ls``, ``cleanup``), :mod:`.doctor`, :mod:`.exec`,
  :mod:`.shell`, :mod:`.rm` -- the runtime commands;
* :mod:`.targets` -- ``--runtime`` values; :mod:`.output` -- tables, ``--json`` documents
  and terminal-safe messages.

Exit codes and JSON schemas: docs/cli.md.
"""

from __future__ import annotations

from .app import build_parser, main
from .commands import COMMAND_GROUP, Command, CommandFactory
from .exec import EXIT_ERROR, EXIT_USAGE, Interrupted, run_interruptible
from .targets import parse_runtime, parse_runtime_target, runtime_targets

__all__ = [
    "COMMAND_GROUP",
    "EXIT_ERROR",
    "EXIT_USAGE",
    "Command",
    "CommandFactory",
    "Interrupted",
    "build_parser",
    "main",
    "parse_runtime",
    "parse_runtime_target",
    "run_interruptible",
    "runtime_targets",
]
