"""Conformance checks of listings (``list``, ``stat`` and ``glob`` with their typed errors,
hostile names and the entry cap) and of the transfers' edges (a file uploaded into ``d/``,
links kept by a download, a refused download creating nothing), registered in
:data:`runtimes.testing.checks.CHECKS`."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from ..base import Runtime
from ..errors import (
    ListingLimitExceededError,
    SandboxFileNotFoundError,
    SandboxNotADirectoryError,
    UnsafeArchiveMemberError,
)
from .checks import assert_names, check, expect_raises, scratch_dir


async def _tree(rt: Runtime) -> str:
    """A scratch tree: ``a.txt`` (5 bytes), ``sub/b.py``, ``sub/deep/c.py``, ``.hidden/d.py``,
    a link ``ln`` to ``/etc`` and a file named with a newline and a non-UTF-8 byte."""
    root = await scratch_dir(rt)
    await rt.write(f"{root}/a.txt", b"hello")
    await rt.write(f"{root}/sub/b.py", b"")
    await rt.write(f"{root}/sub/deep/c.py", b"")
    await rt.write(f"{root}/.hidden/d.py", b"")
    await rt.exec(["ln", "-s", "/etc", f"{root}/ln"])
    await rt.exec(["chmod", "640", f"{root}/a.txt"])
    return root


WEIRD = b"line\nbreak\xff".decode("utf-8", "surrogateescape")
"""A name with a newline and a byte that is not UTF-8."""


@check(shares_sandbox=True)
async def check_list_directory(rt: Runtime) -> None:
    """list() gives every entry, typed (kind, size, mode, mtime, link target), sorted."""
    root = await _tree(rt)
    await rt.exec(["sh", "-c", 'printf x > "$(printf "$1/line\\nbreak\\377")"', "sh", root])
    entries = await rt.list(root)
    names = [e.name for e in entries]
    assert names == sorted([".hidden", "a.txt", "ln", "sub", WEIRD]), names
    by = {e.name: e for e in entries}
    assert by["a.txt"].kind == "file" and by["a.txt"].size == 5, by["a.txt"]
    assert by["a.txt"].mode == 0o640 and by["a.txt"].path == f"{root}/a.txt", by["a.txt"]
    assert abs(by["a.txt"].mtime - time.time()) < 24 * 3600, by["a.txt"]
    assert by["sub"].kind == "directory" and by["sub"].target is None, by["sub"]
    assert by["ln"].kind == "symlink" and by["ln"].target == "/etc", by["ln"]
    assert by[WEIRD].size == 1 and by[WEIRD].path == f"{root}/{WEIRD}", by[WEIRD]
    relative = await rt.list(root.rsplit("/", 1)[1])
    assert [e.path for e in relative] == [e.path for e in entries]


@check(shares_sandbox=True)
async def check_list_errors(rt: Runtime) -> None:
    """list() of a missing path or of a file raises the typed error naming it."""
    root = await _tree(rt)
    exc = await expect_raises(SandboxFileNotFoundError, rt.list(f"{root}/missing"))
    assert_names(exc, f"{root}/missing")
    exc = await expect_raises(SandboxNotADirectoryError, rt.list(f"{root}/a.txt"))
    assert_names(exc, f"{root}/a.txt")
    exc = await expect_raises(ListingLimitExceededError, rt.list(root, max_entries=3))
    assert "max_entries" in str(exc), exc
    assert len(await rt.list(root, max_entries=4)) == 4


@check(shares_sandbox=True)
async def check_stat(rt: Runtime) -> None:
    """stat() describes one path without following a link; missing paths are typed."""
    root = await _tree(rt)
    info = await rt.stat(f"{root}/a.txt")
    assert (info.name, info.kind, info.size, info.mode) == ("a.txt", "file", 5, 0o640), info
    link = await rt.stat(f"{root}/ln")
    assert link.kind == "symlink" and link.target == "/etc", link
    assert (await rt.stat(root)).kind == "directory"
    exc = await expect_raises(SandboxFileNotFoundError, rt.stat(f"{root}/missing"))
    assert_names(exc, f"{root}/missing")
    await expect_raises(SandboxNotADirectoryError, rt.stat(f"{root}/a.txt/x"))


@check(shares_sandbox=True)
async def check_glob(rt: Runtime) -> None:
    """glob() matches like Python's recursive glob: ``**``, hidden names, links not descended."""
    root = await _tree(rt)
    found = [e.path for e in await rt.glob(f"{root}/**/*.py")]
    assert found == [f"{root}/sub/b.py", f"{root}/sub/deep/c.py"], found
    found = [e.path for e in await rt.glob(f"{root}/*")]
    assert found == [f"{root}/a.txt", f"{root}/ln", f"{root}/sub"], found
    found = [e.path for e in await rt.glob(f"{root}/.*/*.py")]
    assert found == [f"{root}/.hidden/d.py"], found
    assert [e.kind for e in await rt.glob(f"{root}/s?b")] == ["directory"]
    assert await rt.glob(f"{root}/missing/*") == []
    assert [e.name for e in await rt.glob(f"{root}/a.txt")] == ["a.txt"]


# ---------------------------------------------------------------------- transfers


@check(shares_sandbox=True)
async def check_upload_file_into_directory(rt: Runtime) -> None:
    """upload(file, "d/") writes d/<name>, creating d; onto a file it fails, leaving nothing."""
    root = await scratch_dir(rt)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "notes.txt"
        source.write_bytes(b"notes")
        await rt.upload(source, f"{root}/d/")
        assert await rt.read(f"{root}/d/notes.txt") == b"notes"
        await rt.write(f"{root}/file", b"")
        await expect_raises(SandboxNotADirectoryError, rt.upload(source, f"{root}/file/"))
        assert await rt.read(f"{root}/file") == b""


@check(shares_sandbox=True)
async def check_download_keeps_links(rt: Runtime) -> None:
    """download(links="keep") keeps a venv's absolute links as links; a refused download
    names the options and leaves its destination (and its parents) uncreated."""
    root = await scratch_dir(rt)
    await rt.write(f"{root}/venv/lib/site.py", b"x = 1\n")
    await rt.exec(["ln", "-s", "/usr/bin/python3", f"{root}/venv/python"])
    await rt.exec(["ln", "-s", "lib/site.py", f"{root}/venv/site"])
    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "new" / "venv"
        try:
            await rt.download(f"{root}/venv", dest)
        except UnsafeArchiveMemberError as exc:
            assert "links='keep'" in str(exc) and "skip_unsafe=True" in str(exc), exc
            assert os.listdir(tmp) == [], os.listdir(tmp)
        else:  # the subprocess backend copies its host tree keeping links
            assert os.readlink(dest / "python") == "/usr/bin/python3"
            shutil.rmtree(Path(tmp) / "new")
        await rt.download(f"{root}/venv", dest, links="keep")
        assert os.readlink(dest / "python") == "/usr/bin/python3"
        assert os.readlink(dest / "site") == "lib/site.py"
        assert (dest / "lib" / "site.py").read_bytes() == b"x = 1\n"
        assert sorted(os.listdir(tmp)) == ["new"] and os.listdir(dest.parent) == ["venv"]
