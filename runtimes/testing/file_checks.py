"""Conformance checks of files and of the lifecycle: round trips, typed errors, exists and
remove, trees (registered in :data:`runtimes.testing.checks.CHECKS`)."""

from __future__ import annotations

import errno
import hashlib
import random
import tempfile
from pathlib import Path

import anyio

from ..base import Runtime
from ..errors import (
    OutputLimitExceededError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    SandboxUnavailableError,
)
from ..models import MiB
from .checks import (
    SCRATCH_PREFIX,
    CheckSkipped,
    assert_names,
    check,
    expect_raises,
    is_root,
    scratch_dir,
)

# ---------------------------------------------------------------------- files: round trips


@check(shares_sandbox=True)
async def check_file_round_trip(rt: Runtime) -> None:
    """write then read returns the same bytes, and exec sees the file."""
    path = f"{await scratch_dir(rt)}/hello.txt"
    await rt.write(path, b"hello\n")
    assert await rt.read(path) == b"hello\n"
    assert (await rt.exec(["cat", path])).stdout_bytes == b"hello\n"


@check(shares_sandbox=True)
async def check_file_empty(rt: Runtime) -> None:
    """An empty file round-trips."""
    path = f"{await scratch_dir(rt)}/empty"
    await rt.write(path, b"")
    assert await rt.read(path) == b""
    assert (await rt.exec(["wc", "-c", path])).stdout.split()[0] == "0"


@check(shares_sandbox=True)
async def check_file_binary(rt: Runtime) -> None:
    """Every byte value, NULs and invalid UTF-8 round-trip."""
    path = f"{await scratch_dir(rt)}/binary.bin"
    data = bytes(range(256)) * 17 + b"\xff\xfe\x00\xc3\x28"
    await rt.write(path, data)
    assert await rt.read(path) == data
    sha = (await rt.exec(["sha256sum", path])).stdout.split()[0]
    assert sha == hashlib.sha256(data).hexdigest()


@check(shares_sandbox=True)
async def check_file_text(rt: Runtime) -> None:
    """write() accepts text and stores it as UTF-8."""
    path = f"{await scratch_dir(rt)}/text.txt"
    await rt.write(path, "ünïcødé ✓\n")
    assert await rt.read(path) == "ünïcødé ✓\n".encode()


@check(shares_sandbox=True)
async def check_file_50mib(rt: Runtime) -> None:
    """A 50 MiB file round-trips both ways, verified by hash inside the sandbox."""
    path = f"{await scratch_dir(rt)}/big.bin"
    data = random.randbytes(50 * MiB)
    await rt.write(path, data)
    sha = (await rt.exec(["sha256sum", path], timeout=120)).stdout.split()[0]
    assert sha == hashlib.sha256(data).hexdigest()
    back = await rt.read(path)
    assert len(back) == len(data) and back == data


@check(shares_sandbox=True)
async def check_file_special_names(rt: Runtime) -> None:
    """Names with spaces, quotes, newlines, unicode and leading dashes round-trip."""
    base = await scratch_dir(rt)
    names = [
        "with space",
        "it's",
        'say "hi"',
        "new\nline",
        "ünïcødé",
        "-dash",
        "$dollar",
        "back\\slash",
    ]
    for i, name in enumerate(names):
        await rt.write(f"{base}/{name}", f"content {i}".encode())
    for i, name in enumerate(names):
        assert await rt.read(f"{base}/{name}") == f"content {i}".encode(), name
        assert await rt.exists(f"{base}/{name}"), name
    listing = await rt.exec(
        ["sh", "-c", 'cd "$1" && for f in *; do printf "%s\\0" "$f"; done', "sh", base]
    )
    assert sorted(listing.stdout_bytes.decode().split("\0")[:-1]) == sorted(names), listing


@check(shares_sandbox=True)
async def check_write_creates_parents(rt: Runtime) -> None:
    """write() creates missing parent directories."""
    path = f"{await scratch_dir(rt)}/a/b/c/d.json"
    await rt.write(path, b"{}")
    assert await rt.read(path) == b"{}"


@check(shares_sandbox=True)
async def check_write_overwrites(rt: Runtime) -> None:
    """write() replaces old content entirely, a longer old file included."""
    path = f"{await scratch_dir(rt)}/over"
    await rt.write(path, b"a much longer original content")
    await rt.write(path, b"short")
    assert await rt.read(path) == b"short"


