"""Listing a sandbox's files: :meth:`Listing.list`, :meth:`Listing.stat` and
:meth:`Listing.glob`, one implementation above every backend.

Each call runs one fixed program in the sandbox through the runtime's own exec (so through
the channel where there is one, the plain path otherwise), as the sandbox's default user
(the account ``read()`` uses, never more), with ``cwd`` ``/`` and the machinery's fixed
``PATH`` (:mod:`runtimes.machinery`): GNU ``find -printf`` writes six NUL-terminated fields
per entry (kind, mode, size, mtime, link target, path relative to the start), and GNU ``head
-z`` stops it after ``max_entries`` entries. A name can hold any byte but NUL and ``/``, so
the encoding is unambiguous whatever the sandbox names its files.

The answer is hostile bytes: it is received under a byte cap (the config's ``read_limit``),
cut at ``max_entries`` (:class:`~runtimes.errors.ListingLimitExceededError` past either),
and every field is validated into a :class:`FileInfo` (a malformed answer is a
:class:`~runtimes.errors.SandboxError`). Nothing on the host is touched: the paths are
strings, never opened here. Names that are not UTF-8 are decoded with ``surrogateescape``
(they round-trip into ``read()`` and friends).
"""

from __future__ import annotations

import builtins
import fnmatch
import math
import posixpath
import re
from dataclasses import dataclass
from typing import Literal

from ._local_files import shell_error
from .arguments import PathLike
from .errors import (
    ListingLimitExceededError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxNotADirectoryError,
)
from .guards import Guarded
from .machinery import MACHINERY_CWD, machinery_env
from .models import ExecRequest, OutputSink

__all__ = ["DEFAULT_MAX_ENTRIES", "FileInfo", "FileKind", "Listing"]

FileKind = Literal["file", "directory", "symlink", "other"]

DEFAULT_MAX_ENTRIES = 10_000
"""How many entries ``list`` and ``glob`` return at most unless told otherwise."""

_FIELDS = 6
_KINDS: dict[bytes, FileKind] = {b"f": "file", b"d": "directory", b"l": "symlink"}
_MAX_FIELD = 4096 * 4
"""The longest path or link target accepted from the sandbox (PATH_MAX is 4096)."""

_SCRIPT = r"""
op=$1 p=$2 n=$3 depth=$4 pat=$5 hidden=$6
fmt='%y\0%m\0%s\0%T@\0%l\0%P\0'
case $op in
stat)
  find "$p" -maxdepth 0 -printf "$fmt" || exit 1
  exit 0 ;;
list)
  if [ ! -d "$p" ] && { [ -e "$p" ] || [ -L "$p" ]; }; then
    echo "$p: Not a directory" >&2; exit 20
  fi
  [ -d "$p" ] || { find "$p" -maxdepth 0 >/dev/null; exit 1; }
  [ -r "$p" ] && [ -x "$p" ] || { echo "$p: Permission denied" >&2; exit 13; } ;;
glob)
  [ -d "$p" ] || { printf '\0%s\0' 0; exit 0; } ;;
esac
{
  case $op in
  list) find -H "$p" -mindepth 1 -maxdepth 1 -printf "$fmt" ;;
  glob)
    if [ "$hidden" = 1 ]; then
      find -H "$p" -mindepth 1 ${depth:+-maxdepth "$depth"} -path "$pat" -printf "$fmt"
    else
      find -H "$p" -mindepth 1 ${depth:+-maxdepth "$depth"} \
        \( -name '.*' -prune \) -o -path "$pat" -printf "$fmt"
    fi 2>/dev/null ;;
  esac
  printf '\0%s\0' "$?"
} | head -z -n "$((n * 6 + 2))"
"""
"""The fixed program: ``sh -c SCRIPT sh OP PATH MAX_ENTRIES DEPTH PATTERN HIDDEN``. Its
answer is six fields per entry, then an empty field and find's exit status (missing when
``head`` cut the listing short)."""


