"""``vf-sandbox cleanup`` of a leaked subprocess sandbox never follows a ``work/`` link.

The cleanup sweep (:func:`runtimes.subprocess.sweep.destroy_dir`) kills, besides what
carries the mark, every process found under the sandbox's directories. Code in the sandbox
(the host's own user here) replaces ``work/`` by a link to a directory where a process that
is not the sandbox's works: resolving the link would make that directory the sandbox's.
(Close is safe by construction: it keeps the real paths it resolved at start, before any
of the sandbox's code ran.)
"""

from __future__ import annotations

import random
from pathlib import Path

import anyio
import pytest

from runtimes import SubprocessConfig, open_runtime
from runtimes.subprocess.sweep import destroy_dir

pytestmark = pytest.mark.anyio


def _alive(pid: int) -> bool:
    """Running: not gone, nor a zombie (the child is reaped only once awaited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _running(token: str) -> bool:
    for entry in Path("/proc").iterdir():
        try:
            if f"sleep\0{token}".encode() in (entry / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


_PLANT = 'w=$(pwd -P) && cd .. && rm -rf "$w" && ln -s {place} "$w"'


@pytest.mark.attack(8)
@pytest.mark.parametrize("plant", [True, False], ids=["planted-link", "control"])
async def test_cleanup_sweep_does_not_follow_a_planted_work_link(
    tmp_path: Path, plant: bool
) -> None:
    place = tmp_path / "innocent"
    place.mkdir()
    root = tmp_path / "root"
    rt = open_runtime(SubprocessConfig(root=str(root)))
    await rt.start()
    innocent = await anyio.open_process(
        ["env", "-i", "sleep", "300"], cwd=place, start_new_session=True
    )
    token = f"{random.randint(300, 999)}.{random.randint(10**5, 10**6 - 1)}"
    try:
        workdir = Path(rt.workdir)
        leftover = f"env -i setsid sleep {token} >/dev/null 2>&1 < /dev/null &"
        command = f"{leftover} {_PLANT.format(place=place)}" if plant else leftover
        assert (await rt.exec(["sh", "-c", command])).exit_code == 0
        assert workdir.is_symlink() == plant  # control: the link is there
        destroy_dir(workdir.parent)  # the sandbox leaked: cleanup's sweep and removal
        assert not workdir.parent.exists()
        assert not _running(token), "the sandbox's own leftover survived the cleanup"
        assert _alive(innocent.pid), "the cleanup killed a process that is not the sandbox's"
        assert place.is_dir()
    finally:
        innocent.kill()
        await innocent.wait()
        await rt.close()
