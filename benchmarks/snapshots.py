"""Forks from snapshots (``python -m benchmarks --sections fork``).

One Docker sandbox whose policy (``vf-policy``) wrote 100 MiB of files (100 files of 1 MiB of
random bytes) in its workdir. Each round, interleaved:

* ours: ``snap = await rt.snapshot()`` then ``open_runtime(config, snapshot=snap).start()``
  (the fork ready: container running, channel agent up);
* the baseline: a hand-written ``docker commit`` of the same container (the SDK's
  ``api.commit``, which pauses it as ours does) then ``containers.run(image, keep-alive,
  detach=True)`` of the committed image (the SDK, no readiness check).

Removing the fork's container and the image is not timed. The subprocess runtime's fork (a copy
of the workdir) is measured beside ``cp -a --reflink=auto`` of the same tree twice (snapshot,
then the fork's copy) for scale.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any

import anyio.to_thread

from runtimes import open_runtime, remove_snapshot
from runtimes.docker import DockerConfig
from runtimes.subprocess import SubprocessConfig

from .stats import Series
from .suite import KEEP_ALIVE, Environment, Row, _remove, _within, rows_table

FILES, FILE_MIB = 100, 1
TARGET = 1.3
WRITE_FILES = (
    'i=0; while [ "$i" -lt "$1" ]; do '
    'head -c "$(($2 * 1048576))" /dev/urandom > "data-$i.bin"; i=$((i + 1)); done'
)


def rounds(env: Environment) -> int:
    """~5 rounds in a full run, 2 in ``--quick`` (which lowers ``n_create`` to 3)."""
    return 5 if env.options.n_create >= 10 else 2


async def fork_section(env: Environment) -> tuple[str, list[Row]]:
    n = rounds(env)
    notes: list[str] = []
    image = env.options.image
    default = DockerConfig(image=image, creations_per_second=None)
    ours, base = await _docker_rounds(env, default, n, notes)
    root = DockerConfig(image=image, creations_per_second=None, policy_user=None)
    root_ours, root_base = await _docker_rounds(env, root, n, notes)
    sub_ours, sub_base = await _subprocess_rows(n)
    rows = [
        Row(
            "docker: snapshot() + fork start()",
            ours,
            "SDK commit + containers.run",
            base,
            f"<= {TARGET}x",
            _within(ours, base, TARGET),
        ),
        Row("docker, policy_user=None (diff read)", root_ours, "the same", root_base),
        Row("subprocess: snapshot() + fork start()", sub_ours, "cp -a --reflink=auto x2", sub_base),
    ]
    text = (
        f"Fork of a sandbox whose policy wrote {FILES * FILE_MIB} MiB ({FILES} files), n={n} "
        "each, interleaved (removal not timed): `rt.snapshot()` then `open_runtime(config, "
        "snapshot=snap).start()` vs the Docker SDK's `api.commit(container)` then "
        "`containers.run(image, keep-alive, detach=True)` of the same container. The first row "
        "is the default config (the policy as `vf-policy`: the image is trusted as is); with "
        "`policy_user=None` the snapshot also reads the engine's diff of the paused container "
        '(docs/snapshots.md, "Hostile content"). Subprocess: the runtime\'s copy of the '
        "workdir into a snapshot and out again vs two raw `cp -a --reflink=auto` of the same "
        "tree.\n\n" + rows_table(rows, tail=0.9)
    )
    if notes:
        text += "\n\n" + "\n".join(sorted(set(notes)))
    return text, rows


async def _docker_rounds(
    env: Environment, config: DockerConfig, n: int, notes: list[str]
) -> tuple[Series, Series]:
    ours, base = Series("snapshot + fork start"), Series("docker commit + containers.run")
    async with open_runtime(config) as source:
        wrote = await source.exec(
            ["sh", "-c", WRITE_FILES, "sh", str(FILES), str(FILE_MIB)],
            user=source.policy_user,
            timeout=600,
        )
        assert wrote.exit_code == 0, wrote
        for index in range(n + 1):  # the first round warms caches up
            mine, state = await _ours(config, source)
            theirs = await _baseline(env, str(source.sandbox_id))
            if index:
                ours.samples.append(mine)
                base.samples.append(theirs)
            if state != "running":
                notes.append(f"WARNING: the fork's channel was {state}")
    return ours, base


async def _ours(config: DockerConfig, source: Any) -> tuple[float, str]:
    started = time.perf_counter()
    snap = await source.snapshot()
    fork = open_runtime(config, snapshot=snap)
    try:
        await fork.start()
        elapsed = time.perf_counter() - started
        state = fork.channel_info.state
    finally:
        await fork.close()
        await remove_snapshot(snap)
    return elapsed, state


async def _baseline(env: Environment, container_id: str) -> float:
    client = env.client

    def commit_and_run() -> tuple[float, str, Any]:
        started = time.perf_counter()
        image = client.api.commit(container_id)["Id"]
        container = client.containers.run(
            image, KEEP_ALIVE, detach=True, network_mode="none", init=True
        )
        return time.perf_counter() - started, image, container

    elapsed, image, container = await anyio.to_thread.run_sync(commit_and_run)
    _remove(container)
    with contextlib.suppress(Exception):
        client.api.remove_image(image)
    return elapsed


async def _subprocess_rows(n: int) -> tuple[Series, Series]:
    ours, base = Series("subprocess fork"), Series("cp -a x2")
    with tempfile.TemporaryDirectory(prefix="vf-bench-fork-") as tmp:
        config = SubprocessConfig(root=os.path.join(tmp, "root"))
        async with open_runtime(config) as source:
            wrote = await source.exec(
                ["sh", "-c", WRITE_FILES, "sh", str(FILES), str(FILE_MIB)], timeout=600
            )
            assert wrote.exit_code == 0, wrote
            for index in range(n + 1):
                started = time.perf_counter()
                snap = await source.snapshot()
                async with open_runtime(config, snapshot=snap):
                    mine = time.perf_counter() - started
                await remove_snapshot(snap)
                theirs = await anyio.to_thread.run_sync(_raw_copies, source.workdir, tmp)
                if index:
                    ours.samples.append(mine)
                    base.samples.append(theirs)
    return ours, base


def _raw_copies(workdir: str, tmp: str) -> float:
    first, second = os.path.join(tmp, "raw-snapshot"), os.path.join(tmp, "raw-fork")
    started = time.perf_counter()
    for source, target in ((workdir, first), (first, second)):
        subprocess.run(["cp", "-a", "--reflink=auto", "-T", "--", source, target], check=True)
    elapsed = time.perf_counter() - started
    shutil.rmtree(first)
    shutil.rmtree(second)
    return elapsed
