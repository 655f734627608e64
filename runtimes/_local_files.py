"""Host-side helpers for moving files between the host and a sandbox: tar a local tree,
unpack a sandbox's tar without trusting it, write a local file atomically, and read a typed
error out of a failed shell file command."""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
from contextlib import suppress
from pathlib import Path

from ._extract import Links, extract_archive
from .errors import SandboxError, error_for_errno
from .models import OutputSink

__all__ = ["shell_error", "tar_directory", "untar_into", "write_local_file"]


def shell_error(path: str, sink: OutputSink) -> SandboxError:
    """The typed error a failed shell file command reported on its stderr."""
    message = bytes(sink.stderr).decode("utf-8", "replace").strip()
    lowered = message.lower()
    for needle, num in (
        ("no such file", 2),
        ("directory nonexistent", 2),  # dash: "cannot create x/y: Directory nonexistent"
        ("permission denied", 13),
        ("not a directory", 20),
        ("is a directory", 21),
        ("read-only file system", 30),
        ("no space left on device", 28),
        ("disk quota exceeded", 122),
    ):
        if needle in lowered:
            return error_for_errno(num, path, message or None)
    return SandboxError(f"operation on {path!r} failed: {message or 'no message'}")


def tar_directory(source: Path, *, root_owned: bool = False) -> bytes:
    """The contents of a local directory as a tar (``root_owned``: every member owned by
    root, for an archive API that keeps the tar's owners, Docker's)."""

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(source.iterdir()):
            tar.add(entry, arcname=entry.name, filter=owned_by_root if root_owned else None)
    return buf.getvalue()


def untar_into(
    data: bytes, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
) -> None:
    """Unpack a tar made in the sandbox into ``local``, never trusting it (see
    :mod:`runtimes._extract`)."""
    extract_archive(io.BytesIO(data), local, skip_unsafe=skip_unsafe, links=links)


def write_local_file(local: Path, data: bytes) -> None:
    """Write ``data`` to ``local`` through a temporary file and a rename."""
    local.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=".vf-download-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, local)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
