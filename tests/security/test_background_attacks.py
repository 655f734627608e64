"""A policy's background processes against ``exec`` returning at the command's exit
(``docs/processes.md``).

The policy leaves processes holding the pipes of the command it was given: a flooder that
writes without end once ``exec`` returned (the host must read and drop it, never keep it), a
flood inside the grace (the output cap still applies to it), and a ``setsid`` child under a
``spawn`` handle (``kill()`` ends the handle's group, the sweep ends the rest). Played on the
host process runtime and on Docker (where the channel's agent does the discarding); the SSH
and Modal paths run the same semantics in the conformance kit.
"""

from __future__ import annotations

import time
import tracemalloc

import anyio
import pytest

from runtimes import OutputLimitExceededError, open_runtime
from runtimes.processes import running_count
from tests.processes import sleep_token

from .conftest import Hostile

pytestmark = pytest.mark.anyio

TARGETS = ["subprocess", "docker-root"]


@pytest.mark.attack(7)
@pytest.mark.parametrize("hostile", TARGETS, indirect=True)
async def test_a_flood_after_the_exit_neither_holds_exec_nor_grows_host_memory(
    hostile: Hostile,
) -> None:
    """``(sleep 0.4; yes) & echo ok``: exec returns ``ok`` alone, and a second of ``yes``
    flooding the inherited stdout afterwards costs the host no memory; a flood inside the
    grace hits the output cap like any output."""
    async with open_runtime(hostile.config) as rt:
        started = time.monotonic()
        result = await rt.exec(["sh", "-c", "(sleep 0.4; exec yes) & echo ok"], timeout=30)
        assert result.stdout == "ok\n" and time.monotonic() - started < 10, result
        tracemalloc.start()
        try:
            await anyio.sleep(1.2)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 * 2**20, f"the host kept the flood: {peak} bytes"
        await rt.stop_processes()
        with pytest.raises(OutputLimitExceededError) as caught:
            await rt.exec(["sh", "-c", "yes & echo ok"], timeout=30, output_limit=2**20)
        assert len(caught.value.stdout_bytes) + len(caught.value.stderr_bytes) == 2**20
        await rt.stop_processes()
        for _ in range(100):
            if running_count(rt) == 0:
                break
            await anyio.sleep(0.05)
        assert running_count(rt) == 0, "a run outlived the processes that held its pipes"


@pytest.mark.attack(6)
@pytest.mark.parametrize("hostile", TARGETS, indirect=True)
async def test_a_setsid_child_of_a_spawned_process_does_not_outlive_the_sweep(
    hostile: Hostile,
) -> None:
    token = sleep_token()
    async with open_runtime(hostile.config) as rt:
        proc = await rt.spawn(["sh", "-c", f"setsid sleep {token} & exec sleep {token}"])
        await anyio.sleep(0.5)
        await proc.kill()
        assert (await proc.wait(timeout=10)).exit_code == 137
        assert await rt.stop_processes() >= 1  # the setsid'd sleeper left kill()'s group
        left = await rt.exec(["sh", "-c", f"ps -eo args | grep -c '^sleep {token}' || true"])
        assert left.stdout.strip() == "0", left
