"""Attack class 1, the other way: the host reads a tree a policy may have written.

A Docker ``build`` context is read on the host and sent to the engine, and the image it makes
runs the next sandbox. A context can be a directory the policy wrote (a workspace downloaded
with ``links="keep"``, say): a symlink in it to a host file (``~/.ssh/id_rsa``,
``/etc/shadow``) would copy that file into an image the policy can read, and a FIFO would
hang the host, a huge file exhaust it. These tests plant those shapes and check the host
refuses them with a typed :class:`BuildContextError` naming the path, never reads through a
link, and reads nothing past ``max_context``.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest

from runtimes import BuildContextError, ProvisioningError, open_runtime
from runtimes.docker.build_context import BuildSpec, pack_context

pytestmark = [pytest.mark.anyio, pytest.mark.attack(1)]

SECRET = b"host-secret-never-sent\n"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def context(tmp_path: Path) -> Path:
    """A context directory next to a host secret the policy would like to read."""
    (tmp_path / "secret").write_bytes(SECRET)
    root = tmp_path / "ctx"
    root.mkdir()
    (root / "Dockerfile").write_text("FROM vf-sandbox/base:bookworm\nCOPY . /ctx\n")
    return root


def _members(root: Path, **spec: object) -> dict[str, tarfile.TarInfo]:
    packed = pack_context(BuildSpec(context=str(root), **spec))  # type: ignore[arg-type]
    try:
        with tarfile.open(fileobj=packed.archive) as tar:
            members = {m.name: m for m in tar.getmembers()}
            for member in members.values():
                if member.isfile():
                    data = tar.extractfile(member)
                    assert data is not None and SECRET not in data.read()
            return members
    finally:
        packed.close()


@pytest.mark.parametrize(
    "target",
    ["../../secret", "/etc/passwd", "../x/../../secret", "../alias/../secret"],
)
def test_a_symlink_out_of_the_context_is_refused(context: Path, target: str) -> None:
    (context / "sub").mkdir()
    (context / "sub" / "link").symlink_to(target)
    with pytest.raises(BuildContextError, match="outside the context") as caught:
        pack_context(BuildSpec(context=str(context)))
    assert caught.value.path == "sub/link"


def test_a_directory_symlink_out_of_the_context_is_refused_not_walked(context: Path) -> None:
    (context / "up").symlink_to(context.parent)
    with pytest.raises(BuildContextError, match=r"'up'.*outside the context"):
        pack_context(BuildSpec(context=str(context)))


def test_a_symlink_inside_the_context_is_sent_as_a_link_never_followed(context: Path) -> None:
    (context / "data").mkdir()
    (context / "data" / "file").write_bytes(b"inside\n")
    (context / "alias").symlink_to("data/file")
    members = _members(context)
    assert members["alias"].issym() and members["alias"].linkname == "data/file"
    assert members["data/file"].isfile() and members["data/file"].uid == 0


def test_an_ignored_escaping_link_is_left_out_not_refused(context: Path) -> None:
    (context / ".dockerignore").write_text("cache\n")
    (context / "cache").symlink_to("/etc/passwd")
    members = _members(context)
    assert "cache" not in members and ".dockerignore" in members


def test_a_fifo_in_the_context_is_refused_without_blocking(context: Path) -> None:
    os.mkfifo(context / "pipe")
    with pytest.raises(BuildContextError, match=r"'pipe'.*not a file, directory or symlink"):
        pack_context(BuildSpec(context=str(context)))


def test_an_oversized_context_is_refused_before_the_file_is_read(context: Path) -> None:
    with open(context / "huge.bin", "wb") as sparse:  # 64 GiB, no disk used
        sparse.truncate(64 << 30)
    with pytest.raises(BuildContextError, match=r"larger than max_context=8MiB") as caught:
        pack_context(BuildSpec(context=str(context), max_context="8MiB"))
    assert caught.value.path == "huge.bin"


def test_many_small_files_count_their_headers_against_the_bound(context: Path) -> None:
    for index in range(8300):  # 8300 x 1 KiB of headers > 8 MiB, with empty files
        (context / f"f{index}").touch()
    with pytest.raises(BuildContextError, match="larger than max_context"):
        pack_context(BuildSpec(context=str(context), max_context="8MiB"))


async def test_opening_a_config_whose_context_escapes_is_a_typed_error(context: Path) -> None:
    """The runtime refuses it at start, before the engine sees a byte (no image, no container)."""
    (context / "key").symlink_to(context.parent / "secret")
    runtime = open_runtime({"type": "docker", "build": {"context": str(context)}})
    with pytest.raises(BuildContextError, match="outside the context") as caught:
        await runtime.start()
    assert isinstance(caught.value, ProvisioningError) and caught.value.path == "key"
    assert runtime.sandbox_id is None


def test_a_context_nested_past_the_depth_bound_is_refused_typed(context: Path) -> None:
    deep = context
    for _ in range(130):
        deep = deep / "d"
    deep.mkdir(parents=True)
    with pytest.raises(BuildContextError, match="deeper than 128 directories"):
        pack_context(BuildSpec(context=str(context)))


def test_a_context_named_through_a_symlink_is_read(context: Path, tmp_path: Path) -> None:
    """The context's own path is the user's: a link to it is followed, links in it are not."""
    (tmp_path / "ctx-link").symlink_to(context)
    assert "Dockerfile" in _members(tmp_path / "ctx-link")
