"""README.md's "Background processes" example and docs/processes.md's, run as they stand.

The ``python`` block is read from the page at test time and run as a script (the subprocess
runtime); what it prints must be the ``text`` block right after it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _section() -> tuple[str, str]:
    text = README.read_text()
    section = text.split("### Background processes\n", 1)[1].split("\n#", 1)[0]
    match = re.search(r"^```python\n(.*?)^```\n\n```text\n(.*?)^```$", section, re.S | re.M)
    assert match, "the Background processes section lost its python block and its output"
    return match.group(1), match.group(2)


def test_background_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    code, expected = _section()
    script = tmp_path / "background.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected


DOC = Path(__file__).resolve().parent.parent / "docs" / "processes.md"


def test_the_processes_page_example_prints_what_it_shows(tmp_path: Path) -> None:
    match = re.search(r"^```python\n(.*?)^```\n\n```text\n(.*?)^```$", DOC.read_text(), re.S | re.M)
    assert match, "docs/processes.md lost its python block and its output"
    script = tmp_path / "spawn.py"
    script.write_text(match.group(1))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == match.group(2)
