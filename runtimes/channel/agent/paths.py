"""LSTAT and MKDIR in the agent: what is at a path, seen without following a link, and one
fresh directory made with exactly the mode and owner asked for (agent part).

The judge machinery asks these of the agent rather than of ``sh``, ``stat``, ``head`` or
``mkdir`` in the sandbox: the agent started before the policy ran (or from an interpreter the
host verified), so a root policy that replaced the sandbox's programs cannot answer for it.

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host.
"""

from __future__ import annotations

import errno
import os
import stat

from .wire import MkdirHeader, PathInfo

NOFOLLOW_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def path_info(path: str, limit: int) -> PathInfo:
    """``lstat`` of ``path``; a regular file's first ``limit + 1`` bytes, read through a
    descriptor opened ``O_NOFOLLOW`` and checked to be the file ``lstat`` saw.

    Raises:
        OSError: a parent cannot be searched, or the file cannot be read.
    """
    try:
        info = os.lstat(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return PathInfo("absent")
        raise
    mode = info.st_mode
    fields = (stat.S_IMODE(mode), info.st_uid, info.st_gid, info.st_nlink, info.st_size)
    if stat.S_ISLNK(mode):
        return PathInfo("symlink", *fields, target=os.readlink(path)[:4096])
    if stat.S_ISDIR(mode):
        return PathInfo("directory", *fields)
    if not stat.S_ISREG(mode):
        return PathInfo("other", *fields)
    content = b""
    if limit > 0:
        fd = os.open(path, NOFOLLOW_READ)
        try:
            opened = os.fstat(fd)
            if (opened.st_dev, opened.st_ino) != (info.st_dev, info.st_ino):
                raise OSError(errno.ESTALE, "the file was replaced while it was read", path)
            chunks = []
            left = limit + 1
            while left > 0:
                data = os.read(fd, min(left, 256 * 1024))
                if not data:
                    break
                chunks.append(data)
                left -= len(data)
            content = b"".join(chunks)
        finally:
            os.close(fd)
    return PathInfo("file", *fields, content=content)


def make_dir(header: MkdirHeader) -> None:
    """Make ``header.path`` as a fresh directory inside a parent that is a real directory
    (opened ``O_NOFOLLOW``), then set its mode (umask-free) and owner through a descriptor.

    Raises:
        OSError: the parent is a link or missing (``ENOTDIR``/``ELOOP``/``ENOENT``),
            something is at the path already (``EEXIST``), or the agent may not.
    """
    parent, name = os.path.split(header.path.rstrip("/"))
    if not name or name in (".", ".."):
        raise OSError(errno.EINVAL, "not a directory name", header.path)
    dir_fd = os.open(parent or "/", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
        fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd
        )
    finally:
        os.close(dir_fd)
    try:
        if header.uid >= 0 or header.gid >= 0:
            os.fchown(fd, header.uid, header.gid)
        os.fchmod(fd, header.mode)
    finally:
        os.close(fd)
