"""Measure the host memory one huge output costs: ``python -m tests.reliability.memory_child``.

Arguments: a runtime config (JSON), the bytes the command writes, the output cap. The child
opens the runtime, warms it up, resets its peak RSS (``/proc/self/clear_refs``, 5), runs a
command that writes the bytes to stdout under the cap, and prints one JSON line: what it
raised, how many bytes it kept, and the growth of its peak RSS over the RSS at the reset.
A child process keeps the measurement clean of the test runner's own allocations.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio

from runtimes import OutputLimitExceededError, open_runtime


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} is not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


async def measure(config: dict[str, Any], total: int, cap: int) -> dict[str, Any]:
    command = ["sh", "-c", f"head -c {total} /dev/zero | tr '\\0' 'v'"]
    async with open_runtime(config) as rt:
        for _ in range(3):  # every pool, channel and buffer the runtime keeps exists now
            await rt.exec(["sh", "-c", "head -c 1048576 /dev/zero"], output_limit=cap)
        _reset_peak()
        rss = _status_kib("VmRSS")
        started = time.monotonic()
        outcome: dict[str, Any] = {"error": None, "kept": 0}
        try:
            result = await rt.exec(command, output_limit=cap, timeout=300)
            outcome["kept"] = len(result.stdout_bytes)
        except OutputLimitExceededError as exc:
            outcome["error"] = type(exc).__name__
            outcome["kept"] = len(exc.stdout_bytes) + len(exc.stderr_bytes)
            outcome["all_v"] = exc.stdout_bytes.count(b"v") == len(exc.stdout_bytes)
            del exc
        outcome["seconds"] = time.monotonic() - started
        outcome["growth_bytes"] = (_status_kib("VmHWM") - rss) * 1024
        alive = await rt.exec(["echo", "ok"])
        outcome["usable_after"] = alive.stdout == "ok\n"
    return outcome


def main() -> None:
    config, total, cap = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(anyio.run(measure, config, total, cap)), flush=True)


if __name__ == "__main__":
    main()
