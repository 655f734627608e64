"""The conformance suite on the Modal runtime, against the fake Modal SDK.

Modal's service cannot be reached from the test machines; ``tests/modal/fake_modal.py`` keeps
Modal's own client code (exec, process streams, the filesystem API, the exception classes) and
plays the service with one local Docker container per sandbox. The same suite runs against
real Modal in ``tests/modal/test_live.py`` when credentials are present.

It runs through the persistent channel (the default: one ``Sandbox.exec`` carrying every
command and file; the witness proves it carried every call), and again through the plain SDK
path (``channel=False``: an exec per command, the filesystem API for files). The checks marked
``shares_sandbox`` share one sandbox per class and event loop (``docs/conformance.md``), so the
fake service serves the whole class.

Event loops: the channel runs under asyncio, the plain SDK path under trio. The runtime's
loop-specific code is its calls into the SDK (``runtimes/modal/client.py``: ``.aio`` under
asyncio; the blocking interface in a worker thread, output streams iterated in a thread, under
trio). The channel makes one such call (the agent's exec) and then drives the agent's process
through the blocking interface from its own threads whatever the loop; the plain path makes
them for every command and file. So the plain path under trio covers that code (which it did
not before), the channel's own loop-specific hand-over runs under trio on the SSH and Docker
classes, and the channel's checks do not run a second time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runtimes.testing import RuntimeConformance
from tests.modal.fake_modal import FakeModalService, install
from tests.modal.support import (
    _sweep_stale_fake_containers,
    docker_unavailable_reason,
    fake_config,
)

from .channel import ThroughTheChannel

pytestmark = pytest.mark.docker


class _OnTheFakeService(RuntimeConformance):
    share_sandbox = True

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _fake_modal(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
        """The fake service, installed for the class: set up before the shared sandboxes
        (autouse), torn down after them."""
        reason = docker_unavailable_reason()
        if reason:
            pytest.fail(f"the fake Modal service runs on Docker: {reason} (`make test` starts it)")
        _sweep_stale_fake_containers()
        service = FakeModalService(tmp_path_factory.mktemp("fake-modal-state"))
        try:
            with pytest.MonkeyPatch.context() as monkeypatch:
                install(service, monkeypatch)
                yield
        finally:
            service.close()


class TestModalFakeConformance(ThroughTheChannel, _OnTheFakeService):
    anyio_backends = ("asyncio",)  # trio: the plain path below (see the module doc)

    @pytest.fixture
    def runtime_config(self) -> dict[str, Any]:
        return fake_config()


class TestModalFakeConformanceNoChannel(_OnTheFakeService):
    anyio_backends = ("trio",)

    @pytest.fixture
    def runtime_config(self) -> dict[str, Any]:
        return fake_config(channel=False)
