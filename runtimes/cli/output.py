"""How ``vf-sandbox`` prints: human tables, or one JSON document with ``--json``.

Every JSON document starts with the same three keys (``command``, ``schema_version``,
``vf_sandbox_version``); the rest is per command and documented in docs/cli.md. Bump
``SCHEMA_VERSION`` when a documented key changes meaning or goes away.

Whatever the command prints besides a command's own output (``exec``'s stdout and stderr,
byte-exact) goes through :func:`terminal_safe`: a sandbox's text (an install's stderr in an
error, a verdict, a sandbox's labels, a check's failure) reaches the terminal with its
control characters escaped, so it cannot move the cursor, clear the screen, set the window
title or overwrite a line of the report.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from runtimes.terminal import terminal_safe

__all__ = [
    "TerminalSafeFormatter",
    "package_version",
    "print_json",
    "print_table",
    "say",
    "shorten",
    "terminal_safe",
    "terminal_safe_logging",
]

SCHEMA_VERSION = 1
DETAIL_WIDTH = 100
ELLIPSIS = "…"


def package_version() -> str:
    """The installed vf-sandbox version, or ``"unknown"`` when run from a bare checkout."""
    try:
        return version("vf-sandbox")
    except PackageNotFoundError:
        return "unknown"


def say(text: str, *, stderr: bool = False, flush: bool = False) -> None:
    """Print one message (``text`` through :func:`terminal_safe`) on stdout or stderr."""
    print(terminal_safe(text), file=sys.stderr if stderr else sys.stdout, flush=flush)


class TerminalSafeFormatter(logging.Formatter):
    """A log formatter whose lines went through :func:`terminal_safe`."""

    def format(self, record: logging.LogRecord) -> str:
        return terminal_safe(super().format(record))


def terminal_safe_logging() -> None:
    """Log records that reach no handler (WARNING and up: Python's last resort) print
    through :class:`TerminalSafeFormatter`: a backend's warning may quote sandbox text."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(TerminalSafeFormatter("%(message)s"))
        handler.setLevel(logging.WARNING)
        root.addHandler(handler)


def shorten(text: str, verbose: bool, width: int = DETAIL_WIDTH) -> str:
    """``text`` whole with ``-v``; otherwise on one line, cut to ``width`` with an ellipsis."""
    if verbose:
        return text
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + ELLIPSIS


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Columns padded to their widest cell, a dashed rule under the headers."""
    cells = [[terminal_safe(str(c)) for c in headers]]
    cells += [[terminal_safe(str(c)) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


def print_json(command: str, body: dict[str, Any]) -> None:
    """One JSON document on stdout: the common header keys, then ``body``."""
    document = {
        "command": command,
        "schema_version": SCHEMA_VERSION,
        "vf_sandbox_version": package_version(),
        **body,
    }
    # ensure_ascii escapes C0, C1 and all non-ASCII; DEL is the one control it keeps
    text = json.dumps(document, indent=2).replace("\x7f", "\\u007f")
    sys.stdout.write(text + "\n")
