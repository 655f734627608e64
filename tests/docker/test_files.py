"""Docker-specific file semantics of the archive-API path (root sandboxes) and of the
exec path (sandboxes whose user is not root)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtimes import (
    OutputLimitExceededError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    open_runtime,
    remove_snapshot,
)
from runtimes.pytest_plugin import DockerRuntimeFactory
from tests.docker.conftest import IMAGE

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


async def test_rewrite_keeps_the_mode_of_an_existing_file(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory() as rt:
        await rt.write("run.sh", b"#!/bin/sh\necho one\n")
        await rt.exec(["chmod", "750", "run.sh"])
        await rt.write("run.sh", b"#!/bin/sh\necho two\n")
        assert (await rt.exec(["stat", "-c", "%a", "run.sh"])).stdout == "750\n"
        assert (await rt.exec(["./run.sh"])).stdout == "two\n"


async def test_write_through_a_symlink_writes_its_target(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory() as rt:
        await rt.write("/srv/real.txt", b"old")
        await rt.exec(["ln", "-s", "/srv/real.txt", "/work/link.txt"])
        await rt.write("/work/link.txt", b"new")
        assert (await rt.exec(["readlink", "/work/link.txt"])).stdout == "/srv/real.txt\n"
        assert await rt.read("/srv/real.txt") == b"new"


async def test_created_parents_do_not_touch_existing_directories(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory() as rt:
        await rt.write("/tmp/new/deeper/file.txt", b"x")
        assert (await rt.exec(["stat", "-c", "%a", "/tmp"])).stdout == "1777\n"
        assert (await rt.exec(["stat", "-c", "%a %U", "/tmp/new/deeper"])).stdout == "755 root\n"
        with pytest.raises(SandboxNotADirectoryError):
            await rt.write("/tmp/new/deeper/file.txt/under/it", b"y")


async def test_download_of_a_tree_over_the_read_limit_is_refused(
    docker_runtime_factory: DockerRuntimeFactory, tmp_path: Path
) -> None:
    async with docker_runtime_factory(read_limit=1024 * 1024) as rt:
        await rt.exec(["sh", "-c", "mkdir -p big && head -c 3000000 /dev/urandom > big/blob"])
        with pytest.raises(OutputLimitExceededError):
            await rt.download("big", tmp_path / "big")
        with pytest.raises(OutputLimitExceededError):
            await rt.read("big/blob")


async def test_non_root_user_gets_permission_errors_from_files(
    docker_runtime_factory: DockerRuntimeFactory, tmp_path: Path
) -> None:
    async with docker_runtime_factory(user="nobody") as rt:
        with pytest.raises(SandboxPermissionError):
            await rt.read("/etc/shadow")
        with pytest.raises(SandboxPermissionError):
            await rt.write("/etc/vf-not-allowed", b"x")
        await rt.write("mine/notes.txt", b"written as nobody")
        assert (await rt.exec(["stat", "-c", "%U", "mine/notes.txt"])).stdout == "nobody\n"
        (tmp_path / "tree" / "sub").mkdir(parents=True)
        (tmp_path / "tree" / "sub" / "a.txt").write_bytes(b"a")
        await rt.upload(tmp_path / "tree", "uploaded")
        assert (await rt.exec(["stat", "-c", "%U", "uploaded/sub/a.txt"])).stdout == "nobody\n"
        await rt.download("uploaded", tmp_path / "back")
        assert (tmp_path / "back" / "sub" / "a.txt").read_bytes() == b"a"


@pytest.fixture
def nonroot_image(docker_client: Any) -> Iterator[str]:
    """The base image with ``USER nobody`` (committed, not built; removed afterwards)."""
    repository, version = "vf-sandbox/test-user-nobody", uuid.uuid4().hex[:8]
    tag = f"{repository}:{version}"
    container = docker_client.containers.create(IMAGE, ["true"], network_mode="none")
    try:
        container.commit(repository=repository, tag=version, changes=["USER nobody"])
    finally:
        container.remove(force=True)
    try:
        yield tag
    finally:
        docker_client.images.remove(tag, force=True)


async def test_an_images_own_user_is_the_sandbox_user(
    nonroot_image: str, docker_runtime_factory: DockerRuntimeFactory
) -> None:
    async with docker_runtime_factory(image=nonroot_image) as rt:
        assert (await rt.exec(["id", "-un"])).stdout == "nobody\n"
        assert (await rt.exec(["stat", "-c", "%U", rt.workdir])).stdout == "nobody\n"
        await rt.write("by-image-user.txt", b"x")
        assert (await rt.exec(["stat", "-c", "%U", "by-image-user.txt"])).stdout == "nobody\n"
        with pytest.raises(SandboxPermissionError):
            await rt.read("/etc/shadow")


async def test_an_images_own_user_keeps_root_capabilities_out_of_its_reach_and_its_forks(
    nonroot_image: str, docker_runtime_factory: DockerRuntimeFactory
) -> None:
    """Under no-new-privileges a root exec in a container started as ``nobody`` would have no
    capability at all: the keep-alive runs as root, the commands and the agent as the
    image's user, and a fork runs as its source did."""
    probe = "stat -c %U /proc/1 && grep CapEff /proc/self/status"
    async with docker_runtime_factory(image=nonroot_image) as rt:
        owner, effective = (await rt.exec(["sh", "-c", probe])).stdout.split("\n", 1)
        assert owner == "root" and effective.split()[1] == "0000000000000000"
        await rt.write("from-source.txt", b"kept")
        snap = await rt.snapshot()
    try:
        config = {"type": "docker", "image": nonroot_image}
        async with open_runtime(config, snapshot=snap) as fork:
            assert (await fork.exec(["id", "-un"])).stdout == "nobody\n"
            assert await fork.read("from-source.txt") == b"kept"
            await fork.write("in-fork.txt", b"x")
            assert (await fork.exec(["stat", "-c", "%U", "in-fork.txt"])).stdout == "nobody\n"
    finally:
        await remove_snapshot(snap)
