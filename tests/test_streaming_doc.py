"""docs/streaming.md's examples, run as they stand.

Every ``python`` block of the page is read at test time and run as a script on the subprocess
runtime (the config the examples use); what it prints must be the ``text`` block that follows
it on the page, so the page and the behaviour it shows cannot drift apart.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "streaming.md"

_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


@dataclass(frozen=True)
class _Example:
    heading: str
    code: str
    output: str | None


def _examples() -> list[_Example]:
    """The page's python blocks, each with the section it is in and the text block right
    after it (``None`` if the next block is not a text block)."""
    text = DOC.read_text()
    blocks = list(_BLOCK.finditer(text))
    examples = []
    for index, block in enumerate(blocks):
        if block.group(1) != "python":
            continue
        headings = re.findall(r"^#+ (.*)$", text[: block.start()], re.M)
        output = None
        if index + 1 < len(blocks):
            following = blocks[index + 1]
            adjacent = not text[block.end() : following.start()].strip()
            output = following.group(2) if adjacent and following.group(1) == "text" else None
        examples.append(_Example(headings[-1], block.group(2), output))
    return examples


EXAMPLES = _examples()


def test_the_page_has_its_examples() -> None:
    """Watching output, constant memory, interactive stdin and the iterator on top."""
    assert len(EXAMPLES) == 4, [e.heading for e in EXAMPLES]
    assert all(e.output is not None for e in EXAMPLES), "an example shows no output"
    assert any("stdin=answers()" in e.code for e in EXAMPLES)
    assert any("keep_output=False" in e.code for e in EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.heading for e in EXAMPLES])
def test_example_prints_what_the_page_shows(example: _Example, tmp_path: Path) -> None:
    assert re.search(r'open_runtime\(\{"type": "subprocess"\}\)', example.code), "config changed"
    script = tmp_path / "example.py"
    script.write_text(example.code)
    scratch = tmp_path / "tmp"  # the runtime's default root lives under $TMPDIR
    scratch.mkdir()
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == example.output, result.stdout
    assert os.listdir(scratch / "vf-sandbox") == []  # the sandbox's directory is gone
