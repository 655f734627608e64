"""Shared fixtures of the harness tests: the anyio backend and a scripted endpoint factory."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import pytest

from harnesses.scripted import ScriptedEndpoint, ScriptItem

ScriptedFactory = Callable[..., ScriptedEndpoint]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def scripted() -> Iterator[ScriptedFactory]:
    """Start scripted endpoints for a test; every one is stopped afterwards."""
    started: list[ScriptedEndpoint] = []

    def factory(script: Iterable[ScriptItem] = (), **kwargs: object) -> ScriptedEndpoint:
        server = ScriptedEndpoint(script, **kwargs)  # type: ignore[arg-type]
        server.start()
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
