"""Copy a directory tree without ever following a link, even one swapped in during the copy.

A snapshot copies a sandbox's workdir while processes the policy left behind may still run in
it. ``cp -a`` walks by path: a process that exchanges a directory with a link to ``/`` (or to a
directory of the host's) between ``cp``'s ``lstat`` and its reads makes ``cp`` read through the
link, into the snapshot. This copy walks by descriptor instead: every directory and file is
opened relative to its parent's descriptor with ``O_NOFOLLOW``, and what was opened is checked
to be what ``lstat`` saw (same kind, device and inode). An entry that changed meanwhile is
looked at again (at most 3 times, else the copy fails), one removed meanwhile is left out.
Links are copied as links. Modes, owners (as root; the group where allowed otherwise),
extended attributes (where the target takes them), times, FIFOs, devices and hard links within
the tree are kept, as ``cp -a`` keeps them; regular files are reflinked where the filesystem
can, else copied in the kernel (``copy_file_range``), never past the size they had when opened.

Standard library only: the SSH backend runs this file on its host (``python3 - SRC DST``).
Failures are ``OSError``; the callers turn them into their typed errors.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import stat
import sys

MAX_DEPTH = 256
"""Directories nested deeper are refused (each level holds two descriptors)."""

_TRIES = 3
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FICLONE = 0x40049409
_CHUNK = 1 << 20
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM}


@functools.cache
def source_text() -> str:
    """This module's text: what the SSH backend runs on its host."""
    with open(__file__, encoding="utf-8") as fh:
        return fh.read()


class TreeCopyError(OSError):
    """The tree could not be copied safely (too deep, or an entry kept changing)."""


class _Changed(Exception):
    """The entry is no longer what ``lstat`` saw: look again."""


def copy_tree(source: str, target: str) -> None:
    """Copy the directory ``source`` to ``target`` (which must not exist), links as links.

    Raises:
        OSError: ``source`` is not a directory (a link is not), ``target`` exists, an entry
            is unreadable or kept changing (:class:`TreeCopyError`), the disk is full.
    """
    src = os.open(source, _DIR)
    try:
        info = os.fstat(src)
        os.mkdir(target, 0o700)
        dst = os.open(target, _DIR)
        try:
            _Copier(dst).copy_dir(src, dst, info, ())
        finally:
            os.close(dst)
    finally:
        os.close(src)


class _Copier:
    def __init__(self, root: int) -> None:
        self.root = root
        self.copied: dict[tuple[int, int], str] = {}
        """Inodes with more than one link, copied already: where their copy is (relative to
        the target), so the next name becomes a hard link to it."""

    def copy_dir(self, src: int, dst: int, info: os.stat_result, where: tuple[str, ...]) -> None:
        if len(where) > MAX_DEPTH:
            raise TreeCopyError(errno.ELOOP, f"deeper than {MAX_DEPTH} directories", _path(where))
        for name in sorted(os.listdir(src)):
            self.copy_entry(src, dst, name, (*where, name))
        _finish(src, dst, info)

    def copy_entry(self, src: int, dst: int, name: str, where: tuple[str, ...]) -> None:
        for _ in range(_TRIES):
            try:
                info = os.stat(name, dir_fd=src, follow_symlinks=False)
            except FileNotFoundError:
                return  # removed while the copy ran
            try:
                self.copy_kind(src, dst, name, info, where)
                return
            except _Changed:
                continue
            except FileNotFoundError:
                return
        raise TreeCopyError(errno.EAGAIN, "kept changing while it was copied", _path(where))

    def copy_kind(
        self, src: int, dst: int, name: str, info: os.stat_result, where: tuple[str, ...]
    ) -> None:
        mode = info.st_mode
        if stat.S_ISLNK(mode):
            self.copy_link(src, dst, name, info)
        elif stat.S_ISDIR(mode):
            child = _open_as_seen(src, name, _DIR, info)
            try:
                os.mkdir(name, 0o700, dir_fd=dst)
                made = os.open(name, _DIR, dir_fd=dst)
                try:
                    self.copy_dir(child, made, info, where)
                finally:
                    os.close(made)
            finally:
                os.close(child)
        elif self.link_to_copy(dst, name, info):
            return
        elif stat.S_ISREG(mode):
            self.copy_file(src, dst, name, info)
            self.remember(info, where)
        else:  # FIFO, socket, device: made anew, never opened
            os.mknod(name, mode, info.st_rdev, dir_fd=dst)
            _owner_mode_times_by_name(dst, name, info)
            self.remember(info, where)

    def copy_link(self, src: int, dst: int, name: str, info: os.stat_result) -> None:
        try:
            target = os.readlink(name, dir_fd=src)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # no longer a link
                raise _Changed from None
            raise
        os.symlink(target, name, dir_fd=dst)
        with contextlib.suppress(PermissionError):
            os.chown(name, info.st_uid, info.st_gid, dir_fd=dst, follow_symlinks=False)
        os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)

    def copy_file(self, src: int, dst: int, name: str, info: os.stat_result) -> None:
        source = _open_as_seen(src, name, _FILE, info)
        try:
            copy = os.open(name, _NEW_FILE, 0o600, dir_fd=dst)
            try:
                _copy_data(source, copy, os.fstat(source).st_size)
                _finish(source, copy, info)
            finally:
                os.close(copy)
        finally:
            os.close(source)

    def link_to_copy(self, dst: int, name: str, info: os.stat_result) -> bool:
        """A hard link to the copy of an inode copied already; whether there was one."""
        first = self.copied.get((info.st_dev, info.st_ino)) if info.st_nlink > 1 else None
        if first is None:
            return False
        os.link(first, name, src_dir_fd=self.root, dst_dir_fd=dst, follow_symlinks=False)
        return True

    def remember(self, info: os.stat_result, where: tuple[str, ...]) -> None:
        if info.st_nlink > 1:
            self.copied[(info.st_dev, info.st_ino)] = _path(where)


