"""Docker snapshots: the committed image is the policy's world, but the runtime's machinery in a
fork only trusts what it can check (an interpreter the policy replaced is never run by the
channel, over a whole chain of snapshots); the image is labelled and in use while forks run;
forks are never kept because their snapshot was; the exit backstop removes it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runtimes import (
    SandboxError,
    SandboxInvalidArgumentError,
    open_runtime,
    ownership,
    remove_snapshot,
)
from runtimes.docker import DockerConfig, DockerRuntime
from runtimes.snapshot import SNAPSHOT, SandboxSnapshot

from .support import Backend, child_process

pytestmark = [pytest.mark.docker]

ROOT = DockerConfig(policy_user=None)

FAKE_PYTHON = r"""
set -e
printf '#!/bin/sh\ntouch /tmp/pwned\nexec /usr/bin/python3 "$@"\n' > /usr/local/bin/python3
chmod 0755 /usr/local/bin/python3
"""
"""A python3 ahead of the image's on PATH that leaves a mark when it runs."""


@pytest.fixture
def docker_api() -> Iterator[Any]:
    import docker

    client = docker.from_env()
    try:
        yield client.api
    finally:
        client.close()


@pytest.mark.anyio
async def test_an_interpreter_the_source_replaced_is_never_run_by_a_forks_channel() -> None:
    async with open_runtime(ROOT) as source:
        planted = await source.exec(["sh", "-c", FAKE_PYTHON])
        assert planted.exit_code == 0, planted
        snap = await source.snapshot()
        try:
            assert snap.untrusted is not None and "/usr/local/bin/python3" in snap.untrusted
            async with open_runtime(ROOT, snapshot=snap) as fork:
                info = fork.channel_info
                assert info.state == "distrusted" and "cannot be trusted" in (info.reason or "")
                assert (await fork.exec(["echo", "plain path"])).stdout == "plain path\n"
                assert not await fork.exists("/tmp/pwned"), "the fake python3 never ran"
                second = await fork.snapshot()  # the fork's own diff is clean: inherited
            try:
                assert second.untrusted == snap.untrusted
                listed = {s.id: s for s in await DockerRuntime.list_snapshots(ROOT)}
                assert listed[second.id].untrusted == snap.untrusted, "kept in the image's labels"
                async with open_runtime(ROOT, snapshot=second) as grandchild:
                    assert grandchild.channel_info.state == "distrusted"
                    assert not await grandchild.exists("/tmp/pwned")
            finally:
                await remove_snapshot(second)
        finally:
            await remove_snapshot(snap)


@pytest.mark.anyio
async def test_what_a_policy_usually_leaves_keeps_the_channel_of_a_fork() -> None:
    benign = (
        "echo notes > /work/python_notes.txt && mkdir -p /usr/local/lib/python3.11/dist-packages"
        " && echo 'x = 1' > /usr/local/lib/python3.11/dist-packages/thing.py"
    )
    async with open_runtime(ROOT) as source:
        assert (await source.exec(["sh", "-c", benign])).exit_code == 0
        snap = await source.snapshot()
        try:
            assert snap.untrusted is None
            async with open_runtime(ROOT, snapshot=snap) as fork:
                assert fork.channel_info.state == "running"
                assert (await fork.exec(["true"])).exit_code == 0
                assert fork.channel_info.served >= 1
        finally:
            await remove_snapshot(snap)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("config", "trusted"),
    [(DockerConfig(), True), (ROOT, False)],
    ids=["policy-account", "root-policy"],
)
async def test_root_changes_count_as_the_hosts_only_where_the_policy_has_its_own_account(
    config: DockerConfig, trusted: bool
) -> None:
    """With a policy account, a system library root added is the host's own setup (an
    ``apt-get install``): forks keep their channel. Without one, root may be the policy."""
    library = "echo lib > /usr/lib/x86_64-linux-gnu/libvf-snapshot-test.so"
    async with open_runtime(config) as source:
        assert (await source.exec(["sh", "-c", library])).exit_code == 0
        snap = await source.snapshot()
        try:
            assert (snap.untrusted is None) is trusted, snap.untrusted
            async with open_runtime(config, snapshot=snap) as fork:
                assert (fork.channel_info.state == "running") is trusted
                assert await fork.read("/usr/lib/x86_64-linux-gnu/libvf-snapshot-test.so")
        finally:
            await remove_snapshot(snap)


@pytest.mark.anyio
async def test_the_image_is_in_use_while_a_fork_runs_and_forks_are_never_kept(
    docker_api: Any,
) -> None:
    async with open_runtime(DockerConfig()) as source:
        snap = await source.snapshot(keep=True, labels={"team": "rl"})
    try:
        labels = docker_api.inspect_image(snap.id)["Config"]["Labels"]
        assert labels[SNAPSHOT] and labels["team"] == "rl" and labels[ownership.KEEP] == "true"
        assert labels[ownership.CREATOR] == ownership.CREATOR_ID
        async with open_runtime(DockerConfig(), snapshot=snap) as fork:
            container = docker_api.inspect_container(fork.sandbox_id)["Config"]["Labels"]
            assert container[ownership.KEEP] == "false", "a kept snapshot makes no kept forks"
            with pytest.raises(SandboxError, match="still uses it"):
                await remove_snapshot(snap)
        await remove_snapshot(snap)
        assert snap.id not in {s.id for s in await DockerRuntime.list_snapshots()}
    finally:
        await remove_snapshot(snap)


@pytest.mark.anyio
async def test_a_fork_is_a_new_container_and_keeps_the_workdir_of_its_config(
    docker_api: Any,
) -> None:
    config = DockerConfig(workdir="/srv/app")
    async with open_runtime(config) as source:
        await source.exec(["sh", "-c", "echo hi > note"], user=source.policy_user)
        snap = await source.snapshot()
        try:
            attached = DockerConfig(container=str(source.sandbox_id))
            with pytest.raises(SandboxInvalidArgumentError, match="new container"):
                open_runtime(attached, snapshot=snap)
            async with open_runtime(config, snapshot=snap) as fork:
                assert fork.workdir == "/srv/app"
                assert await fork.read("note") == b"hi\n"
                user = docker_api.inspect_image(snap.id)["Config"].get("User", "")
                assert user == "", "the container's config is kept (the image's user)"
        finally:
            await remove_snapshot(snap)


def test_the_exit_backstop_removes_the_image(docker_api: Any) -> None:
    import docker.errors

    child, said = child_process(Backend("docker", DockerConfig()), "exit")
    assert child.wait(120) == 0, child.communicate()
    taken = SandboxSnapshot.model_validate(said["snapshot"])
    with pytest.raises(docker.errors.ImageNotFound):
        docker_api.inspect_image(taken.id)
