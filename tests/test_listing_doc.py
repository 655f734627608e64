"""README.md's "Listing files" example, run as it stands (the subprocess runtime): what it
prints must be the ``text`` block right after it."""

from __future__ import annotations

from pathlib import Path

from .doc_examples import example, run_example


def test_listing_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    code, expected = example("README.md", "### Listing files")
    assert run_example(code, tmp_path) == expected
