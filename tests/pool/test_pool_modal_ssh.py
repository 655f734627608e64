"""RuntimePool on the other remote backends: Modal (against the fake SDK of ``tests/modal``)
and SSH (against the ``vf-sandbox/sshd`` container): distinct started sandboxes, tagged with
the pool, gone after their block, and nothing left once the pool is closed."""

from __future__ import annotations

import types

import anyio
import modal.exception as modal_exc
import pytest

from runtimes import ProvisioningError
from runtimes.lifecycle import State
from runtimes.pool import POOL, RuntimePool
from runtimes.ssh import SSHConfig, SSHRuntime
from tests.channel.conftest import sshd  # noqa: F401 - fixture (one server per module)
from tests.modal.fake_modal import FakeModalService
from tests.modal.support import fake_config
from tests.ssh.sshd import SSHServer

# ---------------------------------------------------------------------- modal (fake SDK)


@pytest.mark.docker
def test_modal_pool_hands_out_distinct_started_sandboxes_and_leaves_nothing(
    fake_service: FakeModalService,
    fake_modal: types.ModuleType,
) -> None:
    async def body() -> tuple[str, list[str]]:
        ids: list[str] = []
        async with RuntimePool(fake_config(), size=2) as pool:
            await pool.wait_ready()
            for _ in range(3):
                async with pool.acquire() as rt:
                    assert rt.state is State.OPEN
                    assert (await rt.exec(["echo", "up"])).stdout == "up\n"
                    assert rt.sandbox_id is not None
                    ids.append(rt.sandbox_id)
                record = fake_service.load(rt.sandbox_id)
                assert record.status == "terminated", "terminated at the block's end"
            return pool.id, ids

    pool_id, ids = anyio.run(body)
    assert len(set(ids)) == 3
    tagged = [c for c in fake_service.created if c.kwargs["tags"].get(POOL) == pool_id]
    assert len(tagged) == len(fake_service.created) == 5, "2, then one replacement per acquire"
    assert all(record.status == "terminated" for record in fake_service.records())
    assert fake_service.running_containers() == []


@pytest.mark.docker
def test_modal_pool_reports_refused_creations_and_recovers(
    fake_service: FakeModalService,
    fake_modal: types.ModuleType,
) -> None:
    fake_service.create_failures = [modal_exc.InvalidError("unknown GPU type")] * 2

    async def body() -> None:
        pool = RuntimePool(fake_config(), size=0, create_attempts=2, retry_backoff=(0.0, 0.0))
        async with pool:
            with pytest.raises(ProvisioningError) as info:
                await pool.take()
            assert fake_service.create_attempts == 2, "exactly create_attempts tries"
            assert isinstance(info.value.__cause__, ProvisioningError)
            async with pool.acquire() as rt:  # the service accepts creations again
                assert (await rt.exec(["true"])).exit_code == 0

    anyio.run(body)
    assert fake_service.running_containers() == []


# ---------------------------------------------------------------------- ssh


async def _pooled_dirs(config: SSHConfig, pool_id: str) -> list[str]:
    return [i.id for i in await SSHRuntime.list_sandboxes(config) if i.labels.get(POOL) == pool_id]


@pytest.mark.ssh
@pytest.mark.docker
def test_ssh_pool_hands_out_distinct_sandboxes_and_leaves_nothing(sshd: SSHServer) -> None:  # noqa: F811
    config = sshd.config()

    async def body() -> None:
        workdirs: list[str] = []
        async with RuntimePool(config, size=2) as pool:
            await pool.wait_ready()
            assert len(await _pooled_dirs(config, pool.id)) == 2
            for _ in range(3):
                async with pool.acquire() as rt:
                    result = await rt.exec(["sh", "-c", "test ! -e mine && touch mine && pwd"])
                    assert result.exit_code == 0, "another acquirer used this sandbox"
                    workdirs.append(result.stdout.strip())
        assert len(set(workdirs)) == 3
        assert await _pooled_dirs(config, pool.id) == []

    anyio.run(body)
