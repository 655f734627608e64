"""How ``vf-sandbox`` prints: human tables, or one JSON document with ``--json``.

Every JSON document starts with the same three keys (``command``, ``schema_version``,
``vf_sandbox_version``); the rest is per command and documented in docs/cli.md. Bump
``SCHEMA_VERSION`` when a documented key changes meaning or goes away.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

SCHEMA_VERSION = 1
DETAIL_WIDTH = 100
ELLIPSIS = "…"


def package_version() -> str:
    """The installed vf-sandbox version, or ``"unknown"`` when run from a bare checkout."""
    try:
        return version("vf-sandbox")
    except PackageNotFoundError:
        return "unknown"


def shorten(text: str, verbose: bool, width: int = DETAIL_WIDTH) -> str:
    """``text`` whole with ``-v``; otherwise on one line, cut to ``width`` with an ellipsis."""
    if verbose:
        return text
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + ELLIPSIS


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Columns padded to their widest cell, a dashed rule under the headers."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
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
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")
