"""Fixtures shared by the Modal tests (here and in ``tests/conformance``): a fake Modal service
on the local Docker engine, injected into ``runtimes.modal`` (see ``fake_modal.py``)."""

from __future__ import annotations

import contextlib
import datetime
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from .fake_modal import FAKE_LABEL, STAND_IN_IMAGE, FakeModalService, install


def docker_unavailable_reason() -> str | None:
    """Why the fake cannot run here (no engine, no base image), or ``None``."""
    try:
        client = docker.from_env()
        client.ping()
        client.images.get(STAND_IN_IMAGE)
    except docker.errors.ImageNotFound:
        return f"the fake Modal service needs the image {STAND_IN_IMAGE} (make images)"
    except Exception as exc:  # noqa: BLE001 - any failure to reach the engine means "no Docker"
        return f"the fake Modal service needs a Docker engine: {exc}"
    return None


def fake_config(**overrides: Any) -> dict[str, Any]:
    """A Modal runtime config for the fake service (the image exists locally)."""
    return {"type": "modal", "image": STAND_IN_IMAGE, "app_name": "vf-sandbox-tests", **overrides}


_swept = False


def _sweep_stale_fake_containers() -> None:
    """Remove fake sandboxes a killed test run left behind (stopped, or over an hour old)."""
    global _swept
    if _swept:
        return
    _swept = True
    client = docker.from_env()
    cutoff = time.time() - 3600
    for container in client.containers.list(all=True, filters={"label": FAKE_LABEL}):
        created = container.attrs.get("Created", "")
        started = datetime.datetime.fromisoformat(created[:19]).replace(tzinfo=datetime.UTC)
        if container.status != "running" or started.timestamp() < cutoff:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)


@pytest.fixture
def fake_service(tmp_path: Path) -> Iterator[FakeModalService]:
    reason = docker_unavailable_reason()
    if reason:
        pytest.fail(f"the fake Modal service runs on Docker: {reason} (`make test` starts it)")
    _sweep_stale_fake_containers()
    service = FakeModalService(tmp_path / "fake-modal-state")
    try:
        yield service
    finally:
        service.close()


@pytest.fixture
def fake_modal(fake_service: FakeModalService, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The fake ``modal`` module, installed as the SDK ``runtimes.modal`` uses."""
    return install(fake_service, monkeypatch)
