"""A Docker ``build`` option (:class:`BuildSpec`) and its context, read on the host.

The context directory is packed here, not by the engine or the SDK, so that what leaves
the host is bounded and never reaches outside the context: the walk opens every directory
and file relative to its parent's descriptor without following symlinks (``O_NOFOLLOW``),
so a path swapped for a symlink while it is read is refused, not followed. A symlink in the
context is sent as a link when its target stays inside the context, and refused when it is
absolute or climbs out; devices, FIFOs and sockets are refused. ``.dockerignore`` is
honoured (the engine's pattern rules, from the docker SDK). The archive is normalized
(sorted names, no owners, no times), so its SHA-256 is a hash of the context's content:
the image's tag (:func:`build_tag`) is derived from it, the Dockerfile, the build args,
the target and the IDs of the ``FROM`` images, and an unchanged context is never rebuilt.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import posixpath
import re
import stat
import tarfile
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from .._extract import check_symlink
from ..errors import BuildContextError
from ..resources import MIB, format_mib, memory_mib

DEFAULT_MAX_CONTEXT_MIB = 256
"""The default bound of a build context's archive (``build.max_context``)."""
BUILD_REPOSITORY = "vf-sandbox/build"
"""The repository of images built from a ``build`` option (tag: the content hash)."""
BUILD_LABEL = "vf-sandbox.build"
"""Label of a built image: its content hash (``docker images --filter label=...``)."""
_ARG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SPOOL_BYTES = 8 * MIB
_DOCKERIGNORE_LIMIT = 1 * MIB
_BLOCK = 512
MAX_DEPTH = 128
"""Directories deeper than this in a build context are refused (as in downloads)."""


def _context_mib(value: Any) -> Any:
    try:
        return memory_mib(value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("memory", "max_context")) from None


class BuildSpec(BaseModel):
    """What to build an owned sandbox's image from: ``{"context": "path/to/dir",
    "dockerfile": "Dockerfile", "args": {"NAME": "value"}, "target": None,
    "max_context": "256MiB", "timeout": 1800}`` (only ``context`` is required).

    ``context`` is a host directory (relative paths are taken from the current directory
    when the config is made); ``dockerfile`` a path inside it. ``max_context`` bounds the
    archive sent to the engine (files plus 512 bytes of header per entry).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    context: str = Field(min_length=1, description="host directory sent to the engine")
    dockerfile: str = Field(default="Dockerfile", description="path inside the context")
    args: dict[str, str] = Field(default_factory=dict, description="build args (ARG)")
    target: str | None = Field(default=None, description="stage of a multi-stage build")
    max_context: Annotated[int, BeforeValidator(_context_mib)] = Field(
        default=DEFAULT_MAX_CONTEXT_MIB, description="MiB, or '64MiB', '1GiB'"
    )
    timeout: float = Field(default=1800.0, gt=0, description="seconds the build may take")

    @field_validator("context")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return os.path.abspath(os.path.expanduser(value))

    @field_validator("dockerfile")
    @classmethod
    def _inside(cls, value: str) -> str:
        name = posixpath.normpath(value.replace(os.sep, "/"))
        if not value or posixpath.isabs(name) or name == ".." or name.startswith("../"):
            raise ValueError(f"dockerfile is a path inside the build context, got {value!r}")
        return name

    @field_validator("args")
    @classmethod
    def _arg_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _ARG_NAME.match(name):
                raise ValueError(f"args: {name!r} is not a build arg name (letters, digits, _)")
        return value


def is_dockerfile_path(image: str) -> bool:
    """Whether ``image`` names a local Dockerfile rather than an image (Modal's rule: a file
    called ``Dockerfile`` or ``*.Dockerfile``, or an existing file path with a ``/``)."""
    from ..modal.config import is_dockerfile

    return is_dockerfile(image)


def spec_from_dockerfile(path: str) -> dict[str, str]:
    """The ``build`` option of ``image="dir/Dockerfile"``: that directory is the context."""
    absolute = os.path.abspath(os.path.expanduser(path))
    return {"context": os.path.dirname(absolute), "dockerfile": os.path.basename(absolute)}


@dataclass
class PackedContext:
    """A context's normalized archive (spooled to disk past 8 MiB), its SHA-256 and its
    Dockerfile's text."""

    archive: IO[bytes]
    digest: str
    dockerfile: str
    size: int
    entries: int = field(default=0)

    def close(self) -> None:
        self.archive.close()


