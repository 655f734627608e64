"""Load: 48 sandboxes at once on four backends, every byte verified; host memory bounded
while huge outputs stream through the cap.

Each sandbox runs a random mix of operations on random payloads (0 to 2 MiB, binary):
exec with the payload on stdin (``sha256sum`` inside the sandbox must match), write then
read back, read of a file the sandbox made, exec printing a payload back. Every byte is
checked against its SHA-256; any error fails the test.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import types
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import anyio
import pytest

from runtimes import open_runtime
from runtimes.base import Runtime
from runtimes.models import MiB
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures
from tests.ssh.sshd import SSHServer

from .conftest import REPO, TALLY, sha

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.ssh]

SEED = 4848
OPS_PER_SANDBOX = 8
MAX_PAYLOAD = 2 * MiB


@dataclass
class Work:
    operations: int = 0
    bytes_verified: int = 0


def _payload(rng: random.Random) -> bytes:
    size = rng.choice([0, 1, 100, 4096, 65_537, rng.randrange(MAX_PAYLOAD)])
    return rng.randbytes(size)


async def _exercise(rt: Runtime, rng: random.Random, work: Work, name: str) -> None:
    for n in range(OPS_PER_SANDBOX):
        data = _payload(rng)
        kind = rng.randrange(4)
        if kind == 0:  # stdin in, digest out
            result = await rt.exec(["sha256sum"], stdin=data, timeout=120)
            assert result.exit_code == 0, (name, result)
            assert result.stdout.split()[0] == sha(data), f"{name}: stdin corrupted"
        elif kind == 1:  # write, read back
            path = f"load/{n}.bin"
            await rt.write(path, data)
            assert sha(await rt.read(path)) == sha(data), f"{name}: file corrupted"
        elif kind == 2:  # the sandbox writes a file, the host reads it
            path = f"made-{n}.bin"
            await rt.write(f"{path}.src", data)
            made = await rt.exec(["sh", "-c", f"cat {path}.src > {path}"], timeout=120)
            assert made.exit_code == 0, (name, made)
            assert sha(await rt.read(path)) == sha(data), f"{name}: copy corrupted"
        else:  # stdout carries the payload back
            result = await rt.exec(["cat"], stdin=data, timeout=120)
            assert sha(result.stdout_bytes) == sha(data), f"{name}: stdout corrupted"
            assert result.stderr_bytes == b""
        work.operations += 1
        work.bytes_verified += len(data)


async def test_48_sandboxes_on_four_backends_every_byte_verified(
    shared_sshd: SSHServer,
    fake_modal: types.ModuleType,  # noqa: F811
) -> None:
    ssh = shared_sshd.config(max_channels=12)
    configs: list[tuple[str, Any]] = [
        *(("subprocess", {"type": "subprocess"}) for _ in range(16)),
        *(("docker", {"type": "docker"}) for _ in range(16)),
        *(("ssh", ssh) for _ in range(8)),
        *(("modal-fake", fake_config()) for _ in range(8)),
    ]
    per_backend: dict[str, Work] = {}
    started = time.monotonic()
    async with AsyncExitStack() as stack:
        opened: list[tuple[str, Runtime]] = []

        async def open_one(name: str, config: Any) -> None:
            opened.append((name, await stack.enter_async_context(open_runtime(config))))

        async with anyio.create_task_group() as tg:
            for name, config in configs:
                tg.start_soon(open_one, name, config)
        assert len(opened) == 48
        with anyio.fail_after(600):
            async with anyio.create_task_group() as tg:
                for index, (name, rt) in enumerate(opened):
                    work = per_backend.setdefault(name, Work())
                    tg.start_soon(_exercise, rt, random.Random(SEED + index), work, name)
    seconds = time.monotonic() - started
    operations = sum(w.operations for w in per_backend.values())
    verified = sum(w.bytes_verified for w in per_backend.values())
    assert operations == 48 * OPS_PER_SANDBOX
    for name, work in sorted(per_backend.items()):
        TALLY.add(f"load: operations on {name}", work.operations)
        TALLY.add(f"load: bytes verified on {name}", work.bytes_verified)
    TALLY.add("load: concurrent sandboxes", 48)
    print(
        f"\nload: 48 sandboxes, {operations} operations, {verified / MiB:.1f} MiB verified "
        f"in {seconds:.1f}s (open + work + close)"
    )


# ---------------------------------------------------------------------- host memory


def _measure_in_child(config: dict[str, Any], total: int, cap: int) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.reliability.memory_child",
            json.dumps(config),
            str(total),
            str(cap),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    outcome: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome


SLACK = 48 * MiB
"""Interpreter, SDK and thread-stack noise a single call may add."""


@pytest.mark.parametrize(
    ("total", "cap"),
    [(200 * MiB, 16 * MiB), (500 * MiB, 64 * MiB)],
    ids=["200MiB-through-16MiB-cap", "500MiB-through-default-cap"],
)
@pytest.mark.parametrize("backend", ["subprocess", "docker", "ssh"])
def test_huge_output_is_capped_and_host_memory_bounded(
    backend: str, total: int, cap: int, shared_sshd: SSHServer
) -> None:
    configs: dict[str, dict[str, Any]] = {
        "subprocess": {"type": "subprocess"},
        "docker": {"type": "docker"},
        "ssh": {**shared_sshd.config().model_dump(mode="json"), "password": None},
    }
    outcome = _measure_in_child(configs[backend], total, cap)
    assert outcome["error"] == "OutputLimitExceededError", outcome
    assert outcome["kept"] == cap and outcome["all_v"], outcome
    assert outcome["usable_after"], outcome
    assert outcome["growth_bytes"] < 2 * cap + SLACK, (
        f"{backend}: peak RSS grew {outcome['growth_bytes'] / MiB:.0f} MiB streaming "
        f"{total / MiB:.0f} MiB through a {cap / MiB:.0f} MiB cap"
    )
    TALLY.add(
        f"memory: peak growth MiB, {backend} {total // MiB}MiB/{cap // MiB}MiB cap",
        round(outcome["growth_bytes"] / MiB),
    )
    growth = outcome["growth_bytes"] / MiB
    print(f"\n{backend}: {total // MiB} MiB through {cap // MiB} MiB: peak RSS +{growth:.1f} MiB")
