"""Fixtures of the pool tests: a counting wrapper around a backend's ``_start``.

``Starts`` replaces ``SomeRuntime._start`` with a wrapper that counts calls and creations in
flight (and their maximum), can hold every creation at a gate, or make it fail, and keeps
the runtimes it started: the tests read the pool's behaviour from what the backend saw,
never from timing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import anyio
import pytest

from runtimes.base import Runtime
from runtimes.pool import POOL
from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, require_docker_image
from tests.modal.support import fake_modal, fake_service  # noqa: F401 - fixtures


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Starts:
    """What a backend's ``_start`` was asked to do, and a way to hold or break it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type[Runtime]) -> None:
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.started: list[Runtime] = []
        self.by_workdir: dict[str, Runtime] = {}
        self.failure: Callable[[], BaseException] | None = None
        self._gate: anyio.Event | None = None
        original = cls._start

        async def counted(runtime: Runtime) -> Any:
            self.calls += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if self._gate is not None:
                    await self._gate.wait()
                if self.failure is not None:
                    raise self.failure()
                workdir = await original(runtime)
                self.started.append(runtime)
                self.by_workdir[workdir] = runtime
                return workdir
            finally:
                self.in_flight -= 1

        monkeypatch.setattr(cls, "_start", counted)

    def hold(self) -> None:
        """Creations wait at a gate (inside ``start()``'s shielded part) until :meth:`open`."""
        self._gate = anyio.Event()

    def open(self) -> None:
        if self._gate is not None:
            self._gate.set()
        self._gate = None

    async def until(self, condition: Callable[[], bool], within: float = 30.0) -> None:
        """Wait (polling) until ``condition()`` holds; fail after ``within`` seconds."""
        with anyio.fail_after(within):
            while not condition():  # noqa: ASYNC110 - the counters have no event to wait on
                await anyio.sleep(0.01)


@pytest.fixture(scope="module")
def docker_client() -> Iterator[Any]:
    """The Docker SDK's client (the pools' test image built, else the test is skipped or
    fails as ``require_docker_image`` says)."""
    import docker

    require_docker_image(DOCKER_TEST_IMAGE)
    client = docker.from_env()
    try:
        yield client
    finally:
        client.close()


def pool_containers(client: Any, pool_id: str) -> list[Any]:
    """Every container (running or not) labelled with the pool ``pool_id``."""
    found: list[Any] = client.containers.list(all=True, filters={"label": f"{POOL}={pool_id}"})
    return found
