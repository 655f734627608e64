"""``vf-sandbox`` with the fake Modal SDK.

``python -m tests.reliability.fake_modal_cli STATE ARGS...`` runs
the real command line (:func:`placement.cli.main`), unchanged, with ``runtimes.modal``
pointed at the fake Modal service whose state lives in ``STATE`` (shared with the test
process, as Modal's service is shared by every client).
"""

from __future__ import annotations

import sys
from pathlib import Path

import runtimes.modal.client
from placement.cli import main
from tests.modal.fake_modal import FakeModalService

if __name__ == "__main__":
    fake = FakeModalService(Path(sys.argv[1])).module()
    runtimes.modal.client.modal_sdk = lambda: fake  # type: ignore[assignment]
    sys.exit(main(sys.argv[2:]))
