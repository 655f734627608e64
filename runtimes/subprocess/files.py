"""File operations on the host's filesystem that never follow a symlink they were not asked to."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import (
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    error_for_errno,
)
from .config import READ_CHUNK

log = logging.getLogger("runtimes.subprocess")


def _open_regular(path: str, flags: int, *, local: bool = False) -> tuple[int, os.stat_result]:
    """Open a file without blocking on a FIFO or a socket (a read or write of one would
    wait for a peer for ever, in a thread nobody can cancel); those are refused. The fd and
    its ``fstat``. ``local``: every mount is local (:mod:`.mounts`), where ``O_NONBLOCK``
    means nothing to a regular file's reads and writes: it is left set (two ``fcntl`` calls
    saved); anything else is made blocking again.

    Raises:
        OSError: the open failed.
        SandboxIsADirectoryError: ``path`` is a directory.
        SandboxInvalidArgumentError: ``path`` is a FIFO or a socket.
    """
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, or a socket
            raise SandboxInvalidArgumentError(
                f"{path!r} is a FIFO or a socket, not a file"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            raise SandboxIsADirectoryError(path)
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            raise SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
        if not (local and stat.S_ISREG(mode)):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_file(path: str, limit: int) -> bytes:
    """The bytes of the file at ``path`` (at most ``limit`` + 1: more means over the limit).

    Raises:
        OutputLimitExceededError: the file is larger than ``limit``.
        SandboxError: typed by errno (no such file, a directory, a FIFO...).
    """
    return read_opened(*open_for_read(path, limit))


def open_for_read(path: str, limit: int, *, local: bool = False) -> tuple[int, int, bool, str, int]:
    """Open ``path`` to read it: (fd, size, regular, path, limit) for :func:`read_opened`,
    which closes the fd. Opening never waits (a FIFO or a socket is refused). ``local``:
    as for :func:`_open_regular`.

    Raises:
        OutputLimitExceededError: the file is larger than ``limit`` (the fd is closed).
        SandboxError: typed by errno.
    """
    from ..errors import OutputLimitExceededError

    try:
        fd, st = _open_regular(path, os.O_RDONLY, local=local)
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, path, None) from None
    if st.st_size > limit:
        os.close(fd)
        raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
    return fd, st.st_size, stat.S_ISREG(st.st_mode), path, limit


def read_opened(fd: int, size: int, regular: bool, path: str, limit: int) -> bytes:
    """Read what :func:`open_for_read` opened (the fd is closed): one read of the size
    ``fstat`` gave and one more that finds the end, as ``open().read()`` does; a file that
    grew (or reports no size, as ``/proc`` files do) is read on, to at most ``limit`` + 1
    bytes.

    Raises:
        SandboxError: the read failed (typed by errno).
    """
    try:
        with os.fdopen(fd, "rb", buffering=0) as fh:
            data = fh.read(min(size, limit) + 1)
            if not data:
                return b""
            chunks, total, chunk = [data], len(data), READ_CHUNK
            while total <= limit:
                # A small read finds the end (a large one's buffer would cost more than
                # the read); a file still growing is read in ever larger chunks.
                more = fh.read(min(limit + 1 - total, chunk))
                chunk = max(chunk, total)
                if not more:
                    break
                chunks.append(more)
                total += len(more)
            return data if len(chunks) == 1 else b"".join(chunks)
    except OSError as exc:
        raise error_for_errno(exc.errno, path, None) from None


def write_file(path: str, data: bytes) -> None:
    """Write ``data`` to the file at ``path`` (created, parents too, or truncated).

    Raises:
        SandboxError: typed by errno (a directory, a parent that is a file, a FIFO...).
    """
    write_opened(open_for_write(path)[0], path, data)


def open_for_write(path: str, *, local: bool = False) -> tuple[int, bool]:
    """Open ``path`` for :func:`write_opened` (parents made, the file created or truncated):
    (fd, whether it is a regular file). Opening never waits (a FIFO or a socket is
    refused). The file is opened at once; only where that fails for a missing parent are
    the parents made (and a parent that is a file named). ``local``: as for
    :func:`_open_regular`.

    Raises:
        SandboxError: typed by errno (a directory, a parent that is a file...).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd, st = _open_regular(path, flags, local=local)
        return fd, stat.S_ISREG(st.st_mode)
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        if exc.errno == errno.EISDIR:
            raise SandboxIsADirectoryError(path) from None
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise error_for_errno(exc.errno, path, None) from None
    try:
        if os.path.isdir(path):
            raise SandboxIsADirectoryError(path)
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        fd, st = _open_regular(path, flags, local=local)
        return fd, stat.S_ISREG(st.st_mode)
    except FileExistsError as exc:  # a parent exists as a file: makedirs says EEXIST
        raise error_for_errno(
            errno.ENOTDIR, path, f"parent is not a directory: {exc.filename}"
        ) from None
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, path, None) from None


