"""The conformance suite on the Modal runtime, against the fake Modal SDK.

Modal's service cannot be reached from the test machines; ``tests/modal/fake_modal.py`` keeps
Modal's own client code (exec, process streams, the filesystem API, the exception classes) and
plays the service with one local Docker container per sandbox. The same suite runs against
real Modal in ``tests/modal/test_live.py`` when credentials are present.
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from runtimes.testing import RuntimeConformance
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures

pytestmark = pytest.mark.docker


class TestModalFakeConformance(RuntimeConformance):
    anyio_backends = ("asyncio", "trio")

    @pytest.fixture
    def runtime_config(self, fake_modal: types.ModuleType) -> dict[str, Any]:  # noqa: F811
        return fake_config()