@check(shares_sandbox=True)
async def check_write_keeps_file_and_leaves_nothing_beside(rt: Runtime) -> None:
    """Overwriting keeps the file's mode, writes through a symlink (the link stays a link)
    and leaves no temporary file next to the target."""
    base = await scratch_dir(rt)
    await rt.write(f"{base}/tool.sh", b"#!/bin/sh\necho old\n")
    await rt.exec(["chmod", "750", f"{base}/tool.sh"])
    await rt.exec(["ln", "-s", "tool.sh", f"{base}/link"])
    await rt.write(f"{base}/link", b"#!/bin/sh\necho new\n")
    await rt.write(f"{base}/fresh", b"fresh")
    assert (await rt.exec([f"{base}/tool.sh"])).stdout == "new\n"
    state = await rt.exec(
        ["sh", "-c", 'cd "$1" && stat -c "%a" tool.sh && readlink link && ls -A', "sh", base]
    )
    assert state.stdout.split("\n")[:-1] == ["750", "tool.sh", "fresh", "link", "tool.sh"], (
        state.stdout
    )


@check(shares_sandbox=True)
async def check_relative_paths(rt: Runtime) -> None:
    """Relative file paths resolve against the workdir."""
    name = f"{SCRATCH_PREFIX}{random.randrange(1 << 30)}/x.txt"
    await rt.write(name, b"rel")
    assert await rt.read(f"{rt.workdir}/{name}") == b"rel"
    assert (await rt.exec(["cat", name])).stdout == "rel"
    assert await rt.exists(name)


@check(shares_sandbox=True)
async def check_read_follows_symlink(rt: Runtime) -> None:
    """read() follows a symlink to its target."""
    base = await scratch_dir(rt)
    await rt.write(f"{base}/target", b"through the link")
    await rt.exec(["ln", "-s", f"{base}/target", f"{base}/link"])
    assert await rt.read(f"{base}/link") == b"through the link"


# ---------------------------------------------------------------------- files: typed errors


@check(shares_sandbox=True)
async def check_read_missing(rt: Runtime) -> None:
    """Reading a missing file is SandboxFileNotFoundError (a FileNotFoundError) naming it."""
    path = f"{rt.workdir}/missing-{random.randrange(1 << 30)}.txt"
    exc = await expect_raises(SandboxFileNotFoundError, rt.read(path))
    assert isinstance(exc, FileNotFoundError) and not isinstance(exc, SandboxUnavailableError)
    assert exc.errno == errno.ENOENT and exc.filename == path, (exc.errno, exc.filename)
    assert_names(exc, path)


@check(shares_sandbox=True)
async def check_read_directory(rt: Runtime) -> None:
    """Reading a directory is SandboxIsADirectoryError naming it."""
    base = await scratch_dir(rt)
    exc = await expect_raises(SandboxIsADirectoryError, rt.read(base))
    assert isinstance(exc, IsADirectoryError)
    assert_names(exc, base)


@check(shares_sandbox=True)
async def check_write_to_directory(rt: Runtime) -> None:
    """Writing over a directory is SandboxIsADirectoryError naming it."""
    base = await scratch_dir(rt)
    exc = await expect_raises(SandboxIsADirectoryError, rt.write(base, b"x"))
    assert_names(exc, base)


@check(shares_sandbox=True)
async def check_read_under_file(rt: Runtime) -> None:
    """Reading file/child where file is a regular file is SandboxNotADirectoryError."""
    base = await scratch_dir(rt)
    await rt.write(f"{base}/file", b"x")
    exc = await expect_raises(SandboxNotADirectoryError, rt.read(f"{base}/file/child"))
    assert isinstance(exc, NotADirectoryError)
    assert_names(exc, f"{base}/file/child")


@check(shares_sandbox=True)
async def check_write_under_file(rt: Runtime) -> None:
    """Writing file/child where file is a regular file is SandboxNotADirectoryError."""
    base = await scratch_dir(rt)
    await rt.write(f"{base}/file", b"x")
    exc = await expect_raises(SandboxNotADirectoryError, rt.write(f"{base}/file/child", b"y"))
    assert_names(exc, f"{base}/file/child")
    assert await rt.read(f"{base}/file") == b"x", "the existing file must be untouched"