def write_opened(fd: int, path: str, data: bytes) -> None:
    """Write all of ``data`` to what :func:`open_for_write` opened (the fd is closed).

    Raises:
        SandboxError: the write failed (typed by errno: no space...).
    """
    try:
        with os.fdopen(fd, "wb", buffering=0) as fh:
            view = memoryview(data)
            while view:
                written = fh.write(view)
                if written is None:  # a non-blocking descriptor that would block
                    raise error_for_errno(errno.EAGAIN, path, None)
                view = view[written:]
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, path, None) from None


def remove_path(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise error_for_errno(exc.errno, path, None) from None


def copy_local_tree(source: Path, target: Path, shown: str) -> None:
    try:
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True, symlinks=True)
        else:
            if target.is_dir():
                raise SandboxIsADirectoryError(shown)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    except FileExistsError:
        raise error_for_errno(errno.ENOTDIR, shown, "a parent is not a directory") from None
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, shown, None) from None


def download_tree(remote: str, local: Path, limit: int) -> None:
    if not os.path.lexists(remote):
        raise SandboxFileNotFoundError(remote)
    try:
        if os.path.isdir(remote):
            shutil.copytree(remote, local, dirs_exist_ok=True, symlinks=True)
        else:
            data = read_file(remote, limit)
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, remote, None) from None


# ---------------------------------------------------------------------- a user's workdir


@dataclass(frozen=True)
class CreatedDir:
    """The topmost directory a ``create_workdir`` start created, with the (st_dev, st_ino)
    of it and of its parent at creation: removal checks both before touching anything."""

    path: Path
    identity: tuple[int, int]
    parent_identity: tuple[int, int]

    def to_meta(self) -> dict[str, object]:
        return {
            "path": str(self.path),
            "identity": list(self.identity),
            "parent_identity": list(self.parent_identity),
        }

    @classmethod
    def from_meta(cls, raw: object) -> CreatedDir | None:
        """The record :meth:`to_meta` wrote, or None if ``raw`` is not one."""
        if not isinstance(raw, dict):
            return None
        path = raw.get("path")
        ident, parent = _int_pair(raw.get("identity")), _int_pair(raw.get("parent_identity"))
        if not (isinstance(path, str) and path.startswith("/") and path.strip("/")):
            return None
        if ident is None or parent is None:
            return None
        return cls(Path(path), ident, parent)

    def remove(self) -> None:
        """Remove the directory and everything in it, never following a link. Never
        raises; a directory or parent that is not the one created is left alone."""
        remove_sandbox_dir(self.path, self.identity, parent_identity=self.parent_identity)


def _int_pair(raw: object) -> tuple[int, int] | None:
    if isinstance(raw, list) and len(raw) == 2 and all(type(n) is int for n in raw):
        return (raw[0], raw[1])
    return None


def prepare_workdir(workdir: Path, *, create: bool) -> CreatedDir | None:
    """Check that a user's absolute ``workdir`` is a directory, or create it and its missing
    parents with ``create``; return the topmost directory created (None: none was).

    Raises:
        SandboxFileNotFoundError: ``workdir`` is missing and ``create`` is false.
        SandboxNotADirectoryError: ``workdir`` exists and is not a directory.
        OSError: a directory could not be created.
    """
    missing: list[Path] = []
    probe = workdir
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    if missing and not create:
        raise SandboxFileNotFoundError(
            str(workdir), "the workdir does not exist; create_workdir=True creates it"
        )
    created: CreatedDir | None = None
    for directory in reversed(missing):
        try:
            os.mkdir(directory)
        except FileExistsError:  # made meanwhile by someone else: not ours to remove
            continue
        if created is None:
            st, parent = os.lstat(directory), os.stat(directory.parent)
            created = CreatedDir(directory, (st.st_dev, st.st_ino), (parent.st_dev, parent.st_ino))
    if not os.path.isdir(workdir):
        if created is not None:
            created.remove()
        raise SandboxNotADirectoryError(str(workdir), "the workdir is not a directory")
    return created


# ---------------------------------------------------------------------- removal


