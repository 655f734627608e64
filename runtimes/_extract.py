"""Unpack a directory download's tar on the host, treating the archive as hostile.

The tar of a directory download is produced inside the sandbox (by its ``tar``, or by
the Docker engine from the sandbox's files), so a policy that ran there chooses every
member. ``tarfile``'s ``filter="data"`` is not enough on every Python the project
supports (CVE-2025-4517: a chain of symlinks pushes ``os.path.realpath`` past PATH_MAX
and the filter's containment check passes while the kernel resolves out), so nothing
here relies on it or on ``realpath``:

* every member's path is walked component by component from a directory file
  descriptor of the destination, each directory opened with ``O_DIRECTORY |
  O_NOFOLLOW``: a path through a symlink (or a file) is refused, never followed;
* files are created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to their parent's
  fd; what was at the name (a file or a symlink, never a directory) is unlinked first;
* absolute names and ``..`` components, devices and FIFOs, hard links to anything this
  extraction did not create, and symlinks whose target is absolute, climbs out of the
  destination, or has a ``..`` after a name (a symlink before it could make it climb
  further than it reads) are refused with :class:`UnsafeArchiveMemberError` naming the
  member -- or, with ``skip_unsafe=True``, left out and reported (returned, and logged
  as a warning on the ``runtimes`` logger);
* modes keep the permission bits as ``tarfile``'s ``data`` filter does (no
  setuid/setgid/sticky, no group/other write; directories and symlinks get defaults);
  owners are never changed;
* the member count and path depth are bounded, so a tar of millions of empty entries
  is a typed error rather than an endless extraction; a name component over
  ``NAME_MAX``, a symlink target over ``PATH_MAX`` and a NUL byte in either (a pax header
  can carry one) are refused like the rest (never an ``ENAMETOOLONG`` or ``ValueError``
  halfway through).

With ``links="keep"`` a symlink is created as the archive has it, whatever its target
(absolute, out of the destination: a Python venv's ``bin/python``), as ``docker cp`` does;
the rest is checked as above, and still nothing is written through a link: every path is
walked ``O_NOFOLLOW``, so a member below a kept link is refused like any path through a
link, and the extraction happens in a staging directory of its own.

The extraction is all or nothing (:mod:`runtimes._staging`): it lands in a fresh staging
directory next to the destination and is put in place only once complete, so a refused
member (or a malformed archive) leaves the destination exactly as it was -- nothing created,
nothing overwritten, not even its parents.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

from ._staging import staged_download
from .errors import SandboxError, UnsafeArchiveMemberError

Links = Literal["contained", "keep"]
"""How a download treats the sandbox's symlinks: ``contained`` (the default) creates only
those that stay inside the destination (the others are unsafe members); ``keep`` creates
every one as it is, never following any."""

LINKS: tuple[str, ...] = ("contained", "keep")

log = logging.getLogger("runtimes")

MAX_MEMBERS = 250_000
"""Most members one download's archive may hold (a 256 MiB ``read_limit`` allows at most
~500k empty ones; real trees rarely pass 100k files)."""

MAX_DEPTH = 128
"""Most path components one member's name may have."""

NAME_MAX = 255
"""Most bytes of one path component (Linux filesystems): a longer name is refused typed,
never left to fail the extraction with ``ENAMETOOLONG``."""

TARGET_MAX = 4095
"""Most bytes of a symlink's target (``PATH_MAX`` less its NUL)."""

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
_LOGGED_SKIPS = 20


@dataclass(frozen=True)
class SkippedMember:
    """A member ``skip_unsafe=True`` left out: its name in the archive, and why."""

    member: str
    reason: str


def extract_archive(
    archive: BinaryIO,
    dest: Path,
    *,
    skip_unsafe: bool = False,
    strip: str | None = None,
    max_members: int = MAX_MEMBERS,
    max_depth: int = MAX_DEPTH,
    links: Links = "contained",
) -> list[SkippedMember]:
    """Unpack the tar in ``archive`` (a seekable binary file) into the directory ``dest``.

    ``dest`` and its parents are created if missing, all or nothing (see the module); an
    existing ``dest`` directory is merged into. ``links``: see :data:`Links`. With
    ``strip``, only members under
    the top component ``strip`` are extracted, that component dropped (the Docker
    engine names a directory's members ``<basename>/...``); other members are ignored.

    Returns the members left out by ``skip_unsafe=True`` (empty otherwise).

    Raises:
        UnsafeArchiveMemberError: a member would leave ``dest`` or is refused (see the
            module's docstring); with ``skip_unsafe=True`` only for the member-count
            bound, which is never skipped.
        SandboxError: the archive is not a readable tar.
        OSError: a host-side failure creating the files (disk full, no permission).
    """
    with staged_download(dest) as staged:
        staged.mkdir()
        return _extract_into(archive, staged, skip_unsafe, strip, max_members, max_depth, links)


