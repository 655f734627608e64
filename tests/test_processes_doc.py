"""README.md's "Background processes" example and docs/processes.md's, run as they stand
(the subprocess runtime): what each prints must be the ``text`` block right after it."""

from __future__ import annotations

from pathlib import Path

from .doc_examples import example, run_example


def test_background_example_prints_what_the_readme_shows(tmp_path: Path) -> None:
    code, expected = example("README.md", "### Background processes")
    assert run_example(code, tmp_path) == expected


def test_the_processes_page_example_prints_what_it_shows(tmp_path: Path) -> None:
    code, expected = example("docs/processes.md")
    assert run_example(code, tmp_path) == expected
