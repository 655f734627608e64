"""RuntimePool(recycle=True): a released sandbox goes back to the stock only once a reset
proved it back to its state after start (``runtimes.recycle``); configs that cannot be
proven are refused with the reason; many cycles from several workers leave nothing behind
and show no acquirer anything of the one before."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from runtimes import Runtime, RuntimeConfigError
from runtimes.pool import RuntimePool
from runtimes.pytest_plugin import DOCKER_TEST_IMAGE
from runtimes.reaper import drain_removals

from .conftest import pool_containers

pytestmark = [pytest.mark.anyio]

RECYCLABLE = {
    "type": "docker",
    "image": DOCKER_TEST_IMAGE,
    "read_only": True,
    "policy_user": "nobody",
    "disk": 64,
    "creations_per_second": None,
}

# What one acquirer sees of the last, then what it leaves for the next: a file in each
# writable place, a background process, a SysV shared memory segment.
CYCLE = r"""
seen="$(ls -A /work /tmp /dev/shm | grep -v -e '^/' -e '^$' | tr '\n' ' ')"
seen="$seen$(ps -eo user=,comm= | grep -c '^nobody *sleep$')$(tail -n +2 /proc/sysvipc/shm | wc -l)"
echo "$seen"
echo "$1" > /work/mine; echo "$1" > /tmp/mine; echo "$1" > /dev/shm/mine
nohup sleep 600 >/dev/null 2>&1 &
python3 -c 'import ctypes; ctypes.CDLL(None).shmget(0, 4096, 0o1666)'
"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"type": "subprocess"}, "cannot prove a used sandbox clean"),
        ({**RECYCLABLE, "read_only": False}, "root file system is writable"),
        ({**RECYCLABLE, "policy_user": None}, "the policy runs as root"),
        ({**RECYCLABLE, "user": "nobody"}, "is not root"),
        ({**RECYCLABLE, "network": "bridge"}, "network='bridge'"),
        (
            {**RECYCLABLE, "mounts": [{"type": "volume", "source": "c", "target": "/cache"}]},
            "are writable",
        ),
        ({**RECYCLABLE, "cap_add": ["SYS_ADMIN"]}, "CAP_SYS_ADMIN"),
        ({**RECYCLABLE, "security_opt": ()}, "no-new-privileges"),
        ({"type": "ssh", "host": "127.0.0.1", "username": "root", "password": "x"}, "cannot prove"),
    ],
)
def test_configs_that_cannot_be_proven_clean_are_refused_with_the_reason(
    config: dict[str, Any], reason: str
) -> None:
    with pytest.raises(RuntimeConfigError, match="recycle=True") as caught:
        RuntimePool(config, size=1, recycle=True)
    assert reason in str(caught.value)
    RuntimePool(config, size=1)  # the same config pools without recycling


@pytest.mark.docker
async def test_many_cycles_from_four_workers_show_nothing_of_the_last_and_leak_nothing(
    docker_client: Any,
) -> None:
    cycles, workers = 200, 4
    seen: list[str] = []
    sandboxes: set[str] = set()
    async with RuntimePool(RECYCLABLE, size=4, recycle=True) as pool:
        await pool.wait_ready()

        async def worker(index: int) -> None:
            for n in range(index, cycles, workers):
                async with pool.acquire(timeout=120) as rt:
                    assert rt.sandbox_id is not None
                    sandboxes.add(rt.sandbox_id)
                    done = await rt.exec(["sh", "-c", CYCLE, "sh", str(n)], user=rt.policy_user)
                    assert done.exit_code == 0, done.stderr
                    seen.append(done.stdout.strip())

        async with anyio.create_task_group() as group:
            for index in range(workers):
                group.start_soon(worker, index)
        recycling = pool.recycling
        assert recycling is not None
        pool_id = pool.id
    await drain_removals()
    assert len(seen) == cycles
    assert set(seen) == {"00"}, "an acquirer saw files, processes or IPC of an earlier one"
    assert recycling.discarded == 0
    assert recycling.recycled >= cycles - len(sandboxes)
    assert len(sandboxes) <= 8, "sandboxes were created per cycle, not recycled"
    assert pool_containers(docker_client, pool_id) == [], "the pool left containers behind"


@pytest.mark.docker
async def test_a_reset_in_flight_when_the_pool_closes_destroys_its_sandbox(
    docker_client: Any,
) -> None:
    async with RuntimePool(RECYCLABLE, size=0, recycle=True) as pool:
        async with pool.acquire() as rt:
            await rt.exec(["sh", "-c", "echo x > /work/x"], user=rt.policy_user)
        assert pool.resetting == 1
        pool_id = pool.id
    assert rt.closed
    await drain_removals()
    assert pool_containers(docker_client, pool_id) == []


@pytest.mark.docker
async def test_a_block_that_raised_still_recycles_and_take_never_does() -> None:
    async with RuntimePool(RECYCLABLE, size=0, recycle=True) as pool:
        with pytest.raises(ZeroDivisionError):
            async with pool.acquire() as rt:
                await rt.write("/work/half", b"done")
                raise ZeroDivisionError
        with anyio.fail_after(60):
            while pool.resetting:  # noqa: ASYNC110 - the pool's counter has no event
                await anyio.sleep(0.02)
        assert pool.recycling is not None and pool.recycling.recycled == 1
        taken = await pool.take()
        assert taken.sandbox_id == rt.sandbox_id
        assert not await taken.exists("/work/half")
        await taken.close()
        assert pool.ready == 0 and pool.resetting == 0


@pytest.mark.docker
async def test_a_prepared_world_is_put_back_as_it_was_at_start() -> None:
    """A pool whose ``prepare`` lays out a task's files in the workdir: the policy changes,
    removes and adds files there; the next acquirer finds the task's files as they were."""
    world = (
        "mkdir -p src && printf 'def f():\\n    return 1\\n' > src/task.py && "
        "printf spec > README && ln -s src/task.py link && chmod 640 README"
    )

    async def prepare(rt: Runtime) -> None:
        assert (await rt.exec(["sh", "-c", world], user=rt.policy_user)).ok

    look = "find /work -printf '%P %y %u %m %s\\n' | sort; cat /work/src/task.py"
    async with RuntimePool(RECYCLABLE, size=0, recycle=True, prepare=prepare) as pool:
        async with pool.acquire() as rt:
            before = (await rt.exec(["sh", "-c", look])).stdout
            assert "src/task.py f nobody" in before and "link l nobody" in before, before
            vandal = "echo 'def f(): return 2' > src/task.py; rm README; echo x > new; rm link"
            assert (await rt.exec(["sh", "-c", vandal], user=rt.policy_user)).ok
        with anyio.fail_after(60):
            while pool.resetting:  # noqa: ASYNC110 - the pool's counter has no event
                await anyio.sleep(0.02)
        async with pool.acquire() as again:
            assert again.sandbox_id == rt.sandbox_id
            assert (await again.exec(["sh", "-c", look])).stdout == before


@pytest.mark.docker
async def test_a_sandbox_whose_channel_was_distrusted_is_destroyed_not_recycled() -> None:
    async with RuntimePool(RECYCLABLE, size=0, recycle=True) as pool:
        async with pool.acquire() as rt:
            supervisor = rt._channel_supervisor
            assert supervisor is not None
            supervisor._distrust("a forged frame (played)")
            assert rt.channel_info.state == "distrusted"
        with anyio.fail_after(60):
            while pool.resetting:  # noqa: ASYNC110 - the pool's counter has no event
                await anyio.sleep(0.02)
        assert pool.recycling is not None and pool.recycling.discarded == 1
        assert rt.closed and pool.ready == 0
