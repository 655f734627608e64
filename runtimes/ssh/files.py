"""Files over SFTP (blocking paramiko calls, run in worker threads by the runtime).

Every function takes the connection's ``paramiko.SFTPClient`` first and raises the typed
file errors of :mod:`runtimes.errors`; anything else (a connection failure) is left to
the caller, which tells a broken connection from a refused operation.
"""

from __future__ import annotations

import contextlib
import errno
import posixpath
import secrets
import stat
from typing import TYPE_CHECKING

from ..errors import (
    OutputLimitExceededError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    error_for_errno,
)
from .client import CHUNK

if TYPE_CHECKING:
    import paramiko

_SFTP_REQUEST = 32 * 1024
_TEMP_PREFIX = ".vf-sandbox-write-"
"""Temporary files of atomic writes (the channel agent uses the same prefix)."""
_FILE_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.EACCES,
        errno.EPERM,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.EEXIST,
        errno.ENOTEMPTY,
        errno.EROFS,
    }
)

_VERIFY_LIMIT = 256 * 1024 * 1024
"""Bytes a file the channel agent runs from may have, when it is read to be verified."""


def sftp_read_or_none(sftp: paramiko.SFTPClient, path: str) -> bytes | None:
    """A file's bytes through SFTP (no shell, no command), ``None`` if it is not there."""
    try:
        sftp.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno is None or exc.errno in (errno.ENOENT,):
            return None
        raise
    return sftp_read(sftp, path, _VERIFY_LIMIT)


def _sftp_error(exc: OSError, path: str) -> SandboxError | None:
    """The typed error for an SFTP status that names a file problem, else None."""
    if exc.errno in _FILE_ERRNOS:
        return error_for_errno(exc.errno, path, None)
    return None


def is_dir(sftp: paramiko.SFTPClient, path: str) -> bool | None:
    """True/False for an existing path (following symlinks), None when it is missing."""
    try:
        mode = sftp.stat(path).st_mode
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EACCES):
            return None
        raise
    return stat.S_ISDIR(mode or 0)


def _diagnose(sftp: paramiko.SFTPClient, path: str, exc: OSError) -> SandboxError:
    """SFTP reports ENOTDIR as 'no such file' and EISDIR as a bare failure: look closer."""
    if exc.errno == errno.EACCES:
        return error_for_errno(errno.EACCES, path, None)
    if is_dir(sftp, path):
        return SandboxIsADirectoryError(path)
    parent = posixpath.dirname(path)
    while parent and parent != "/":
        kind = is_dir(sftp, parent)
        if kind is False:
            return SandboxNotADirectoryError(path, f"{parent} is not a directory")
        if kind:
            break
        parent = posixpath.dirname(parent)
    if exc.errno in (errno.ENOENT, None) and is_dir(sftp, path) is None:
        return SandboxFileNotFoundError(path)
    typed = _sftp_error(exc, path)
    return typed or SandboxError(f"sftp operation on {path!r} failed: {exc}")


def sftp_read(sftp: paramiko.SFTPClient, path: str, limit: int) -> bytes:
    try:
        attrs = sftp.stat(path)
    except OSError as exc:
        if exc.errno is None or exc.errno in _FILE_ERRNOS:
            raise _diagnose(sftp, path, exc) from None
        raise
    if stat.S_ISDIR(attrs.st_mode or 0):
        raise SandboxIsADirectoryError(path)
    if stat.S_ISFIFO(attrs.st_mode or 0) or stat.S_ISSOCK(attrs.st_mode or 0):
        # The server's read would wait for a writer until io_timeout, then again per retry.
        raise SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
    size = attrs.st_size or 0
    if size > limit:
        raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
    try:
        with sftp.open(path, "rb") as fh:
            if size:
                fh.prefetch(size)
            data = _read_to_limit(fh, limit)
            if len(data) < size:
                # paramiko's read ends quietly at an EOFError, which is also what a
                # connection that died under the read raises (the prefetch's requests
                # answered, the next request unsent): a read shorter than the file was asks
                # for the file again on the same connection, which raises if it is gone. A
                # file that shrank meanwhile is read as it is now.
                fh.stat()
            return data
    except OSError as exc:
        if exc.errno is None or exc.errno in _FILE_ERRNOS:
            raise _diagnose(sftp, path, exc) from None
        raise


