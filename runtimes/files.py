"""The file operations of :class:`~runtimes.base.Runtime`: ``read``, ``write``, ``exists``,
``lstat``, ``mkdir``, ``remove``, ``upload`` and ``download`` (``docs/files.md``). Each
checks its arguments, resolves the path and goes through the channel where there is one
(:mod:`.primitives`); :mod:`.listing` adds ``stat``, ``list`` and ``glob``.
"""

from __future__ import annotations

import logging
import posixpath
from pathlib import Path

import anyio

from ._extract import LINKS, Links
from ._staging import download_staged
from .arguments import PathLike, check_local_path, text_bytes
from .channel.agent.wire import PathInfo
from .errors import (
    OutputLimitExceededError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
)
from .guards import Guarded

log = logging.getLogger("runtimes")


class FileOperations(Guarded):
    """The file half of :class:`~runtimes.base.Runtime` (see the module)."""

    async def read(self, path: PathLike, *, max_bytes: int | None = None) -> bytes:
        """The exact bytes of a file.

        Raises:
            SandboxFileNotFoundError: no such file.
            SandboxIsADirectoryError: ``path`` is a directory.
            SandboxNotADirectoryError: a parent of ``path`` is not a directory.
            SandboxPermissionError: not readable.
            OutputLimitExceededError: the file is larger than ``max_bytes`` (default:
                the config's ``read_limit``); nothing is returned.
            SandboxInvalidArgumentError: a malformed path (NUL byte, empty).
        """
        self._check_open()
        resolved = self.resolve_path(path)
        limit = self.config.read_limit if max_bytes is None else max_bytes
        if limit < 0:
            raise SandboxInvalidArgumentError(f"max_bytes must be >= 0, got {limit}")
        with self._guard("read", resolved):
            data = await self._routed_read(resolved, limit)
        if len(data) > limit:
            raise OutputLimitExceededError(f"read of {resolved!r}", limit, path=resolved)
        return data

    async def write(self, path: PathLike, data: bytes | str) -> None:
        """Write ``data`` to a file, creating parent directories, replacing any old content.

        Raises:
            SandboxIsADirectoryError: ``path`` is a directory.
            SandboxNotADirectoryError: a parent of ``path`` is a file.
            SandboxPermissionError: not writable.
            SandboxInvalidArgumentError: a malformed path (NUL byte, empty).
        """
        self._check_open()
        resolved = self.resolve_path(path)
        payload = text_bytes(data, "data") if isinstance(data, str) else bytes(data)
        with self._guard("write", resolved):
            await self._routed_write(resolved, payload)

    async def exists(self, path: PathLike) -> bool:
        """Whether anything (file, directory, symlink, even a dangling one) is at ``path``.

        A missing parent is ``False``, not an error.

        Raises:
            SandboxPermissionError: a parent directory cannot be searched.
            SandboxInvalidArgumentError: a malformed path.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        with self._guard("exists", resolved):
            return await self._routed_exists(resolved)

    async def lstat(self, path: PathLike, *, content_limit: int = 0) -> PathInfo:
        """What is at ``path``, never following a link there: its kind (``absent``,
        ``file``, ``directory``, ``symlink``, ``other``), mode bits, owner, link count,
        size, a link's target, and a regular file's first ``content_limit + 1`` bytes
        (read without following a link). Served by the channel agent where there is one,
        so a root policy that replaced ``sh`` or ``stat`` cannot answer for it.

        Raises:
            SandboxPermissionError: a parent cannot be searched, or the file not read.
            SandboxInvalidArgumentError: a malformed path, or a negative limit.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        if content_limit < 0:
            raise SandboxInvalidArgumentError(f"content_limit must be >= 0, got {content_limit}")
        with self._guard("lstat", resolved):
            return await self._routed_lstat(resolved, content_limit)

    async def mkdir(
        self, path: PathLike, *, mode: int = 0o755, uid: int = -1, gid: int = -1
    ) -> None:
        """Make one fresh directory at ``path`` with exactly ``mode`` (no umask) and owner
        ``uid``/``gid`` (-1: the sandbox's default user's), inside a parent that is a real
        directory (a link there is refused). Nothing may be at ``path`` yet.

        Raises:
            SandboxFileExistsError: something (a dangling link included) is at ``path``.
            SandboxError: its parent is a link or missing (typed by errno where it has a
                class: ``SandboxNotADirectoryError``, ``SandboxFileNotFoundError``).
            SandboxPermissionError: not allowed.
            SandboxInvalidArgumentError: a malformed path.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        with self._guard("mkdir", resolved):
            await self._routed_mkdir(resolved, mode, uid, gid)

    async def remove(self, path: PathLike, *, missing_ok: bool = False) -> None:
        """Remove a file, a symlink (not its target) or a whole directory tree.

        Raises:
            SandboxFileNotFoundError: nothing at ``path`` and not ``missing_ok``.
            SandboxPermissionError: not removable.
            SandboxInvalidArgumentError: a malformed path, or ``/``, the workdir or a
                parent of the workdir.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        target = posixpath.normpath(resolved)
        workdir = posixpath.normpath(self.workdir)
        if target == "/":
            raise SandboxInvalidArgumentError("refusing to remove '/'")
        if target == workdir or workdir.startswith(target + "/"):
            raise SandboxInvalidArgumentError(
                f"refusing to remove the workdir {self.workdir!r} or a parent of it ({resolved!r})"
            )
        with self._guard("remove", resolved):
            if not await self._routed_exists(resolved):
                if missing_ok:
                    return
                raise SandboxFileNotFoundError(resolved)
            await self._routed_remove(resolved)

    async def upload(self, local: PathLike, remote: PathLike) -> None:
        """Copy a local file or directory tree to ``remote`` (created, parents included).

        A directory's contents land inside ``remote``; existing files are replaced. A file
        uploaded to a ``remote`` ending in ``/`` lands inside that directory under its own
        name (``upload("f.txt", "d/")`` writes ``d/f.txt``, creating ``d``), as ``cp f d/``.
        A failed upload removes the directories it created (``d``, the ``remote`` of a
        directory upload, and their missing parents).

        Raises:
            FileNotFoundError: the local source does not exist (a host-side error).
            SandboxInvalidArgumentError: a NUL byte in ``local``, a malformed ``remote``.
            SandboxNotADirectoryError / SandboxIsADirectoryError: kinds clash at ``remote``.
            SandboxPermissionError: not writable.
        """
        self._check_open()
        check_local_path(local)
        source = Path(local)
        if not await anyio.Path(source).exists():
            raise FileNotFoundError(
                2, "No such file or directory (local upload source)", str(local)
            )
        resolved = self.resolve_path(remote)
        is_file = not await anyio.Path(source).is_dir()
        if is_file and isinstance(remote, str) and remote.endswith("/"):
            resolved = self.resolve_path(posixpath.join(resolved, source.name))
        # the directory this upload may create: the file's parent, or the tree's root
        made = posixpath.dirname(resolved) if is_file else resolved
        with self._guard("upload", resolved):
            created = await self._missing_top(made)
            try:
                await self._upload(source, resolved)
            except BaseException:
                if created is not None:
                    with anyio.CancelScope(shield=True):
                        try:
                            await self._routed_remove(created)
                        except SandboxError as exc:
                            log.warning("upload: could not remove %r: %s", created, exc)
                raise

    async def _missing_top(self, path: str) -> str | None:
        """The topmost of ``path`` and its parents that is missing, or ``None`` if
        ``path`` exists."""
        top = None
        current = posixpath.normpath(path)
        while current != "/" and not await self._routed_exists(current):
            top, current = current, posixpath.dirname(current)
        return top

    async def download(
        self,
        remote: PathLike,
        local: PathLike,
        *,
        skip_unsafe: bool = False,
        links: Links = "contained",
    ) -> None:
        """Copy a sandbox file or directory tree to ``local`` (parents created).

        All or nothing: the download lands in a fresh staging directory next to ``local``
        and is moved into place only once complete, so a failed download leaves ``local``
        exactly as it was (nothing created, not even its parents; nothing overwritten). A
        directory's contents land inside ``local`` (merged into an existing directory). With
        ``links="keep"`` every symlink is kept as a link, whatever it points to (a venv's
        ``bin/python -> /usr/bin/python3``), as ``docker cp`` does; none is ever followed
        on the host. The sandbox is treated as hostile:
        its tree is unpacked on the host without ever following a symlink, and nothing
        outside ``local`` is created or changed. A member that would leave ``local`` (an
        absolute or ``..`` name, a path through a symlink, a symlink that is absolute or
        resolves outside ``local``, a hard link to anything this download did not
        extract, a device or FIFO) raises :class:`UnsafeArchiveMemberError` naming it;
        with ``skip_unsafe=True`` such members are left out instead, each logged as a
        warning on the ``runtimes`` logger, and the rest is downloaded. (The subprocess
        backend copies its own host tree and keeps symlinks as links, never following
        them; it is not a boundary.) docs/files.md has the details.

        Raises:
            SandboxFileNotFoundError: nothing at ``remote``.
            SandboxPermissionError: not readable.
            OutputLimitExceededError: the tree is larger than the config's ``read_limit``.
            UnsafeArchiveMemberError: an unsafe member (above; the message names the option
                that would take it), more members or deeper paths than the extractor allows
                (the member count bound is never skipped), or a downloaded directory that
                meets a link or a file inside an existing ``local``.
            SandboxInvalidArgumentError: a NUL byte in ``local``, a malformed ``remote``, an
                unknown ``links``, or a directory downloaded onto a file (or the reverse).
            SandboxError: the sandbox's archive of the tree is malformed.
        """
        self._check_open()
        check_local_path(local)
        if links not in LINKS:
            raise SandboxInvalidArgumentError(f"links must be one of {LINKS}, got {links!r}")
        resolved = self.resolve_path(remote)
        with self._guard("download", resolved):
            await download_staged(
                Path(local),
                lambda staged: self._download(
                    resolved, staged, skip_unsafe=skip_unsafe, links=links
                ),
            )
