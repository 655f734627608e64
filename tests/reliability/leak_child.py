"""A vf-sandbox session that gets SIGKILLed: ``python -m tests.reliability.leak_child``.

Arguments: a JSON list of runtime configs (one per backend), how many plain sandboxes to
open per config, a token, and the fake Modal service's state directory (used when a config
has ``"type": "modal"``). For every config, concurrently, the child

* opens the plain sandboxes and leaves a background ``sleep <token>`` running in each;
* enters a ``RuntimePool(config, size=1)``, takes one sandbox from it (held, never closed)
  with a ``sleep <token>`` in it too, and waits until the pool has refilled its stock: at the
  kill the pool has one sandbox handed out and one idle;
* takes a snapshot (not kept) of its first plain sandbox.

Then it prints one JSON line (``session``, and per backend: ``backend``, ``sandboxes``: the
plain ones' ids, ``pool``: the pool's id, ``held``: the id of the sandbox taken from it,
``snapshot``: the snapshot's id) and sleeps with its pools open until it is killed. SIGKILL
skips every backstop (closes, the pools' exit, the snapshots' atexit removal): only the
labels are left for ``vf-sandbox cleanup``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

import runtimes.modal.client
from runtimes import open_runtime, ownership
from runtimes.base import Runtime
from runtimes.pool import RuntimePool

_KEEP: list[Runtime] = []


async def _sleep_in(rt: Runtime, mark: str) -> None:
    spawned = await rt.exec(
        ["sh", "-c", f"nohup sleep {mark} >/dev/null 2>&1 </dev/null & echo started"],
        timeout=60,
    )
    assert spawned.stdout == "started\n", spawned


async def _open_plain(config: dict[str, Any], count: int, mark: str) -> list[Runtime]:
    opened = []
    for _ in range(count):
        rt = open_runtime(config)
        await rt.start()
        _KEEP.append(rt)
        await _sleep_in(rt, mark)
        opened.append(rt)
    return opened


async def _hold_backend(
    config: dict[str, Any],
    count: int,
    mark: str,
    reports: MemoryObjectSendStream[dict[str, Any]],
) -> None:
    """Open and hold everything of one config, report it, then wait (pool open) for the kill."""
    plain = await _open_plain(config, count, mark)
    async with RuntimePool(config, size=1) as pool:
        held = await pool.take()
        _KEEP.append(held)
        await _sleep_in(held, mark)
        await pool.wait_ready()  # the replacement of the taken one is in stock
        snapshot = await plain[0].snapshot()
        await reports.send(
            {
                "backend": plain[0].name,
                "sandboxes": [rt.sandbox_id for rt in plain],
                "pool": pool.id,
                "held": held.sandbox_id,
                "snapshot": snapshot.id,
            }
        )
        await anyio.sleep_forever()


async def _hold_all(configs: list[dict[str, Any]], count: int, mark: str) -> None:
    send, receive = anyio.create_memory_object_stream[dict[str, Any]](len(configs))
    async with anyio.create_task_group() as group:
        for config in configs:
            group.start_soon(_hold_backend, config, count, mark, send)
        backends = [await receive.receive() for _ in configs]
        report = {"session": ownership.CREATOR_ID, "backends": backends}
        print(json.dumps(report), flush=True)
        await anyio.sleep(600)
        group.cancel_scope.cancel()


def main() -> None:
    configs: list[dict[str, Any]] = json.loads(sys.argv[1])
    count, mark, state = int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if any(c["type"] == "modal" for c in configs):
        from tests.modal.fake_modal import FakeModalService

        fake = FakeModalService(Path(state)).module()
        runtimes.modal.client.modal_sdk = lambda: fake  # type: ignore[assignment]
    anyio.run(_hold_all, configs, count, mark)


if __name__ == "__main__":
    main()