def _read_to_limit(fh: paramiko.SFTPFile, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes, one SFTP request at a time.

    ``SFTPFile.read(n)`` grows an immutable buffer chunk by chunk: quadratic for big n.
    """
    data = bytearray()
    while len(data) <= limit:
        chunk = fh.read(min(_SFTP_REQUEST, limit + 1 - len(data)))
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _sftp_ensure_dir(sftp: paramiko.SFTPClient, directory: str, target: str) -> None:
    """mkdir -p over SFTP; errors name ``target`` (the file being written)."""
    kind = is_dir(sftp, directory)
    if kind:
        return
    if kind is False:
        raise SandboxNotADirectoryError(target, f"{directory} is not a directory")
    parent = posixpath.dirname(directory)
    if parent != directory:
        _sftp_ensure_dir(sftp, parent, target)
    try:
        sftp.mkdir(directory)
    except OSError as exc:
        if is_dir(sftp, directory):
            return  # made concurrently
        if exc.errno is None or exc.errno in _FILE_ERRNOS:
            raise _diagnose(sftp, target, exc) from None
        raise


def _refuse_fifo(sftp: paramiko.SFTPClient, path: str) -> paramiko.SFTPAttributes | None:
    """A FIFO or socket would hold the server's open() until io_timeout: refuse it first.
    Returns the path's (followed) attributes, ``None`` when it cannot be stat'ed."""
    try:
        info = sftp.stat(path)
    except OSError:
        return None  # missing or not searchable: open() tells what is wrong
    mode = info.st_mode or 0
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        raise SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
    return info


def sftp_write(sftp: paramiko.SFTPClient, path: str, data: bytes) -> None:
    """Write into a temporary file next to the target and rename it over the target, so a
    write cut midway (server killed, connection lost) leaves the old content or the new,
    never a mix. In place where a rename could not keep the file what it was: not a
    regular file, another user's file, a directory we cannot create files in."""
    info = _refuse_fifo(sftp, path)
    try:
        target = _write_target(sftp, path)
        if info is not None and not stat.S_ISREG(info.st_mode or 0):
            _sftp_write_in_place(sftp, target, data)
            return
        temp = posixpath.join(
            posixpath.dirname(target) or "/", f"{_TEMP_PREFIX}{secrets.token_hex(8)}"
        )
        try:
            fh = sftp.open(temp, "wbx")
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                _sftp_write_in_place(sftp, target, data)  # the directory is not writable
                return
            _sftp_ensure_dir(sftp, posixpath.dirname(target) or "/", path)
            fh = sftp.open(temp, "wbx")
        try:
            with fh:
                if info is not None and fh.stat().st_uid != info.st_uid:
                    fh.close()
                    sftp.remove(temp)
                    _sftp_write_in_place(sftp, target, data)  # a rename would change the owner
                    return
                _write_chunks(fh, data)
                if info is not None:
                    fh.chmod(stat.S_IMODE(info.st_mode or 0o644))
            _sftp_replace(sftp, temp, target, data)
        except BaseException:
            with contextlib.suppress(OSError, EOFError):
                sftp.remove(temp)
            raise
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        if exc.errno is None or exc.errno in _FILE_ERRNOS:
            raise _diagnose(sftp, path, exc) from None
        raise


def _write_target(sftp: paramiko.SFTPClient, path: str) -> str:
    """The file a write to ``path`` lands in: a symlink is written through."""
    try:
        if not stat.S_ISLNK(sftp.lstat(path).st_mode or 0):
            return path
    except OSError:
        return path
    try:
        return sftp.normalize(path)
    except OSError:
        return path  # dangling: open() creates the link's target


def _sftp_replace(sftp: paramiko.SFTPClient, temp: str, target: str, data: bytes) -> None:
    try:
        sftp.posix_rename(temp, target)
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EXDEV, None):
            raise
        # A mount point (or a server without posix-rename): rewrite the content in place.
        _sftp_write_in_place(sftp, target, data)
        sftp.remove(temp)


def _sftp_write_in_place(sftp: paramiko.SFTPClient, path: str, data: bytes) -> None:
    try:
        fh = sftp.open(path, "wb")
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
        _sftp_ensure_dir(sftp, posixpath.dirname(path) or "/", path)
        fh = sftp.open(path, "wb")
    with fh:
        _write_chunks(fh, data)


def _write_chunks(fh: paramiko.SFTPFile, data: bytes) -> None:
    fh.set_pipelined(True)
    view = memoryview(data)
    for offset in range(0, len(view), CHUNK):
        fh.write(bytes(view[offset : offset + CHUNK]))


def sftp_exists(sftp: paramiko.SFTPClient, path: str) -> bool:
    try:
        sftp.lstat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # also ENOTDIR: SFTP folds it into 'no such file'
            return False
        if exc.errno == errno.EACCES:
            raise SandboxPermissionError(path, "a parent directory cannot be searched") from None
        raise
    return True