def _extract_into(
    archive: BinaryIO,
    dest: Path,
    skip_unsafe: bool,
    strip: str | None,
    max_members: int,
    max_depth: int,
    links: Links,
) -> list[SkippedMember]:
    root = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    extractor = _Extractor(root, skip_unsafe, max_depth, keep_links=links == "keep")
    try:
        with tarfile.open(fileobj=archive, mode="r:") as tar:
            count = 0
            while True:
                member = tar.next()
                if member is None:
                    break
                # tarfile keeps every header it read; this extraction needs none of them.
                del tar.members[:]  # type: ignore[attr-defined]
                count += 1
                if count > max_members:
                    raise UnsafeArchiveMemberError(
                        member.name, f"the archive holds more than {max_members} members"
                    )
                name = member.name
                if strip is not None:
                    if name == strip or not name.startswith(strip + "/"):
                        continue
                    name = name[len(strip) + 1 :]
                extractor.extract(tar, member, name, strip)
    except tarfile.TarError as exc:
        raise SandboxError(f"the downloaded archive for {str(dest)!r} is malformed: {exc}") from exc
    finally:
        extractor.close()
        os.close(root)
    return extractor.skipped


def _split(member: str, name: str) -> list[str]:
    """The components of a member's name; absolute names and ``..`` are refused."""
    if name.startswith("/"):
        raise UnsafeArchiveMemberError(member, "an absolute name")
    if "\x00" in name:  # a pax header can carry one; no system call takes it
        raise UnsafeArchiveMemberError(member, "a NUL byte in its name")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchiveMemberError(member, "a '..' component in its name")
    if any(len(os.fsencode(part)) > NAME_MAX for part in parts):
        raise UnsafeArchiveMemberError(member, f"a name component over {NAME_MAX} bytes")
    return parts


def check_symlink(member: str, where: list[str], target: str, keep: bool = False) -> None:
    """Refuse a symlink target that is absolute or could resolve outside the destination.

    Only leading ``..`` components may climb, and no higher than the link's own
    directory's depth: those directories are real (never symlinks: see ``_dir``), so the
    kernel climbs exactly as far as the text says. After the first name, a ``..`` is
    refused, since that name may be a symlink to a shallower place.
    """
    if not target:
        raise UnsafeArchiveMemberError(member, "a symlink with an empty target")
    if "\x00" in target:
        raise UnsafeArchiveMemberError(member, "a symlink target with a NUL byte")
    if len(os.fsencode(target)) > TARGET_MAX:
        raise UnsafeArchiveMemberError(member, f"a symlink target over {TARGET_MAX} bytes")
    if keep:  # kept as it is: never followed here, whatever it names
        return
    if target.startswith("/"):
        raise UnsafeArchiveMemberError(member, f"a symlink to the absolute path {target!r}")
    parts = [part for part in target.split("/") if part not in ("", ".")]
    ups = 0
    while ups < len(parts) and parts[ups] == "..":
        ups += 1
    if ".." in parts[ups:]:
        raise UnsafeArchiveMemberError(
            member, f"a symlink to {target!r}: '..' after a name may climb past what it reads"
        )
    if ups > len(where):
        raise UnsafeArchiveMemberError(
            member, f"a symlink to {target!r}, which resolves outside the destination"
        )


def _file_mode(mode: int) -> int:
    """What ``tarfile``'s ``data`` filter keeps of a regular file's mode."""
    mode &= 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


