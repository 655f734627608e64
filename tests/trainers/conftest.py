"""Fixtures of the trainer-integration tests: backends, the tiny model and tokenizer.

The tests here need the extras ``[trl]`` and ``[openenv]`` (``make test`` installs them,
``torch==2.13.0`` pinned to the CPU build). Everything runs on the CPU.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from . import tiny_model

# One intra-op thread: the model is tiny, and on a loaded 2-core machine OpenMP's spinning
# threads made a 0.03 s forward-backward take up to 2 s (measured while Docker and a second
# process ran). One thread runs it in 0.02-0.04 s whatever else runs.
torch.set_num_threads(1)

PYTHON_IMAGE = "vf-sandbox/python:latest"
SUBPROCESS = {"type": "subprocess"}
DOCKER = {"type": "docker", "image": PYTHON_IMAGE}

BACKENDS = [
    pytest.param(SUBPROCESS, id="subprocess"),
    pytest.param(DOCKER, id="docker", marks=pytest.mark.docker),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(request.param)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir: Path) -> Any:
    return tiny_model.build_tokenizer(tiny_dir)


_PRIMED: dict[str, Any] = {}


@pytest.fixture(scope="session")
def primed_model(tiny_tokenizer: Any) -> Callable[..., Any]:
    """``primed_model(*prompts)``: a fresh copy of the tiny model primed to answer each of
    ``prompts`` (ids from :func:`tiny_model.prompt_ids`: the exact first prompt a path
    renders) with ``bash`` tool calls (``echo N > answer.txt``). Cached per prompt set."""

    def make(*prompts: Sequence[int]) -> Any:
        key = json.dumps([list(p) for p in prompts])
        if key not in _PRIMED:
            model = tiny_model.build_model(tiny_tokenizer)
            tiny_model.prime(model, tiny_tokenizer, prompts)
            _PRIMED[key] = model
        return copy.deepcopy(_PRIMED[key])

    return make