@dataclass(frozen=True)
class FileInfo:
    """One entry of a sandbox's filesystem, as ``lstat`` sees it (a link is never followed).

    Attributes:
        name: the last component of ``path`` (``/`` for the root).
        path: the absolute sandbox path.
        kind: ``file``, ``directory``, ``symlink`` or ``other`` (device, FIFO, socket).
        size: bytes (a symlink's size is its target's length).
        mode: the permission bits, setuid/setgid/sticky included (``0o755``).
        mtime: the last modification, in seconds since the epoch.
        target: a symlink's target as stored (``None`` for anything else).
    """

    name: str
    path: str
    kind: FileKind
    size: int
    mode: int
    mtime: float
    target: str | None = None


class Listing(Guarded):
    """The listing half of :class:`~runtimes.base.Runtime` (see the module)."""

    async def stat(self, path: PathLike) -> FileInfo:
        """What is at ``path``, never following a link there (a symlink is reported as
        ``kind="symlink"`` with its ``target``).

        Raises:
            SandboxFileNotFoundError: nothing at ``path``.
            SandboxNotADirectoryError: a parent of ``path`` is not a directory.
            SandboxPermissionError: a parent cannot be searched.
            SandboxInvalidArgumentError: a malformed path.
            SandboxError: the sandbox lacks GNU ``find``, or its answer is malformed.
        """
        self._check_open()
        resolved = posixpath.normpath(self.resolve_path(path))
        with self._guard("stat", resolved):
            answer = await self._find("stat", resolved, 1)
        return parse_stat(answer, resolved)

    async def list(
        self, path: PathLike = ".", *, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> builtins.list[FileInfo]:
        """The entries of the directory at ``path`` (a link to a directory is followed
        there, links inside are not), sorted by name, without ``.`` and ``..``.

        Raises:
            SandboxFileNotFoundError: nothing at ``path``.
            SandboxNotADirectoryError: ``path`` (or a parent) is not a directory.
            SandboxPermissionError: the directory cannot be read.
            ListingLimitExceededError: more than ``max_entries`` entries, or an answer over
                the config's ``read_limit`` bytes.
            SandboxInvalidArgumentError: a malformed path, or ``max_entries`` < 1.
            SandboxError: the sandbox lacks GNU ``find``, or its answer is malformed.
        """
        self._check_open()
        resolved = posixpath.normpath(self.resolve_path(path))
        _check_max(max_entries)
        with self._guard("list", resolved):
            answer = await self._find("list", resolved, max_entries)
        return parse_list(answer, resolved, max_entries)

    async def glob(
        self, pattern: str, *, max_entries: int = DEFAULT_MAX_ENTRIES
    ) -> builtins.list[FileInfo]:
        """The paths that match ``pattern`` (relative to the workdir unless absolute),
        sorted, as Python's ``glob.glob(pattern, recursive=True)`` finds them: ``*``,
        ``?`` and ``[...]`` match within one component, ``**`` matches any number of
        directories (zero included), and a name starting with ``.`` is matched only by a
        component that starts with ``.``. Links to directories are not descended into
        (below the pattern's fixed leading directories); a directory that cannot be read
        is skipped; no match, or a missing start, is an empty list.

        Raises:
            ListingLimitExceededError: more than ``max_entries`` candidate entries, or an
                answer over the config's ``read_limit`` bytes.
            SandboxInvalidArgumentError: a malformed pattern, or ``max_entries`` < 1.
            SandboxError: the sandbox lacks GNU ``find``, or its answer is malformed.
        """
        self._check_open()
        _check_max(max_entries)
        if not isinstance(pattern, str):
            raise SandboxInvalidArgumentError(f"pattern must be a str, got {type(pattern)}")
        resolved = posixpath.normpath(self.resolve_path(pattern))
        parts = [part for part in resolved.split("/") if part]
        fixed = 0
        while fixed < len(parts) and not _magic(parts[fixed]):
            fixed += 1
        if fixed == len(parts):  # nothing to expand: the path itself, if anything is there
            try:
                return [await self.stat(resolved)]
            except (FileNotFoundError, NotADirectoryError):
                return []
        base = "/" + "/".join(parts[:fixed])
        segments = parts[fixed:]
        depth = "" if "**" in segments else str(len(segments))
        hidden = any(seg.startswith(".") for seg in segments)
        prefix = base.rstrip("/") + "/"
        with self._guard("glob", resolved):
            answer = await self._find(
                "glob", base, max_entries, depth, prefix + _find_pattern(segments), hidden
            )
        return parse_glob(answer, base, segments, max_entries)

    async def _find(
        self,
        op: str,
        path: str,
        max_entries: int,
        depth: str = "",
        pattern: str = "",
        hidden: bool = False,
    ) -> bytes:
        """Run the fixed program; its answer (stdout).

        Raises:
            ListingLimitExceededError: over the byte cap.
            SandboxError: typed from the program's exit status and stderr.
        """
        limit = self.config.read_limit
        argv = ["sh", "-c", _SCRIPT, "sh", op, path, str(max_entries), depth, pattern]
        request = ExecRequest(
            argv=(*argv, "1" if hidden else "0"),
            cwd=MACHINERY_CWD,
            env=machinery_env(),
            stdin=None,
            user=None,
            timeout=None,
            output_limit=limit,
        )
        sink = OutputSink(limit)
        code = await self._routed_exec(request, sink)
        if sink.overflowed:
            raise ListingLimitExceededError(path, limit, "bytes")
        if code == 20:
            raise SandboxNotADirectoryError(path)
        if code == 127 or b"unknown predicate" in bytes(sink.stderr):
            raise SandboxError(
                f"{self.describe()}: listing {path!r} needs GNU find and head in the sandbox: "
                + bytes(sink.stderr).decode("utf-8", "replace").strip()[:500]
            )
        if code != 0:
            raise shell_error(path, sink)
        return bytes(sink.stdout)


def _check_max(max_entries: int) -> None:
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
        raise SandboxInvalidArgumentError(f"max_entries must be an int >= 1, got {max_entries!r}")


def parse_stat(answer: bytes, path: str) -> FileInfo:
    """``stat``'s answer (one entry, no status record) for ``path``.

    Raises:
        SandboxError: a malformed answer.
    """
    fields = answer.split(b"\0")
    if len(fields) != _FIELDS + 1 or fields[-1] != b"" or fields[5] != b"":
        raise SandboxError(f"malformed stat answer for {path!r}")
    return _info(fields[:_FIELDS], path, posixpath.basename(path) or "/", path)


def parse_list(answer: bytes, base: str, max_entries: int) -> builtins.list[FileInfo]:
    """``list``'s answer for the directory ``base``, sorted by name.

    Raises:
        ListingLimitExceededError: over ``max_entries`` (or cut short by ``head``).
        SandboxError: a malformed answer.
    """
    infos = []
    for fields in _entries(answer, base, max_entries):
        rel = fields[5].decode("utf-8", "surrogateescape")
        if not _is_name(rel):
            raise SandboxError(f"malformed listing entry {rel!r} under {base!r}")
        infos.append(_info(fields, base, rel, posixpath.join(base, rel)))
    return sorted(infos, key=lambda info: info.name)


def parse_glob(
    answer: bytes, base: str, segments: builtins.list[str], max_entries: int
) -> builtins.list[FileInfo]:
    """``glob``'s answer below ``base``: the entries that match ``segments``, sorted.

    Raises:
        ListingLimitExceededError: over ``max_entries`` (or cut short by ``head``).
        SandboxError: a malformed answer.
    """
    prefix = base.rstrip("/") + "/"
    infos = []
    for fields in _entries(answer, base, max_entries):
        if len(fields[5]) > _MAX_FIELD:
            raise SandboxError(f"malformed glob entry under {base!r}: a path too long")
        rel = fields[5].decode("utf-8", "surrogateescape")
        names = rel.split("/")
        if not all(_is_name(name) for name in names):
            raise SandboxError(f"malformed glob entry {rel!r} under {base!r}")
        if _matches(segments, names):
            infos.append(_info(fields, base, names[-1], prefix + rel))
    return sorted(infos, key=lambda info: info.path)


def _entries(answer: bytes, base: str, max_entries: int) -> builtins.list[builtins.list[bytes]]:
    """The six-field entries of a ``list`` or ``glob`` answer, which ends with a status
    record (an empty field, then find's exit status) unless ``head`` cut it.

    Raises:
        ListingLimitExceededError: more than ``max_entries``, or no status record.
        SandboxError: a malformed answer.
    """
    fields = answer.split(b"\0")
    if fields[-1] != b"":
        raise SandboxError(f"malformed listing of {base!r}: no NUL at its end")
    fields.pop()
    entries = []
    complete = False
    at = 0
    while at < len(fields):
        if fields[at] == b"":  # the status record
            status = fields[at + 1] if at + 1 < len(fields) else b""
            if at + 2 != len(fields) or not re.fullmatch(rb"[0-9]{1,3}", status):
                raise SandboxError(f"malformed listing of {base!r}: a bad status record")
            complete = True
            break
        if at + _FIELDS > len(fields):  # head cut inside the entry past the limit
            break
        entries.append(fields[at : at + _FIELDS])
        at += _FIELDS
    if not complete or len(entries) > max_entries:
        raise ListingLimitExceededError(base, max_entries)
    return entries


def _info(fields: list[bytes], where: str, name: str, path: str) -> FileInfo:
    """One validated entry.

    Raises:
        SandboxError: a field that is not what find writes.
    """
    kind_b, mode_b, size_b, mtime_b, target_b, _ = fields
    try:
        if len(target_b) > _MAX_FIELD or len(path) > _MAX_FIELD:
            raise ValueError("too long")
        if len(kind_b) != 1:
            raise ValueError("kind")
        if not (re.fullmatch(rb"[0-7]{1,5}", mode_b) and size_b.isdigit() and len(size_b) < 21):
            raise ValueError("mode or size")
        mode, size = int(mode_b, 8), int(size_b)
        if not re.fullmatch(rb"-?[0-9]{1,12}(\.[0-9]{0,12})?", mtime_b) or mode > 0o7777:
            raise ValueError("mtime or mode")
        mtime = float(mtime_b)
        if not math.isfinite(mtime):
            raise ValueError("mtime")
    except ValueError as exc:
        raise SandboxError(f"malformed listing entry under {where!r}: {exc}") from None
    kind = _KINDS.get(kind_b, "other")
    target = target_b.decode("utf-8", "surrogateescape") if kind == "symlink" else None
    return FileInfo(name, path, kind, size, mode, mtime, target)


def _is_name(name: str) -> bool:
    return name not in ("", ".", "..") and "/" not in name


def _magic(part: str) -> bool:
    return any(char in part for char in "*?[")


def _find_pattern(segments: list[str]) -> str:
    """A ``find -path`` pattern matching every path ``segments`` match (and maybe more:
    find's ``*`` crosses ``/``); the host then matches exactly (:func:`_matches`)."""
    out = ""
    for seg in segments:
        out += "*" if seg == "**" else seg + "/"
    return out.rstrip("/") or "*"


def _matches(segments: builtins.list[str], names: builtins.list[str]) -> bool:
    """Whether the components ``names`` match the glob ``segments`` (``**``: any number
    of non-hidden components; a leading ``.`` only by a segment that starts with ``.``).
    Iterative (a hostile path may be thousands of components deep)."""
    states = _closure({0}, segments)
    for name in names:
        hidden = name.startswith(".")
        after: set[int] = set()
        for index in states:
            if index == len(segments):
                continue
            seg = segments[index]
            if seg == "**":
                if not hidden:
                    after.add(index)
            elif (not hidden or seg.startswith(".")) and fnmatch.fnmatchcase(name, seg):
                after.add(index + 1)
        states = _closure(after, segments)
        if not states:
            return False
    return len(segments) in states


def _closure(states: set[int], segments: builtins.list[str]) -> set[int]:
    """``states`` and those a ``**`` matching no component leads to."""
    out = set(states)
    pending = builtins.list(states)
    while pending:
        index = pending.pop()
        if index < len(segments) and segments[index] == "**" and index + 1 not in out:
            out.add(index + 1)
            pending.append(index + 1)
    return out
