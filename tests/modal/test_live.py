"""The Modal runtime against REAL Modal: conformance, SDK scenarios and leak guarantees.

These tests run only when ``MODAL_TOKEN_ID`` (and ``MODAL_TOKEN_SECRET``) are set. Modal's
service cannot be reached from the machines this project's CI runs on, so there they are
skipped with that reason; the skip hides nothing that could run locally: every check here also
runs against the fake SDK (``fake_modal.py``: ``tests/conformance/test_modal_fake.py``,
``test_fake_fidelity.py``, ``test_modal_runtime.py``). What only these tests can catch are the
places where the fake differs from the service; ``docs/modal.md`` lists each one and which test
here covers it.

Run: ``MODAL_TOKEN_ID=... MODAL_TOKEN_SECRET=... pytest -m modal_live tests/modal/test_live.py``.
Cost: one sandbox per check (about 80 short-lived sandboxes); ``VF_MODAL_TEST_IMAGE`` picks the
image (default ``python:3.11-slim``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import (
    ExecRequest,
    ExecTimeoutError,
    OutputSink,
    SandboxUnavailableError,
    open_runtime,
    ownership,
)
from runtimes.modal import ModalRuntime
from runtimes.testing import RuntimeConformance

from .sdk_scenarios import SCENARIO_APP, SCENARIOS

pytestmark = [
    pytest.mark.modal_live,
    pytest.mark.skipif(
        not os.environ.get("MODAL_TOKEN_ID"),
        reason="needs Modal credentials (MODAL_TOKEN_ID, MODAL_TOKEN_SECRET): Modal's service "
        "cannot be reached from here; the fake-SDK tests cover the same checks",
    ),
]

IMAGE = os.environ.get("VF_MODAL_TEST_IMAGE", "python:3.11-slim")
LIVE_CONFIG: dict[str, Any] = {
    "type": "modal",
    "image": IMAGE,
    "app_name": SCENARIO_APP,
    "timeout": 1200,
    "idle_timeout": 600,
}
REPO = Path(__file__).resolve().parents[2]


class TestModalLiveConformance(RuntimeConformance):
    config = LIVE_CONFIG
    anyio_backends = ("asyncio", "trio")


def _real_modal() -> types.ModuleType:
    import modal

    return modal


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_sdk_scenario_on_real_modal(name: str) -> None:
    modal = _real_modal()

    @asynccontextmanager
    async def open_sandbox(**kwargs: Any) -> AsyncIterator[Any]:
        app = await modal.App.lookup.aio(SCENARIO_APP, create_if_missing=True)
        image = modal.Image.from_registry(IMAGE)
        sandbox = await modal.Sandbox.create.aio(app=app, image=image, timeout=600, **kwargs)
        try:
            yield sandbox
        finally:
            await sandbox.terminate.aio()

    anyio.run(SCENARIOS[name], modal, open_sandbox)


def test_live_terminated_sandbox_is_unavailable_not_missing() -> None:
    async def body() -> None:
        async with open_runtime(LIVE_CONFIG) as rt:
            await rt.write("kept.txt", b"kept")
            handle = await _real_modal().Sandbox.from_id.aio(rt.sandbox_id)
            await handle.terminate.aio()
            await handle.wait.aio(raise_on_termination=False)
            assert not await rt.alive()
            for call in (rt.exec(["true"]), rt.read("kept.txt"), rt.exists("kept.txt")):
                with pytest.raises(SandboxUnavailableError):
                    await call

    anyio.run(body)


def test_live_sdk_exec_timeout_is_exec_timeout_and_kills_the_tree() -> None:
    token = "777.123456"

    async def body() -> str:
        async with open_runtime(LIVE_CONFIG) as rt:
            assert isinstance(rt, ModalRuntime)
            request = ExecRequest(
                argv=("sh", "-c", f"echo started; sleep {token} & sleep {token}; wait"),
                cwd=rt.workdir,
                env={},
                stdin=None,
                user=None,
                timeout=1.0,
                output_limit=1 << 20,
            )
            with pytest.raises(ExecTimeoutError) as info:
                await rt._exec(request, OutputSink(1 << 20))
            assert info.value.stdout_bytes == b"started\n"
            await anyio.sleep(1)
            return (await rt.exec(["ps", "-eo", "args"])).stdout

    assert token not in anyio.run(body)


def test_live_tagged_sandboxes_are_listed_and_destroyed() -> None:
    async def body() -> None:
        async with open_runtime(LIVE_CONFIG) as rt:
            config = rt.config
            found = {i.id: i for i in await ModalRuntime.list_sandboxes(config)}
            assert rt.sandbox_id in found
            info = found[rt.sandbox_id]
            assert info.labels[ownership.CREATOR] == ownership.CREATOR_ID
            assert info.labels[ownership.BACKEND] == "modal"
            await ModalRuntime.destroy_sandbox(info, config)
            handle = await _real_modal().Sandbox.from_id.aio(rt.sandbox_id)
            with anyio.fail_after(60):
                await handle.wait.aio(raise_on_termination=False)
            assert not await rt.alive()

    anyio.run(body)


def test_live_atexit_backstop_terminates_a_sandbox_left_open() -> None:
    child = subprocess.run(
        [sys.executable, "-m", "tests.modal.child_session", "live", "exit"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    sandbox_id = child.stdout.strip().splitlines()[0]

    async def body() -> int | None:
        handle = await _real_modal().Sandbox.from_id.aio(sandbox_id)
        with anyio.fail_after(60):
            await handle.wait.aio(raise_on_termination=False)
        return handle.returncode

    assert anyio.run(body) is not None, f"{sandbox_id} still runs after its session exited"
