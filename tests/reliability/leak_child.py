"""A vf-sandbox session that gets SIGKILLed: ``python -m tests.reliability.leak_child``.

Arguments: a JSON list of runtime configs, a token, and the fake Modal service's state
directory (used when a config has ``"type": "modal"``). The child opens one sandbox per
config, leaves a background ``sleep <token>`` running in each, prints one JSON line
(``session``, ``sandboxes``: backend and id of each) and then waits to be killed. SIGKILL
skips every backstop: only the labels are left for ``vf-sandbox cleanup``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio

import runtimes.modal.client
from runtimes import open_runtime, ownership
from runtimes.base import Runtime

_KEEP: list[Runtime] = []


async def _open_all(configs: list[dict[str, Any]], mark: str) -> list[dict[str, str]]:
    opened = []
    for config in configs:
        rt = open_runtime(config)
        await rt.start()
        _KEEP.append(rt)
        spawned = await rt.exec(
            ["sh", "-c", f"nohup sleep {mark} >/dev/null 2>&1 </dev/null & echo started"],
            timeout=60,
        )
        assert spawned.stdout == "started\n", spawned
        opened.append({"backend": rt.name, "id": rt.sandbox_id or ""})
    return opened


def main() -> None:
    configs: list[dict[str, Any]] = json.loads(sys.argv[1])
    mark, state = sys.argv[2], sys.argv[3]
    if any(c["type"] == "modal" for c in configs):
        from tests.modal.fake_modal import FakeModalService

        fake = FakeModalService(Path(state)).module()
        runtimes.modal.client._modal = lambda: fake  # type: ignore[assignment]
    sandboxes = anyio.run(_open_all, configs, mark)
    print(json.dumps({"session": ownership.SESSION_ID, "sandboxes": sandboxes}), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