@check(shares_sandbox=True)
async def check_unreadable_file(rt: Runtime) -> None:
    """Reading a file without read permission is SandboxPermissionError (non-root sandboxes)."""
    if await is_root(rt):
        raise CheckSkipped("the sandbox user is root: every file is readable")
    path = f"{await scratch_dir(rt)}/secret"
    await rt.write(path, b"x")
    await rt.exec(["chmod", "000", path])
    exc = await expect_raises(SandboxPermissionError, rt.read(path))
    assert isinstance(exc, PermissionError)
    assert_names(exc, path)


@check(shares_sandbox=True)
async def check_unwritable_directory(rt: Runtime) -> None:
    """Writing into a read-only directory is SandboxPermissionError (non-root sandboxes)."""
    if await is_root(rt):
        raise CheckSkipped("the sandbox user is root: every directory is writable")
    base = await scratch_dir(rt)
    await rt.exec(["mkdir", f"{base}/ro"])
    await rt.exec(["chmod", "555", f"{base}/ro"])
    exc = await expect_raises(SandboxPermissionError, rt.write(f"{base}/ro/file", b"x"))
    assert_names(exc, f"{base}/ro/file")


@check(shares_sandbox=True)
async def check_read_limit(rt: Runtime) -> None:
    """read(max_bytes=) refuses a larger file with OutputLimitExceededError; equal size is fine."""
    path = f"{await scratch_dir(rt)}/sized"
    await rt.write(path, b"x" * 1000)
    assert await rt.read(path, max_bytes=1000) == b"x" * 1000
    exc = await expect_raises(OutputLimitExceededError, rt.read(path, max_bytes=999))
    assert isinstance(exc, OutputLimitExceededError) and exc.limit == 999


@check(shares_sandbox=True)
async def check_invalid_paths(rt: Runtime) -> None:
    """A NUL byte or an empty path is SandboxInvalidArgumentError, for every file call."""
    for bad in ("a\x00b", ""):
        await expect_raises(SandboxInvalidArgumentError, rt.read(bad))
        await expect_raises(SandboxInvalidArgumentError, rt.write(bad, b""))
        await expect_raises(SandboxInvalidArgumentError, rt.exists(bad))


# ---------------------------------------------------------------------- files: exists, remove


@check(shares_sandbox=True)
async def check_exists(rt: Runtime) -> None:
    """exists() is True for files, directories and dangling symlinks; False when missing."""
    base = await scratch_dir(rt)
    await rt.write(f"{base}/f", b"")
    await rt.exec(["ln", "-s", f"{base}/nowhere", f"{base}/dangling"])
    assert await rt.exists(f"{base}/f")
    assert await rt.exists(base)
    assert await rt.exists(f"{base}/dangling")
    assert not await rt.exists(f"{base}/missing")
    assert not await rt.exists(f"{base}/missing/deeper")
    assert not await rt.exists(f"{base}/f/under-a-file")


@check(shares_sandbox=True)
async def check_remove(rt: Runtime) -> None:
    """remove() deletes files and whole trees; a missing path is SandboxFileNotFoundError."""
    base = await scratch_dir(rt)
    await rt.write(f"{base}/tree/a/b.txt", b"b")
    await rt.write(f"{base}/file", b"f")
    await rt.remove(f"{base}/file")
    assert not await rt.exists(f"{base}/file")
    await rt.remove(f"{base}/tree")
    assert not await rt.exists(f"{base}/tree")
    exc = await expect_raises(SandboxFileNotFoundError, rt.remove(f"{base}/tree"))
    assert_names(exc, f"{base}/tree")
    await rt.remove(f"{base}/tree", missing_ok=True)


@check(shares_sandbox=True)
async def check_remove_symlink_not_target(rt: Runtime) -> None:
    """remove() of a symlink to a directory removes the link, not the target."""
    base = await scratch_dir(rt)
    await rt.write(f"{base}/real/keep.txt", b"keep")
    await rt.exec(["ln", "-s", f"{base}/real", f"{base}/link"])
    await rt.remove(f"{base}/link")
    assert await rt.read(f"{base}/real/keep.txt") == b"keep"


# ---------------------------------------------------------------------- files: trees


