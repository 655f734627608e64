"""Fixtures of the placement tests: backends to place judges on, scripted judge models."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from typing import Any

import pytest

from harnesses.base import Trace
from harnesses.llm import ModelTable
from harnesses.scripted import ScriptedEndpoint, ScriptItem

BACKENDS = [
    pytest.param({"type": "subprocess"}, id="subprocess"),
    pytest.param(
        {"type": "docker", "image": "vf-sandbox/base:bookworm"},
        id="docker",
        marks=pytest.mark.docker,
    ),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """A runtime config for the rollout's sandbox (and for clean-room judges)."""
    return dict(request.param)


ModelsFactory = Callable[[Mapping[str, Sequence[ScriptItem]]], ModelTable]


@pytest.fixture
def scripted_models() -> Iterator[ModelsFactory]:
    """``{model name: script}`` -> a model table, one scripted endpoint per model."""
    with ExitStack() as stack:
        servers: list[ScriptedEndpoint] = []

        def factory(scripts: Mapping[str, Sequence[ScriptItem]]) -> ModelTable:
            table = {}
            for name, script in scripts.items():
                server = stack.enter_context(ScriptedEndpoint(script))
                servers.append(server)
                table[name] = server.endpoint()
            return ModelTable(models=table)

        yield factory
        for server in servers:
            assert server.failures == [], server.failures


TASK = {"id": "t-1", "prompt": "Write hello.txt containing 'hello'."}


@pytest.fixture
def policy_trace() -> Trace:
    trace = Trace(harness="bash", model="policy-model")
    return trace.finish("wrote hello.txt")