def _path(where: tuple[str, ...]) -> str:
    return "/".join(where)


def _open_as_seen(parent: int, name: str, flags: int, info: os.stat_result) -> int:
    """Open ``name`` (never through a link) if it still is what ``info`` saw, else
    :class:`_Changed`."""
    try:
        fd = os.open(name, flags, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENXIO):
            raise _Changed from None
        raise
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino, stat.S_IFMT(now.st_mode)) != (
        info.st_dev,
        info.st_ino,
        stat.S_IFMT(info.st_mode),
    ):
        os.close(fd)
        raise _Changed
    return fd


def _copy_data(source: int, copy: int, size: int) -> None:
    """``size`` bytes at most (a file growing meanwhile is cut there): a reflink where the
    filesystem shares data, else the kernel's copy, else reads and writes."""
    try:
        fcntl.ioctl(copy, _FICLONE, source)
        os.ftruncate(copy, min(size, os.fstat(copy).st_size))
        return
    except OSError:
        pass
    left = size
    while left > 0:
        try:
            done = os.copy_file_range(source, copy, min(left, 1 << 30))
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            break
        if done == 0:
            return  # shrank meanwhile
        left -= done
    while left > 0:
        data = os.read(source, min(left, _CHUNK))
        if not data:
            return
        os.write(copy, data)
        left -= len(data)


def _finish(source: int, copy: int, info: os.stat_result) -> None:
    """Owner, mode, extended attributes and times of ``info``/``source`` onto ``copy``."""
    try:
        os.fchown(copy, info.st_uid, info.st_gid)
    except PermissionError:  # not root: the copy stays ours, its group if allowed
        with contextlib.suppress(PermissionError):
            os.fchown(copy, -1, info.st_gid)
    os.fchmod(copy, stat.S_IMODE(info.st_mode))
    _copy_xattrs(source, copy)
    os.utime(copy, ns=(info.st_atime_ns, info.st_mtime_ns))


def _copy_xattrs(source: int, copy: int) -> None:
    """As ``cp -a``: what the target refuses (``security.*`` without privilege, a
    filesystem without them) is left out silently."""
    try:
        names = os.listxattr(source)
    except OSError:
        return
    for key in names:
        try:
            os.setxattr(copy, key, os.getxattr(source, key))
        except OSError:
            continue


def _owner_mode_times_by_name(parent: int, name: str, info: os.stat_result) -> None:
    """For an entry that cannot be opened (FIFO, device): ``name`` is in a directory of the
    copy's, made by this copy, so it is what ``mknod`` made."""
    with contextlib.suppress(PermissionError):
        os.chown(name, info.st_uid, info.st_gid, dir_fd=parent, follow_symlinks=False)
    os.chmod(name, stat.S_IMODE(info.st_mode), dir_fd=parent)
    os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=parent, follow_symlinks=False)


if __name__ == "__main__":
    try:
        copy_tree(sys.argv[1], sys.argv[2])
    except OSError as exc:
        sys.exit(f"copying {sys.argv[1]} failed: {exc}")