def _make_local_tree(root: Path) -> dict[str, bytes]:
    files = {
        "top.txt": b"top\n",
        "empty": b"",
        "nested/deeper/bin.dat": bytes(range(256)) * 8,
        "nested/with space.txt": b"spaced",
        "nested/ünï.txt": "ünï".encode(),
    }
    for rel, data in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (root / "empty-dir").mkdir()
    return files


def _read_local_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@check(shares_sandbox=True)
async def check_upload_download_tree(rt: Runtime) -> None:
    """upload() then download() of a tree keeps every file, byte for byte, and empty dirs."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "src")
        files = _make_local_tree(src)
        remote = f"{await scratch_dir(rt)}/uploaded"
        await rt.upload(src, remote)
        for rel, data in files.items():
            assert await rt.read(f"{remote}/{rel}") == data, rel
        assert (await rt.exec(["test", "-d", f"{remote}/empty-dir"])).exit_code == 0
        dst = Path(tmp, "dst")
        await rt.download(remote, dst)
        assert _read_local_tree(dst) == files
        assert (dst / "empty-dir").is_dir()


@check(shares_sandbox=True)
async def check_upload_download_file(rt: Runtime) -> None:
    """upload()/download() of a single file."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "one.bin")
        src.write_bytes(b"\x00one\xff")
        remote = f"{await scratch_dir(rt)}/dir/one.bin"
        await rt.upload(src, remote)
        assert await rt.read(remote) == b"\x00one\xff"
        dst = Path(tmp, "out", "copy.bin")
        await rt.download(remote, dst)
        assert dst.read_bytes() == b"\x00one\xff"


@check(shares_sandbox=True)
async def check_download_missing(rt: Runtime) -> None:
    """download() of a missing path is SandboxFileNotFoundError naming it."""
    missing = f"{rt.workdir}/missing-{random.randrange(1 << 30)}"
    with tempfile.TemporaryDirectory() as tmp:
        exc = await expect_raises(SandboxFileNotFoundError, rt.download(missing, Path(tmp, "x")))
    assert_names(exc, missing)


def _mismatch(name: str, wrote: bytes, read: bytes) -> str:
    """What a failed round trip read back, told well enough to tell truncation from mixing."""
    at = next((i for i, (a, b) in enumerate(zip(wrote, read, strict=False)) if a != b), None)
    where = f"first difference at byte {at}" if at is not None else "one is a prefix of the other"
    return f"{name}: wrote {len(wrote)} bytes, read {len(read)} ({where}); read began {read[:80]!r}"


@check(shares_sandbox=True)
async def check_concurrent_files(rt: Runtime) -> None:
    """Concurrent writes and reads of different files do not mix."""
    base = await scratch_dir(rt)
    payloads = {i: random.randbytes(random.randint(0, 200_000)) for i in range(16)}

    async def one(i: int) -> None:
        await rt.write(f"{base}/f{i}", payloads[i])
        got = await rt.read(f"{base}/f{i}")
        assert got == payloads[i], _mismatch(f"f{i}", payloads[i], got)

    async with anyio.create_task_group() as tg:
        for i in payloads:
            tg.start_soon(one, i)


# ---------------------------------------------------------------------- lifecycle


@check(shares_sandbox=True)
async def check_workdir_exists(rt: Runtime) -> None:
    """The workdir is an absolute, existing, writable directory."""
    assert rt.workdir.startswith("/")
    result = await rt.exec(["sh", "-c", 'test -d "$1" && test -w "$1"', "sh", rt.workdir])
    assert result.exit_code == 0, result


@check(shares_sandbox=False)  # closes the runtime
async def check_alive_and_closed(rt: Runtime) -> None:
    """alive() is True while open; after close() every call is SandboxUnavailableError."""
    assert await rt.alive()
    await rt.close()
    assert not await rt.alive()
    for call in (
        rt.exec(["true"]),
        rt.read("/etc/hostname"),
        rt.write("x", b""),
        rt.exists("x"),
        rt.remove("x"),
    ):
        exc = await expect_raises(SandboxUnavailableError, call)
        assert not isinstance(exc, FileNotFoundError)


@check(shares_sandbox=False)  # closes the runtime
async def check_close_twice(rt: Runtime) -> None:
    """close() twice is harmless."""
    await rt.close()
    await rt.close()
    assert rt.closed
