"""The fake Modal SDK behaves as the installed SDK documents (so its verdicts can be trusted).

The scenarios live in ``sdk_scenarios.py`` and run unchanged against real Modal in
``test_live.py``. Several hold because the fake runs the SDK's own code (argv cap, stdin
buffer cap, ``wait() == -1``, filesystem error parsing); these tests keep it that way across
SDK upgrades. The rest check the fake's stand-ins (Docker for the worker, ``fake_fs_tools.py``
for the filesystem tool) against what the SDK's docstrings say.
"""

from __future__ import annotations

import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import modal.exception as modal_exc
import pytest

from .sdk_scenarios import SCENARIO_APP, SCENARIOS

pytestmark = pytest.mark.docker


def _opener(modal: types.ModuleType) -> Any:
    @asynccontextmanager
    async def open_sandbox(**kwargs: Any) -> AsyncIterator[Any]:
        app = await modal.App.lookup.aio(SCENARIO_APP, create_if_missing=True)
        sandbox = await modal.Sandbox.create.aio(app=app, **kwargs)
        try:
            yield sandbox
        finally:
            await sandbox.terminate.aio()

    return open_sandbox


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_sdk_scenario_on_the_fake(name: str, fake_modal: types.ModuleType) -> None:
    anyio.run(SCENARIOS[name], fake_modal, _opener(fake_modal))


def test_create_validates_like_the_sdk(fake_modal: types.ModuleType) -> None:
    async def body() -> None:
        app = await fake_modal.App.lookup.aio(SCENARIO_APP, create_if_missing=True)
        with pytest.raises(modal_exc.InvalidError, match="block_network"):
            await fake_modal.Sandbox.create.aio(
                app=app, block_network=True, outbound_cidr_allowlist=["10.0.0.0/8"]
            )
        with pytest.raises(modal_exc.InvalidError, match="App"):
            await fake_modal.Sandbox.create.aio()
        with pytest.raises(TypeError):
            await fake_modal.Sandbox.create.aio(app=app, no_such_option=1)
        with pytest.raises(modal_exc.NotFoundError):
            await fake_modal.App.lookup.aio("no-such-app")
        with pytest.raises(modal_exc.NotFoundError):
            await fake_modal.Sandbox.from_id.aio("sb-does-not-exist")

    anyio.run(body)
