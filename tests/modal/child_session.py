"""A separate vf-sandbox session for leak tests: ``python -m tests.modal.child_session STATE MODE``.

It opens a Modal runtime, prints the sandbox id, then either hangs until killed (``MODE=hang``:
the test SIGKILLs it, a crash) or returns without closing the runtime (``MODE=exit``: the
atexit backstop must terminate the sandbox). ``STATE`` is the state directory of the fake
Modal service shared with the test process (as Modal's service is), or ``live`` for real
Modal (``VF_MODAL_TEST_IMAGE`` picks the image).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio

import runtimes.modal.client
from runtimes import open_runtime

from .fake_modal import FakeModalService
from .support import fake_config

_KEEP: list[object] = []  # the atexit registry holds runtimes weakly; a user's code holds them


async def _open(config: dict[str, Any]) -> str:
    runtime = open_runtime(config)
    await runtime.start()
    _KEEP.append(runtime)
    return runtime.sandbox_id or ""


def main() -> None:
    state, mode = sys.argv[1], sys.argv[2]
    if state == "live":
        image = os.environ.get("VF_MODAL_TEST_IMAGE", "python:3.11-slim")
        config = {"type": "modal", "image": image, "app_name": "vf-sandbox-tests"}
    else:
        fake = FakeModalService(Path(state)).module()
        runtimes.modal.client.modal_sdk = lambda: fake  # type: ignore[assignment]
        config = fake_config()
    print(anyio.run(_open, config), flush=True)
    if mode == "hang":
        time.sleep(600)


if __name__ == "__main__":
    main()
