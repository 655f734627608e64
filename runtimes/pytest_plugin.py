"""pytest fixtures for users' own environment tests (registered through ``pytest11``).

``sandbox_factory`` opens runtimes from any config and closes them after the test::

    def test_my_env(sandbox_factory):
        async def body():
            async with sandbox_factory({"type": "subprocess"}) as rt:
                assert (await rt.exec(["true"])).ok
        anyio.run(body)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from .base import Runtime
from .config import RuntimeConfig
from .registry import open_runtime

RuntimeFactory = Callable[[RuntimeConfig | Mapping[str, Any] | str], Runtime]


@pytest.fixture
def sandbox_factory() -> Iterator[RuntimeFactory]:
    """A function that returns an unstarted runtime; use it with ``async with``."""
    made: list[Runtime] = []

    def factory(config: RuntimeConfig | Mapping[str, Any] | str) -> Runtime:
        runtime = open_runtime(config)
        made.append(runtime)
        return runtime

    yield factory
    leaked = [rt.describe() for rt in made if not rt.closed and rt._state != "new"]
    assert not leaked, f"runtimes left open by the test: {leaked}"
