"""Attack class 21: the host's extraction of a directory download's tar, fuzzed (hypothesis).

A directory download's tar is made inside the sandbox (its ``tar``, or the Docker engine from
the sandbox's files), so a policy chooses every byte of it; the host unpacks it with
:func:`runtimes._extract.extract_archive` (class 1 plays the known hostile shapes by hand).
Here hypothesis builds arbitrary tar streams: members of every type (files, directories,
symlinks, hard links, devices, FIFOs, unknown types) whose names and link targets are drawn
from components that include ``..``, ``.``, empty ones, names of the other members and
overlong ones, in the three tar formats, with arbitrary modes and times, then perhaps
truncated or with bytes flipped; and arbitrary bytes.

The invariant, for every stream: the call returns (with ``skip_unsafe``, the members it left
out) or raises :class:`~runtimes.errors.UnsafeArchiveMemberError` or
:class:`~runtimes.errors.SandboxError` (a malformed tar), never another exception; nothing
outside the destination is created or changed (a sentinel tree beside it is compared
byte for byte, no link is followed out); and every symlink left in the destination resolves
inside it.

The budget: see :mod:`tests.security.fuzzing`.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runtimes._extract import Links, extract_archive
from runtimes.errors import SandboxError, UnsafeArchiveMemberError

from .fuzzing import fuzz

pytestmark = pytest.mark.attack(21)

COMPONENTS = [
    "a",
    "b",
    "c",
    "..",
    ".",
    "",
    "outside",
    "sentinel",
    "x" * 256,
    "é",
    "a\x00b",
    "\udcff",
]
"""Name components: ordinary, climbing, empty, the sentinel's names, overlong, non-ASCII."""
TYPES = [
    tarfile.REGTYPE,
    tarfile.AREGTYPE,
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.CHRTYPE,
    tarfile.BLKTYPE,
    tarfile.FIFOTYPE,
    tarfile.CONTTYPE,
    b"V",
    b"Z",
]
FORMATS = [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]

paths = st.builds(
    lambda lead, parts: lead + "/".join(parts),
    st.sampled_from(["", "", "", "/", "./", "../"]),
    st.lists(st.sampled_from(COMPONENTS), min_size=1, max_size=5),
)
members = st.tuples(
    st.sampled_from(TYPES),
    paths,
    paths,  # the link target (symlinks, hard links)
    st.integers(0, 0o7777),
    st.integers(-(2**40), 2**40),  # mtime
    st.binary(max_size=300),
)


