"""The conformance suite on the Modal runtime, against the fake Modal SDK.

Modal's service cannot be reached from the test machines; ``tests/modal/fake_modal.py`` keeps
Modal's own client code (exec, process streams, the filesystem API, the exception classes) and
plays the service with one local Docker container per sandbox. The same suite runs against
real Modal in ``tests/modal/test_live.py`` when credentials are present.

It runs through the persistent channel (the default: one ``Sandbox.exec`` carrying every
command and file; the witness proves it carried every call), and again through the plain SDK
path (``channel=False``: an exec per command, the filesystem API for files).
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from typing import Any

import pytest

from runtimes.testing import RuntimeConformance
from tests.channel.support import assert_channel_carried_everything, channel_witness
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures

pytestmark = pytest.mark.docker


class TestModalFakeConformance(RuntimeConformance):
    anyio_backends = ("asyncio", "trio")

    @pytest.fixture
    def runtime_config(self, fake_modal: types.ModuleType) -> dict[str, Any]:  # noqa: F811
        return fake_config()

    @pytest.fixture(autouse=True)
    def _channel_carries_every_call(self, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        with channel_witness(monkeypatch) as seen:
            yield
        assert_channel_carried_everything(seen)


class TestModalFakeConformanceNoChannel(RuntimeConformance):
    anyio_backends = ("asyncio",)

    @pytest.fixture
    def runtime_config(self, fake_modal: types.ModuleType) -> dict[str, Any]:  # noqa: F811
        return fake_config(channel=False)
