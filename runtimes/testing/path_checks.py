"""Conformance checks of ``lstat`` and ``mkdir``: what is at a path, seen without following a
link, and one fresh directory made exactly as asked (registered in
:data:`runtimes.testing.checks.CHECKS`)."""

from __future__ import annotations

from ..base import Runtime
from ..errors import SandboxError, SandboxFileExistsError, SandboxInvalidArgumentError
from .checks import check, expect_raises, scratch_dir


@check(shares_sandbox=True)
async def check_lstat_kinds(rt: Runtime) -> None:
    """lstat tells a file (size, one link, its first bytes up to the cap + 1), a directory, a
    symlink (its target, never followed, even dangling) and nothing there (``absent``)."""
    base = await scratch_dir(rt)
    await rt.write(f"{base}/f", b"hello world")
    made = await rt.exec(["sh", "-c", 'ln -s f "$1/l" && ln -s nowhere "$1/d"', "sh", base])
    assert made.exit_code == 0, made
    info = await rt.lstat(f"{base}/f", content_limit=4)
    assert (info.kind, info.size, info.links, info.content) == ("file", 11, 1, b"hello")
    assert (await rt.lstat(f"{base}/f")).content == b"", "content only when asked for"
    assert (await rt.lstat(base)).kind == "directory"
    link = await rt.lstat(f"{base}/l", content_limit=100)
    assert (link.kind, link.target, link.content) == ("symlink", "f", b"")
    assert (await rt.lstat(f"{base}/d")).target == "nowhere"
    assert (await rt.lstat(f"{base}/missing")).kind == "absent"
    assert (await rt.lstat(f"{base}/f/under")).kind == "absent"  # a file as a parent
    await expect_raises(SandboxInvalidArgumentError, rt.lstat(f"{base}/f", content_limit=-1))


@check(shares_sandbox=True)
async def check_mkdir_fresh_and_exact(rt: Runtime) -> None:
    """mkdir makes one directory with exactly the mode asked (no umask), refuses a path
    where anything is (``SandboxFileExistsError``, a dangling link included) and a parent
    that is a link."""
    base = await scratch_dir(rt)
    await rt.mkdir(f"{base}/a", mode=0o1770)
    info = await rt.lstat(f"{base}/a")
    assert (info.kind, info.mode) == ("directory", 0o1770), (info.kind, oct(info.mode))
    await expect_raises(SandboxFileExistsError, rt.mkdir(f"{base}/a"))
    made = await rt.exec(["sh", "-c", 'ln -s nowhere "$1/d" && ln -s a "$1/la"', "sh", base])
    assert made.exit_code == 0, made
    await expect_raises(SandboxFileExistsError, rt.mkdir(f"{base}/d"))
    await expect_raises(SandboxError, rt.mkdir(f"{base}/la/sub"))
    assert (await rt.lstat(f"{base}/a/sub")).kind == "absent", "made through the link"
