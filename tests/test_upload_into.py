"""``upload()``'s edges: a file into ``d/``, and a failed upload leaving nothing behind.

The conformance kit (``upload_file_into_directory``) proves ``d/`` on every backend; here a
failure that strikes after the upload wrote (a full disk, a cancelled transfer) is played
on the subprocess runtime: the directories the upload created are gone again, the ones that
were there before are kept.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from runtimes import SandboxNoSpaceError, SubprocessConfig, SubprocessRuntime

pytestmark = pytest.mark.anyio


class _FailsAfterWriting(SubprocessRuntime):
    """A sandbox whose disk fills up right after an upload wrote its data."""

    async def _upload(self, source: Path, remote: str) -> None:
        await super()._upload(source, remote)
        raise SandboxNoSpaceError(remote)


@pytest.fixture
async def rt() -> AsyncIterator[_FailsAfterWriting]:
    async with _FailsAfterWriting(SubprocessConfig()) as runtime:
        yield runtime


@pytest.fixture
def note(tmp_path: Path) -> Path:
    path = tmp_path / "note.txt"
    path.write_bytes(b"n")
    return path


async def test_upload_of_a_file_into_a_directory(note: Path) -> None:
    async with SubprocessRuntime(SubprocessConfig()) as runtime:
        await runtime.upload(note, "d/")
        await runtime.upload(note, "d/e/")
        assert await runtime.read("d/note.txt") == b"n"
        assert [e.name for e in await runtime.list("d/e")] == ["note.txt"]


async def test_a_failed_upload_into_d_leaves_no_d(rt: _FailsAfterWriting, note: Path) -> None:
    with pytest.raises(SandboxNoSpaceError):
        await rt.upload(note, "a/b/")
    assert not await rt.exists("a")


async def test_a_failed_upload_keeps_what_was_there(rt: _FailsAfterWriting, note: Path) -> None:
    await rt.write("a/old.txt", b"old")
    with pytest.raises(SandboxNoSpaceError):
        await rt.upload(note, "a/b/c/")
    assert [e.name for e in await rt.list("a")] == ["old.txt"]


async def test_a_failed_directory_upload_leaves_no_tree(
    rt: _FailsAfterWriting, tmp_path: Path, note: Path
) -> None:
    with pytest.raises(SandboxNoSpaceError):
        await rt.upload(tmp_path, "tree")
    assert not await rt.exists("tree")


async def test_a_cancelled_upload_leaves_no_d(note: Path) -> None:
    class _Slow(SubprocessRuntime):
        async def _upload(self, source: Path, remote: str) -> None:
            await super()._upload(source, remote)
            await anyio.sleep(30)

    async with _Slow(SubprocessConfig()) as runtime:
        with anyio.move_on_after(0.5):
            await runtime.upload(note, "slow/")
        assert not await runtime.exists("slow")
