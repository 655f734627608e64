"""The tests under tests/ray are marked ``ray``; their cluster is the session-wide
``ray_cluster`` fixture of tests/conftest.py (tests/ray/cluster.py), which tests/security
uses too."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test under tests/ray with ``ray``."""
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.ray)