class _Extractor:
    """Member-by-member extraction below one directory fd, never following a symlink."""

    def __init__(self, root: int, skip_unsafe: bool, max_depth: int, keep_links: bool) -> None:
        self._root = root
        self._keep_links = keep_links
        self._skip_unsafe = skip_unsafe
        self._max_depth = max_depth
        # The directories of the last member's parent, opened: tar lists a tree depth
        # first, so most members share all of it with the one before.
        self._stack: list[tuple[str, int]] = []
        # Regular files this extraction created (the only valid hard-link targets).
        self._files: set[tuple[str, ...]] = set()
        self.skipped: list[SkippedMember] = []

    def close(self) -> None:
        self._trim(0)

    def extract(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str, strip: str | None
    ) -> None:
        try:
            self._extract(tar, member, name, strip)
        except UnsafeArchiveMemberError as exc:
            if not self._skip_unsafe:
                if member.issym() and not self._keep_links:
                    exc.hint = (
                        "download(..., links='keep') keeps symlinks as they are, never "
                        "following them; skip_unsafe=True leaves such members out"
                    )
                else:
                    exc.hint = "download(..., skip_unsafe=True) leaves such members out"
                raise
            self.skipped.append(SkippedMember(exc.member, exc.reason))
            if len(self.skipped) <= _LOGGED_SKIPS:
                log.warning("download: skipped %s", exc)
            elif len(self.skipped) == _LOGGED_SKIPS + 1:
                log.warning("download: skipping more unsafe members (not logged one by one)")

    def _extract(
        self, tar: tarfile.TarFile, member: tarfile.TarInfo, name: str, strip: str | None
    ) -> None:
        shown = member.name
        parts = _split(shown, name)
        if len(parts) > self._max_depth:
            raise UnsafeArchiveMemberError(shown, f"deeper than {self._max_depth} components")
        if member.ischr() or member.isblk() or member.isfifo():
            raise UnsafeArchiveMemberError(shown, "a device or FIFO")
        if member.isdir():
            if parts:
                self._dir(shown, parts)
            return
        if not parts:
            raise UnsafeArchiveMemberError(shown, "a non-directory at the destination itself")
        key = tuple(parts)
        if member.issym():
            check_symlink(shown, parts[:-1], member.linkname, self._keep_links)
            parent = self._dir(shown, parts[:-1])
            self._clear(shown, parent, parts[-1])
            os.symlink(member.linkname, parts[-1], dir_fd=parent)
            self._files.discard(key)
        elif member.islnk():
            self._hard_link(shown, parts, member.linkname, strip)
        elif member.isreg():
            parent = self._dir(shown, parts[:-1])
            self._clear(shown, parent, parts[-1])
            self._write(tar, member, parent, parts[-1])
            self._files.add(key)
        else:
            raise UnsafeArchiveMemberError(shown, f"an unsupported member type {member.type!r}")

    def _hard_link(self, shown: str, parts: list[str], linkname: str, strip: str | None) -> None:
        if strip is not None and linkname.startswith(strip + "/"):
            linkname = linkname[len(strip) + 1 :]
        try:
            source = _split(shown, linkname)
        except UnsafeArchiveMemberError:
            source = []
        if not source or tuple(source) not in self._files:
            raise UnsafeArchiveMemberError(
                shown, f"a hard link to {linkname!r}, which this download did not extract"
            )
        if source == parts:
            return
        # Opened in turn: the walk below may move the cached stack away from it.
        with self._detached(shown, source[:-1]) as source_dir:
            parent = self._dir(shown, parts[:-1])
            self._clear(shown, parent, parts[-1])
            os.link(
                source[-1],
                parts[-1],
                src_dir_fd=source_dir,
                dst_dir_fd=parent,
                follow_symlinks=False,
            )
        self._files.add(tuple(parts))

    @contextmanager
    def _detached(self, shown: str, parts: list[str]) -> Iterator[int]:
        """An fd of the existing directory ``parts`` of its own, off the cached stack."""
        fd = os.dup(self._root)
        try:
            for index, part in enumerate(parts):
                with _refuse_non_directory(shown, parts[: index + 1]):
                    child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)

    def _trim(self, depth: int) -> None:
        while len(self._stack) > depth:
            os.close(self._stack.pop()[1])

    def _dir(self, shown: str, parts: list[str]) -> int:
        """An fd of the directory ``parts`` below the root, created if missing; a
        component that is a symlink (or not a directory) is refused, never followed."""
        common = 0
        while (
            common < len(self._stack)
            and common < len(parts)
            and self._stack[common][0] == parts[common]
        ):
            common += 1
        self._trim(common)
        for index in range(common, len(parts)):
            parent = self._stack[-1][1] if self._stack else self._root
            part = parts[index]
            with _refuse_non_directory(shown, parts[: index + 1]):
                try:
                    fd = os.open(part, _DIR_FLAGS, dir_fd=parent)
                except FileNotFoundError:
                    with suppress(FileExistsError):
                        os.mkdir(part, 0o777, dir_fd=parent)
                    fd = os.open(part, _DIR_FLAGS, dir_fd=parent)
            self._stack.append((part, fd))
        return self._stack[-1][1] if parts else self._root

    def _clear(self, shown: str, parent: int, name: str) -> None:
        """Unlink a file or symlink at ``name`` (never a directory; never followed)."""
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(info.st_mode):
            raise UnsafeArchiveMemberError(shown, "a directory is already at its path")
        os.unlink(name, dir_fd=parent)

    def _write(self, tar: tarfile.TarFile, member: tarfile.TarInfo, parent: int, name: str) -> None:
        source = tar.extractfile(member)
        if source is None:  # pragma: no cover - isreg() members always have content
            raise SandboxError(f"no content for the archive member {member.name!r}")
        fd = os.open(name, _FILE_FLAGS, 0o600, dir_fd=parent)
        try:
            while chunk := source.read(_CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            os.fchmod(fd, _file_mode(member.mode))
            try:
                os.utime(fd, (member.mtime, member.mtime))
            except (OSError, OverflowError, ValueError) as exc:
                log.debug("download: kept the extraction time of %r: %s", member.name, exc)
        finally:
            os.close(fd)


@contextmanager
def _refuse_non_directory(shown: str, parts: list[str]) -> Iterator[None]:
    """Turn "a symlink (O_NOFOLLOW) or a file is at this component" into the typed refusal."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise UnsafeArchiveMemberError(
            shown, f"its path goes through {'/'.join(parts)!r}, a symlink or a non-directory"
        ) from None


__all__ = ["LINKS", "MAX_DEPTH", "MAX_MEMBERS", "Links", "SkippedMember", "extract_archive"]
