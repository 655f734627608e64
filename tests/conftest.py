"""Hooks for the whole suite."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from runtimes import drain_removals_blocking


@pytest.fixture(autouse=True)
def _removals_finish_within_their_test() -> Iterator[None]:
    """Sandboxes a test closed are removed (in the background on Docker) before the next test
    starts, and a removal that failed fails the test that closed the sandbox, not a later one."""
    yield
    drain_removals_blocking()
