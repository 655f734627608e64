"""Examples in README.md and docs/, run as they stand.

A page shows an example as a ``python`` block followed by the ``text`` block it prints; these
helpers find that pair under a heading and run the code as a script in a fresh interpreter.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_PAIR = re.compile(r"^```python\n(.*?)^```\n\n```text\n(.*?)^```$", re.S | re.M)


def example(page: str, heading: str | None = None) -> tuple[str, str]:
    """The first ``python`` block of ``page`` (a path from the repository's root) after the
    line that starts with ``heading`` (``"### Listing files"``; the top of the page when
    ``None``), and the ``text`` block right after it."""
    text = (REPO / page).read_text()
    start = 0
    if heading is not None:
        found = re.search(rf"^{re.escape(heading)}", text, re.M)
        assert found, f"{page} lost its section {heading!r}"
        start = found.end()
    match = _PAIR.search(text, start)
    assert match, f"{page} {heading or ''}: no python block followed by its text output"
    return match.group(1), match.group(2)


def run_example(code: str, cwd: Path, *, timeout: float = 120) -> str:
    """Run ``code`` as a script in ``cwd`` with this interpreter; it must exit 0. Its stdout."""
    script = cwd / "example.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