def remove_sandbox_dir(
    directory: Path,
    identity: tuple[int, int] | None,
    *,
    parent_identity: tuple[int, int] | None = None,
) -> None:
    """Remove the sandbox's directory, never following a symbolic link. Never raises.

    Every directory is pinned by an ``O_PATH|O_NOFOLLOW|O_DIRECTORY`` descriptor before it
    is touched, made searchable and writable through that descriptor (``chmod`` of
    ``/proc/self/fd/N`` acts on the pinned inode, never on what a name points to), then
    emptied relative to its own descriptor; links and files are unlinked, never opened or
    chmodded; no mount point is crossed. ``identity`` ((st_dev, st_ino) at creation) must
    match, else the entry at that name is not the sandbox's and is left alone. A symbolic
    link planted at the sandbox's own name is unlinked. With ``parent_identity``, the
    parent directory the path leads to must be that one too (a parent swapped for a link
    to elsewhere is left alone).
    """
    errors: list[str] = []
    try:
        parent_fd = os.open(directory.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot remove %s: %s", directory, exc)
        return
    try:
        parent = os.fstat(parent_fd)
        if parent_identity is not None and (parent.st_dev, parent.st_ino) != parent_identity:
            log.warning("%s: its parent is not the one it was created in, left alone", directory)
            return
        name = directory.name
        try:
            st = os.lstat(name, dir_fd=parent_fd)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            if stat.S_ISLNK(st.st_mode) or identity is None:
                _unlink_at(parent_fd, name, str(directory), errors)
        elif identity is not None and (st.st_dev, st.st_ino) != identity:
            errors.append(f"{directory}: not the sandbox's directory any more, left alone")
        else:
            _remove_tree_at(parent_fd, name, str(directory), errors)
    finally:
        os.close(parent_fd)
    if errors:
        log.warning("could not remove all of %s: %s", directory, "; ".join(errors[:10]))


def _unlink_at(
    dir_fd: int, name: str, shown: str, errors: list[str], *, directory: bool = False
) -> None:
    """Unlink ``name`` of ``dir_fd`` (an empty directory with ``directory``); gone already
    is fine, any other failure is noted in ``errors``."""
    try:
        (os.rmdir if directory else os.unlink)(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        errors.append(f"{shown}: {exc.strerror}")


def _open_dir_at(parent_fd: int, name: str) -> int:
    """A readable descriptor of the real directory ``name`` (never a link), made u+rwx."""
    try:  # the common case, a directory already u+rwx: opened at once, never a link
        fd = os.open(
            name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd
        )
    except PermissionError:
        fd = -1
    if fd >= 0:
        try:
            usable = stat.S_IMODE(os.fstat(fd).st_mode) & 0o700 == 0o700
        except OSError:
            os.close(fd)
            raise
        if usable:
            return fd
        os.close(fd)
    pinned = os.open(
        name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd
    )
    try:
        via = f"/proc/self/fd/{pinned}"
        if stat.S_IMODE(os.fstat(pinned).st_mode) & 0o700 != 0o700:
            os.chmod(via, 0o700)  # the pinned inode: /proc's fd links are not path lookups
        return os.open(via, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(pinned)


def _remove_tree_at(parent_fd: int, name: str, shown: str, errors: list[str]) -> None:
    """Remove directory ``name`` of ``parent_fd`` and everything in it (iteratively, so a
    deep tree does not exhaust the interpreter's stack)."""
    try:
        top = _open_dir_at(parent_fd, name)
    except OSError as exc:
        errors.append(f"{shown}: {exc.strerror}")
        return
    device = os.fstat(top).st_dev
    # Frames: (descriptor, name in the parent, display path, entries not yet removed).
    stack: list[tuple[int, str, str, list[tuple[str, bool]]]] = [(top, name, shown, _entries(top))]
    while stack:
        fd, own_name, own_shown, pending = stack[-1]
        if not pending:
            stack.pop()
            os.close(fd)
            parent = stack[-1][0] if stack else parent_fd
            _unlink_at(parent, own_name, own_shown, errors, directory=True)
            continue
        entry, listed_dir = pending.pop()
        entry_shown = f"{own_shown}/{entry}"
        if not listed_dir and _unlinked(fd, entry, entry_shown, errors):
            continue  # not a directory when listed: unlinked without a stat
        try:
            st = os.lstat(entry, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(f"{entry_shown}: {exc.strerror}")
            continue
        if not stat.S_ISDIR(st.st_mode):
            _unlink_at(fd, entry, entry_shown, errors)
        elif st.st_dev != device:
            errors.append(f"{entry_shown}: a mount point, not crossed")
        else:
            try:
                child = _open_dir_at(fd, entry)
            except OSError as exc:  # ELOOP/ENOTDIR: replaced by a link meanwhile
                errors.append(f"{entry_shown}: {exc.strerror}")
                continue
            stack.append((child, entry, entry_shown, _entries(child)))


def _entries(fd: int) -> list[tuple[str, bool]]:
    """(name, whether it is a directory) of every entry, from the listing's own types (a
    stat only where the filesystem gives none); links are not directories."""
    with os.scandir(fd) as it:
        return [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in it]


def _unlinked(dir_fd: int, name: str, shown: str, errors: list[str]) -> bool:
    """Unlink ``name`` of ``dir_fd``, listed as no directory: True when done (or gone
    already, or noted in ``errors``), False when it is a directory now (replaced since it
    was listed): the caller removes it as one."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        return False
    except OSError as exc:
        if exc.errno == errno.EPERM:  # some systems say EPERM for a directory
            return False
        errors.append(f"{shown}: {exc.strerror}")
    return True


# ---------------------------------------------------------------------- process sweep
