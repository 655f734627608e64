"""All-or-nothing host destinations for downloads.

A download lands first in a fresh staging directory next to its destination (``.vf-download-*``
in the destination's parent, or inside the destination when that is a directory already; mode
0700, created by this process: nothing in it predates the download, so no link there can
redirect a write). Only once the whole tree is there does
:func:`staged_download` put it in place: a rename when nothing is at the destination, else a
merge into the existing directory (files and links renamed over files and links, directories
descended into), checked in full before anything moves. Any failure before that removes the
staging directory and the destination's parents the download created: the destination is
exactly as it was.

The merge never follows a link in the destination: every directory is opened ``O_NOFOLLOW``
relative to its parent's descriptor, a staged directory where the destination has a link or a
file is refused (:class:`~runtimes.errors.UnsafeArchiveMemberError`, before any move), and a
staged entry renamed over a link replaces the link itself. The only host failure that can
leave a merge half done is one of the renames themselves (a disk or permission error on the
host, not something the sandbox chooses).
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import anyio
import anyio.to_thread

from .errors import SandboxInvalidArgumentError, UnsafeArchiveMemberError

__all__ = ["Stage", "download_staged", "staged_download"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_STAGE_PREFIX = ".vf-download-"


class Stage:
    """One download's staging directory (see the module): :meth:`open` it, have the
    download write :attr:`path`, then :meth:`commit` or :meth:`discard`."""

    def __init__(self, dest: Path, created: list[Path], stage: Path) -> None:
        self.dest = dest
        self.path = stage / "download"
        """Where the download writes (nothing there yet)."""
        self._created = created
        self._stage = stage

    @classmethod
    def open(cls, dest: Path) -> Stage:
        """Make the staging directory next to ``dest`` (and ``dest``'s missing parents), or
        inside ``dest`` when it is a directory already (its parent may not be writable:
        ``/tmp``, a home directory).

        Raises:
            OSError: a host-side failure (no permission).
        """
        if os.path.isdir(dest):
            return cls(dest, [], Path(tempfile.mkdtemp(dir=dest, prefix=_STAGE_PREFIX)))
        created = _make_parents(dest.parent)
        try:
            stage = Path(tempfile.mkdtemp(dir=dest.parent, prefix=_STAGE_PREFIX))
        except BaseException:
            _remove_created(created)
            raise
        return cls(dest, created, stage)

    def commit(self) -> None:
        """Put what was downloaded at the destination, then remove the staging directory;
        on an error, :meth:`discard` (nothing was moved).

        Raises:
            UnsafeArchiveMemberError: a staged directory meets a link or a file in the
                destination, or a staged file a directory.
            SandboxInvalidArgumentError: the download is a directory and the destination a
                file, or the other way round.
            OSError: a host-side failure (no permission, disk full).
        """
        try:
            _commit(self.path, self.dest)
        except BaseException:
            self.discard()
            raise
        shutil.rmtree(self._stage, ignore_errors=True)

    def discard(self) -> None:
        """Remove the staging directory and the parents :meth:`open` created. Never raises."""
        shutil.rmtree(self._stage, ignore_errors=True)
        _remove_created(self._created)


@contextmanager
def staged_download(dest: Path) -> Iterator[Path]:
    """A fresh path (nothing there yet) inside a staging directory next to ``dest``; when
    the block ends without an error, what was written there is put at ``dest``; else the
    destination stays as it was.

    Raises:
        UnsafeArchiveMemberError, SandboxInvalidArgumentError, OSError: as
            :meth:`Stage.commit`.
    """
    stage = Stage.open(dest)
    try:
        yield stage.path
    except BaseException:
        stage.discard()
        raise
    stage.commit()


def _make_parents(parent: Path) -> list[Path]:
    """Create ``parent`` and its missing ancestors; the ones created, deepest first."""
    missing = []
    for candidate in (parent, *parent.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    parent.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_created(created: list[Path]) -> None:
    """Remove the parents this download created (each only if still empty)."""
    for path in created:
        with suppress(OSError):
            os.rmdir(path)


def _commit(staged: Path, dest: Path) -> None:
    if not os.path.lexists(staged):  # pragma: no cover - every backend writes it or raises
        raise SandboxInvalidArgumentError(f"the download for {str(dest)!r} produced nothing")
    staged_dir = stat.S_ISDIR(os.lstat(staged).st_mode)
    if not os.path.lexists(dest):
        os.rename(staged, dest)
        return
    dest_dir = os.path.isdir(dest)  # a link the host placed at dest itself is the host's
    if staged_dir != dest_dir:
        what = ("a directory", "a file") if staged_dir else ("a file", "a directory")
        raise SandboxInvalidArgumentError(
            f"the download is {what[0]} but {str(dest)!r} is {what[1]}: nothing was changed"
        )
    if not staged_dir:
        os.replace(staged, dest)
        return
    for move in (False, True):  # check everything, then move
        src = os.open(staged, _DIR_FLAGS)
        try:
            dst = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                _merge(src, dst, "", move)
            finally:
                os.close(dst)
        finally:
            os.close(src)


def _merge(src: int, dst: int, rel: str, move: bool) -> None:
    """Merge the staged directory ``src`` into ``dst`` (``move=False``: only check)."""
    for name in sorted(os.listdir(src)):
        path = f"{rel}/{name}" if rel else name
        mode = os.stat(name, dir_fd=src, follow_symlinks=False).st_mode
        try:
            there: int | None = os.stat(name, dir_fd=dst, follow_symlinks=False).st_mode
        except FileNotFoundError:
            there = None
        if there is not None and stat.S_ISDIR(mode):
            if not stat.S_ISDIR(there):
                raise UnsafeArchiveMemberError(
                    _first_leaf(src, name, path),
                    f"its path goes through {path!r}, a symlink or a non-directory",
                )
            sub_src = os.open(name, _DIR_FLAGS, dir_fd=src)
            try:
                sub_dst = os.open(name, _DIR_FLAGS, dir_fd=dst)
                try:
                    _merge(sub_src, sub_dst, path, move)
                finally:
                    os.close(sub_dst)
            finally:
                os.close(sub_src)
        elif there is not None and stat.S_ISDIR(there):
            raise UnsafeArchiveMemberError(path, "a directory is already at its path")
        elif move:
            os.rename(name, name, src_dir_fd=src, dst_dir_fd=dst)


def _first_leaf(parent: int, name: str, path: str) -> str:
    """The first entry below the staged directory ``name`` that is not itself a non-empty
    directory (the member whose path is refused), or ``path`` itself."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        entries = sorted(os.listdir(fd))
        if not entries:
            return path
        first = entries[0]
        if stat.S_ISDIR(os.stat(first, dir_fd=fd, follow_symlinks=False).st_mode):
            return _first_leaf(fd, first, f"{path}/{first}")
        return f"{path}/{first}"
    finally:
        os.close(fd)


async def download_staged(local: Path, download: Callable[[Path], Awaitable[None]]) -> None:
    """Run ``download`` into a :class:`Stage` next to ``local`` and commit it; on any error
    (or cancellation) the stage is discarded and ``local`` stays as it was.

    Raises:
        Whatever ``download`` raises, and as :meth:`Stage.commit`.
    """
    stage = await anyio.to_thread.run_sync(Stage.open, local)
    try:
        await download(stage.path)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(stage.discard)
        raise
    await anyio.to_thread.run_sync(stage.commit)