class _Packer:
    def __init__(self, spec: BuildSpec):
        self.spec = spec
        self.limit = spec.max_context * MIB
        self.size = 2 * _BLOCK * 2  # tar's end-of-archive blocks
        self.entries = 0
        # closed by pack_context (on failure) or PackedContext.close()
        self.spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)  # noqa: SIM115
        self.tar = tarfile.open(fileobj=self.spool, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115
        self.dockerfile: bytes | None = None
        self.matcher: Any = None
        """The ``.dockerignore`` patterns (docker SDK's ``PatternMatcher``), or ``None``."""

    def refuse(self, path: str, why: str) -> BuildContextError:
        if not path:
            return BuildContextError(f"build context {self.spec.context!r} {why}", path)
        return BuildContextError(f"build context {self.spec.context!r}: {path!r} {why}", path)

    def charge(self, path: str, data_size: int, *, dry_run: bool = False) -> None:
        """Count one entry against ``max_context`` (``dry_run``: only check it fits)."""
        size = self.size + _BLOCK * 2 + -(-data_size // _BLOCK) * _BLOCK  # PAX header + data
        if not dry_run:
            self.entries, self.size = self.entries + 1, size
        if size > self.limit:
            raise BuildContextError(
                f"build context {self.spec.context!r} is larger than max_context="
                f"{format_mib(self.spec.max_context)} (at {path!r}, {self.entries} entries): "
                "list what the image does not need in its .dockerignore, or raise max_context",
                path,
            )

    def add(self, path: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
        self.charge(path, len(data))
        info = tarfile.TarInfo(path)
        info.type, info.mode, info.mtime, info.size, info.linkname = kind, mode, 0, len(data), link
        self.tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)

    def ignored(self, path: str) -> bool:
        if path in (self.spec.dockerfile, ".dockerignore") or self.matcher is None:
            return False
        return bool(self.matcher.matches(path))

    def may_skip_dir(self, path: str) -> bool:
        """An ignored directory is skipped unless a ``!`` pattern re-includes below it."""
        from docker.utils.build import normalize_slashes

        assert self.matcher is not None
        return not any(
            p.exclusion and p.cleaned_pattern.startswith(normalize_slashes(path))
            for p in self.matcher.patterns
        )


def _open_dir(name: str, parent: int | None) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    return os.open(name, flags, dir_fd=parent)


def _read_file(name: str, parent: int, size: int) -> bytes:
    """The file's bytes (no more than lstat's ``size`` said, one more to see it grow)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(name, flags, dir_fd=parent)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file any more")
        chunks, left = [], size + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) != size:
        raise OSError("changed size while it was read")
    return data


def _link_escape(path: str, target: str) -> str | None:
    """Why a symlink at ``path`` may resolve outside the context, or ``None``: the download
    extractor's rule (:func:`runtimes._extract.check_symlink`; the walked directories are
    real, never links, so only leading ``..`` climb, no higher than the link's directory)."""
    from ..errors import UnsafeArchiveMemberError

    try:
        check_symlink(path, path.split("/")[:-1], target)
    except UnsafeArchiveMemberError as exc:
        return exc.reason
    return None


def _listing(packer: _Packer, dir_fd: int, prefix: str) -> list[str]:
    """The directory's names, sorted; refused past what ``max_context`` could hold (every
    entry costs at least a 1 KiB header) before the whole listing is in memory."""
    names = []
    room = (packer.limit - packer.size) // (_BLOCK * 2)
    with os.scandir(dir_fd) as listing:
        for entry in listing:
            names.append(entry.name)
            if len(names) > room:
                packer.charge(f"{prefix}{entry.name}", (len(names) - 1) * _BLOCK * 2, dry_run=True)
    return sorted(names)


def _walk(packer: _Packer, dir_fd: int, prefix: str) -> Iterator[None]:
    if prefix.count("/") >= MAX_DEPTH:
        raise packer.refuse(prefix.rstrip("/"), f"is deeper than {MAX_DEPTH} directories")
    for name in _listing(packer, dir_fd, prefix):
        path = f"{prefix}{name}"
        try:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # gone since the listing: not part of the context
        if packer.ignored(path) and not (
            stat.S_ISDIR(info.st_mode) and not packer.may_skip_dir(path)
        ):
            continue
        mode = stat.S_IMODE(info.st_mode)
        try:
            if stat.S_ISLNK(info.st_mode):
                target = os.readlink(name, dir_fd=dir_fd)
                escape = _link_escape(path, target)
                if escape is not None:
                    raise packer.refuse(
                        path,
                        f"is {escape} (it could resolve outside the context): the host never "
                        "sends links out of a build context; copy the file in instead",
                    )
                packer.add(path, tarfile.SYMTYPE, 0o777, link=target)
            elif stat.S_ISDIR(info.st_mode):
                child = _open_dir(name, dir_fd)
                try:
                    packer.add(path, tarfile.DIRTYPE, mode)
                    yield from _walk(packer, child, f"{path}/")
                finally:
                    os.close(child)
            elif stat.S_ISREG(info.st_mode):
                packer.charge(path, info.st_size, dry_run=True)  # before reading it
                data = _read_file(name, dir_fd, info.st_size)
                if path == packer.spec.dockerfile:
                    packer.dockerfile = data
                packer.add(path, tarfile.REGTYPE, mode, data)
            else:
                raise packer.refuse(path, "is not a file, directory or symlink (device, FIFO?)")
        except OSError as exc:
            raise packer.refuse(path, f"could not be read safely: {exc.strerror or exc}") from exc
        yield None


def _load_dockerignore(packer: _Packer, root_fd: int) -> None:
    from docker.utils.build import PatternMatcher

    try:
        info = os.stat(".dockerignore", dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode) or info.st_size > _DOCKERIGNORE_LIMIT:
        raise packer.refuse(".dockerignore", "is not a regular file of at most 1 MiB")
    try:
        text = _read_file(".dockerignore", root_fd, info.st_size).decode("utf-8", "replace")
    except OSError as exc:
        raise packer.refuse(".dockerignore", f"could not be read: {exc}") from exc
    patterns = [
        line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")
    ]
    packer.matcher = PatternMatcher(patterns)


def pack_context(spec: BuildSpec) -> PackedContext:
    """Pack ``spec.context`` into a normalized tar archive, bounded by ``max_context``.

    Raises:
        BuildContextError: the context is not a directory, holds a symlink leaving it, a
            device, FIFO or socket, changed while it was read, is larger than
            ``max_context``, or has no Dockerfile at ``spec.dockerfile``.
    """
    packer = _Packer(spec)
    try:
        try:
            root_fd = _open_dir(os.path.realpath(spec.context), None)  # as the user named it
        except OSError as exc:
            raise packer.refuse(
                "", f"is not a directory the host can read: {exc.strerror}"
            ) from exc
        try:
            _load_dockerignore(packer, root_fd)
            for _ in _walk(packer, root_fd, ""):
                pass
        finally:
            os.close(root_fd)
        if packer.dockerfile is None:
            raise packer.refuse(
                spec.dockerfile, "is not a regular file in the context (the dockerfile to build)"
            )
        packer.tar.close()
    except BaseException:
        packer.spool.close()
        raise
    size = packer.spool.tell()
    packer.spool.seek(0)
    digest = hashlib.sha256()
    for chunk in iter(lambda: packer.spool.read(1 << 20), b""):
        digest.update(chunk)
    packer.spool.seek(0)
    return PackedContext(
        archive=packer.spool,
        digest=digest.hexdigest(),
        dockerfile=packer.dockerfile.decode("utf-8", "replace"),
        size=size,
        entries=packer.entries,
    )


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def _expand(match: re.Match[str], values: Mapping[str, str]) -> str:
    name = match.group(1) or match.group(3)
    return values.get(name) or match.group(2) or match.group(0)


def from_images(dockerfile: str, args: Mapping[str, str]) -> list[str]:
    """The images the Dockerfile's ``FROM`` lines name (not ``scratch``, not earlier stages;
    ``$ARG`` resolved from global ``ARG`` defaults and ``args``; one still holding ``$`` is
    left out: the engine reports it)."""
    text = re.sub(r"\\\r?\n", " ", dockerfile)
    defaults: dict[str, str] = {}
    stages: set[str] = set()
    images: list[str] = []
    seen_from = False
    for raw in text.splitlines():
        words = raw.strip().split()
        if not words or words[0].startswith("#"):
            continue
        keyword = words[0].upper()
        if keyword == "ARG" and not seen_from and len(words) > 1:
            name, _, value = words[1].partition("=")
            defaults[name] = value.strip("\"'")
        if keyword != "FROM":
            continue
        seen_from = True
        rest = [w for w in words[1:] if not w.startswith("--")]
        if not rest:
            continue
        values = {**defaults, **args}
        image = _VAR.sub(functools.partial(_expand, values=values), rest[0])
        earlier_stage = image.lower() in stages
        if len(rest) >= 3 and rest[1].upper() == "AS":
            stages.add(rest[2].lower())
        if "$" in image or image.lower() == "scratch" or earlier_stage:
            continue
        if image not in images:
            images.append(image)
    return images


def build_tag(packed: PackedContext, spec: BuildSpec, base_ids: Mapping[str, str]) -> str:
    """``vf-sandbox/build:<hash>`` of the context's archive, the Dockerfile's path, the
    build args, the target and the ``FROM`` images' IDs (a rebuilt base makes a new tag)."""
    digest = hashlib.sha256()
    parts = [
        packed.digest,
        spec.dockerfile,
        repr(sorted(spec.args.items())),
        repr(spec.target),
        repr(sorted(base_ids.items())),
    ]
    for part in parts:
        digest.update(part.encode() + b"\0")
    return f"{BUILD_REPOSITORY}:{digest.hexdigest()[:24]}"


def context_label(spec: BuildSpec) -> str:
    """The context's path as a label value (bounded)."""
    return str(Path(spec.context))[:512]
