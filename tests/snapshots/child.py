"""A separate vf-sandbox session that snapshots a sandbox:
``python -m tests.snapshots.child CONFIG_JSON MODAL_STATE MODE [keep]``.

It opens a runtime from CONFIG_JSON (the fake Modal service of MODAL_STATE, shared with the test
process, when it is not empty), takes a snapshot (``keep=True`` with ``keep``), prints it and its
session as one JSON line, then hangs until killed (``MODE=hang``: the test SIGKILLs it) or returns
without closing or removing anything (``MODE=exit``: the exit backstops must).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

import runtimes.modal.client
from runtimes import Runtime, open_runtime, ownership

_KEEP: list[Runtime] = []  # a user's code holds its runtimes


async def _snapshot(config: dict[str, Any], keep: bool) -> dict[str, Any]:
    runtime = open_runtime(config)
    await runtime.start()
    _KEEP.append(runtime)
    await runtime.write("from-child.txt", b"child")
    snap = await runtime.snapshot(keep=keep)
    return {
        "snapshot": snap.model_dump(mode="json"),
        "session": ownership.CREATOR_ID,
        "sandbox": runtime.sandbox_id,
    }


def main() -> None:
    config, state, mode = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    keep = len(sys.argv) > 4 and sys.argv[4] == "keep"
    if state:
        from tests.modal.fake_modal import FakeModalService

        fake = FakeModalService(Path(state)).module()
        runtimes.modal.client.modal_sdk = lambda: fake  # type: ignore[assignment]
    print(json.dumps(anyio.run(_snapshot, config, keep)), flush=True)
    if mode == "hang":
        time.sleep(600)


if __name__ == "__main__":
    main()
