"""``python -m placement.cli``: the ``vf-sandbox`` command, with the ``judge`` command
placement adds to the runtime commands.

The command table, the runtime commands and :func:`main` live in :mod:`runtimes.cli`;
placement registers :data:`~placement.cli_judge.JUDGE_COMMAND` through the
``vf_sandbox.commands`` entry-point group (pyproject.toml). Exit codes and JSON schemas:
docs/cli.md.
"""

from __future__ import annotations

import sys

from runtimes.cli import build_parser, main

from .cli_judge import JUDGE_COMMAND, cmd_judge, print_judge_report

__all__ = ["JUDGE_COMMAND", "build_parser", "cmd_judge", "main", "print_judge_report"]

if __name__ == "__main__":
    sys.exit(main())
