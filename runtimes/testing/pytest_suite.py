"""The conformance suite as a pytest base class.

Subclass :class:`RuntimeConformance` in a test module and either set ``config`` (a
dict, a type name or a config model) or override the ``runtime_config`` fixture when
the config depends on other fixtures (a container started by testcontainers, say).
``anyio_backends`` lists the event loops every check runs under.
"""

from __future__ import annotations

from typing import ClassVar

import anyio
import pytest

from . import CHECKS, Check, CheckSkipped, ConfigLike, run_check


class RuntimeConformance:
    """Every conformance check, as one test each, against ``runtime_config``."""

    config: ClassVar[ConfigLike | None] = None
    anyio_backends: ClassVar[tuple[str, ...]] = ("asyncio",)

    @pytest.fixture
    def runtime_config(self) -> ConfigLike:
        if self.config is None:
            pytest.fail(f"{type(self).__name__} sets neither `config` nor a runtime_config fixture")
        return self.config

    @pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
    def test_conformance(self, check: Check, runtime_config: ConfigLike) -> None:
        for backend in self.anyio_backends:
            try:
                anyio.run(run_check, check, runtime_config, backend=backend)
            except CheckSkipped as exc:
                pytest.skip(str(exc))