def build(entries: list[tuple[bytes, str, str, int, int, bytes]], form: int) -> bytes:
    """A tar of ``entries``; members a format cannot hold are left out (the sandbox's tar
    would not make them either; other streams cover raw bytes)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=form) as tar:
        for kind, name, link, mode, mtime, data in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            info.linkname = link if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
            info.mode = mode
            info.mtime = mtime
            regular = kind in (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE, b"V", b"Z")
            info.size = len(data) if regular else 0
            try:
                tar.addfile(info, io.BytesIO(data) if regular else None)
            except (ValueError, UnicodeError):  # a name or number this format cannot hold
                continue
    return buf.getvalue()


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    data = build(draw(st.lists(members, max_size=8)), draw(st.sampled_from(FORMATS)))
    how = draw(st.sampled_from(["whole", "whole", "truncated", "flipped"]))
    if how == "truncated" and data:
        return data[: draw(st.integers(0, len(data) - 1))]
    if how == "flipped" and data:
        raw = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return bytes(raw)
    return data


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, bytes | str | None]]:
    """Every entry under ``root`` but ``skip`` (never following a link): mode and content
    (a file's bytes, a link's target)."""
    seen: dict[str, tuple[int, bytes | str | None]] = {}
    for here, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            path = Path(here) / name
            if path == skip:
                continue
            info = path.lstat()
            if path.is_symlink():
                seen[str(path)] = (info.st_mode, os.readlink(path))
            elif path.is_file():
                seen[str(path)] = (info.st_mode, path.read_bytes())
            else:
                seen[str(path)] = (info.st_mode, None)
        dirs[:] = [d for d in dirs if Path(here) / d != skip]
    return seen


def play(data: bytes, skip_unsafe: bool, strip: str | None, links: Links = "contained") -> None:
    with tempfile.TemporaryDirectory(prefix="vf-fuzz-download-") as tmp:
        base = Path(tmp)
        (base / "outside").mkdir()
        (base / "outside" / "sentinel").write_bytes(b"host file")
        (base / "sentinel").write_bytes(b"host file")
        dest = base / "dest"
        before = snapshot(base, dest)
        try:
            extract_archive(
                io.BytesIO(data), dest, skip_unsafe=skip_unsafe, strip=strip, links=links
            )
        except UnsafeArchiveMemberError:
            # skip_unsafe reports what it left out; only the member-count bound still raises
            assert not skip_unsafe
            assert not os.path.lexists(dest), "a failed download left its destination"
        except SandboxError as exc:
            assert "malformed" in str(exc), exc  # not a tar
            assert not os.path.lexists(dest), "a failed download left its destination"
        assert snapshot(base, dest) == before  # the staging directory included: gone
        if links == "keep":  # links are kept as they are: none was followed (above)
            return
        real = Path(os.path.realpath(dest))
        for here, dirs, files in os.walk(dest, followlinks=False):
            for name in dirs + files:
                path = Path(here) / name
                if path.is_symlink():
                    # realpath, not resolve(): a link loop inside the destination is harmless
                    target = Path(os.path.realpath(path))
                    assert target == real or real in target.parents, (path, target)


LONG_NAME = build([(tarfile.REGTYPE, "a/" + "x" * 256, "", 0o644, 0, b"a")], tarfile.PAX_FORMAT)
LONG_TARGET = build([(tarfile.SYMTYPE, "l", "a/" * 2048, 0o777, 0, b"")], tarfile.GNU_FORMAT)
NUL_NAME = build([(tarfile.REGTYPE, "n" * 120 + "\x00b", "", 0o644, 0, b"a")], tarfile.PAX_FORMAT)
NUL_TARGET = build([(tarfile.SYMTYPE, "a", "t" * 120 + "\x00c", 0o777, 0, b"")], tarfile.PAX_FORMAT)
"""Found by this test: a component over NAME_MAX or a link target over PATH_MAX failed the
extraction with an untyped ``OSError`` (``ENAMETOOLONG``), and a NUL byte in a pax header's
name or link target with a ``ValueError``, even with ``skip_unsafe``."""


@fuzz(400)
@given(data=streams(), skip_unsafe=st.booleans(), strip=st.sampled_from([None, "a"]))
@example(data=LONG_NAME, skip_unsafe=False, strip=None)
@example(data=LONG_NAME, skip_unsafe=True, strip=None)
@example(data=LONG_TARGET, skip_unsafe=True, strip=None)
@example(data=NUL_NAME, skip_unsafe=True, strip=None)
@example(data=NUL_TARGET, skip_unsafe=False, strip=None)
@example(data=build([(tarfile.SYMTYPE, "a", "a", 0o777, 0, b"")], 0), skip_unsafe=False, strip=None)
def test_any_tar_is_extracted_or_refused_typed_and_nothing_leaves_the_destination(
    data: bytes, skip_unsafe: bool, strip: str | None
) -> None:
    play(data, skip_unsafe, strip)


@fuzz(200)
@given(data=streams(), skip_unsafe=st.booleans())
def test_any_tar_with_links_kept_writes_nothing_outside(data: bytes, skip_unsafe: bool) -> None:
    """``links="keep"`` creates links out as they are; nothing is ever written through one,
    and a refused archive leaves no destination."""
    play(data, skip_unsafe, None, "keep")


@fuzz(150)
@given(data=st.binary(max_size=4096), skip_unsafe=st.booleans())
def test_arbitrary_bytes_are_a_tar_or_a_typed_error(data: bytes, skip_unsafe: bool) -> None:
    play(data, skip_unsafe, None)
