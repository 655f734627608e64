"""Files in a Docker container through the Engine API's archive endpoints.

``get_archive`` / ``put_archive`` / a ``HEAD`` stat serve reads, writes, uploads and
downloads when the sandbox's default user is root (:mod:`.fastpath`; with a non-root user the
runtime's generic path runs commands as that user instead, so permissions mean what they
mean for its commands).
A write uploads a temporary file next to the target, which one exec then renames over it.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import io
import json
import logging
import posixpath
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._extract import Links, extract_archive
from .._local_files import shell_error, write_local_file
from ..errors import (
    OutputLimitExceededError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNoSpaceError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    SandboxUnavailableError,
    error_for_errno,
)
from ..models import MiB
from ..scripts import load
from .client import ContainerRef, check_running_blocking
from .process import RunOwn, own_request
from .stream import STREAM_CHUNK

if TYPE_CHECKING:
    import requests

_TAR_SLACK = 1 * MiB
_RAW = {"Accept-Encoding": "identity"}
"""The engine gzips archives for clients that accept it: costly for big files, and
local. Ask for the tar as is."""

# Go's os.FileMode bits, as the archive API's stat header reports them.
_MODE_DIR = 1 << 31
_MODE_SYMLINK = 1 << 27
_MODE_PIPE_OR_SOCKET = (1 << 25) | (1 << 24)

_TEMP_PREFIX = ".vf-sandbox-write-"

log = logging.getLogger("runtimes.docker")


def _decode_stat(header: str | None) -> dict[str, Any] | None:
    if not header:
        return None
    stat: dict[str, Any] = json.loads(base64.b64decode(header))
    return stat


def _is_dir(stat: Mapping[str, Any]) -> bool:
    return bool(int(stat.get("mode", 0)) & _MODE_DIR)


def _is_symlink(stat: Mapping[str, Any]) -> bool:
    return bool(int(stat.get("mode", 0)) & _MODE_SYMLINK)


def archive_error(status: int, message: str, path: str) -> SandboxError:
    """Map an archive endpoint's refusal to the typed error for ``path``."""
    lowered = message.lower()
    if "no such container" in lowered or "is not running" in lowered:
        return SandboxUnavailableError(f"docker container is gone: {message}")
    # The engine's text for ENOSPC and EDQUOT (a full disk quota, `disk=`, or filesystem).
    if "no space left on device" in lowered:
        return SandboxNoSpaceError(path)
    if "disk quota exceeded" in lowered:
        return SandboxNoSpaceError(path, code=errno.EDQUOT)
    table = (
        ("cannot overwrite directory", SandboxIsADirectoryError),
        ("cannot overwrite non-directory", SandboxNotADirectoryError),
        ("extraction point is not a directory", SandboxNotADirectoryError),
        ("not a directory", SandboxNotADirectoryError),
        ("is a directory", SandboxIsADirectoryError),
        ("permission denied", SandboxPermissionError),
        ("read-only", SandboxPermissionError),
        ("no such file", SandboxFileNotFoundError),
        ("could not find the file", SandboxFileNotFoundError),
    )
    for needle, kind in table:
        if needle in lowered:
            return kind(path)
    if status == 404:
        return SandboxFileNotFoundError(path)
    if status == 403:
        return SandboxPermissionError(path, message or None)
    return SandboxError(
        f"archive operation on {path!r} failed ({status}): {message or 'no message'}"
    )


def _response_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()
    if isinstance(body, dict):
        return str(body.get("message", "")).strip()
    return str(body)


def _tar_info(name: str, kind: bytes, mode: int, size: int = 0) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.size = size
    info.mtime = int(time.time())
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _file_tar(name: str, data: bytes, mode: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.addfile(_tar_info(name, tarfile.REGTYPE, mode, len(data)), io.BytesIO(data))
    return buf.getvalue()


def _dirs_tar(names: Iterable[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            tar.addfile(_tar_info(name, tarfile.DIRTYPE, 0o755))
    return buf.getvalue()


def _extract_tree(
    archive: Any, top: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
) -> None:
    """Extract a directory's archive into ``local``, dropping the top component ``top``.

    The engine archives the sandbox's own files, which a policy arranged: the archive is
    unpacked as hostile (:mod:`runtimes._extract`), never trusting ``tarfile``'s filter.
    """
    extract_archive(archive, local, skip_unsafe=skip_unsafe, strip=top, links=links)


def _single_file(response: requests.Response, path: str, limit: int) -> bytes:
    """The content of the one regular file in an archive response, streamed."""
    counted: Any = _CappedReader(response.raw, limit + _TAR_SLACK, path)
    with tarfile.open(fileobj=counted, mode="r|") as tar:
        for member in tar:
            if member.isfile():
                handle = tar.extractfile(member)
                assert handle is not None
                data: bytes = handle.read()
                return data
    raise SandboxError(f"the engine's archive of {path!r} holds no regular file")


class _CappedReader:
    """A file-like view of a response body that refuses to go past ``cap`` bytes."""

    def __init__(self, raw: Any, cap: int, path: str) -> None:
        self._raw = raw
        self._left = cap
        self._cap = cap
        self._path = path

    def read(self, size: int = -1) -> bytes:
        """Up to ``size`` bytes (all when negative); short only at the end of the body."""
        if size < 0:
            data = bytes(self._raw.read())
        else:
            buf = bytearray()
            while len(buf) < size:
                piece = self._raw.read(size - len(buf))
                if not piece:
                    break
                buf += piece
            data = bytes(buf)
        self._left -= len(data)
        if self._left < 0:
            raise OutputLimitExceededError(f"read of {self._path!r}", self._cap, path=self._path)
        return data


class ContainerArchive:
    """The archive API on one container. Every method blocks: run it in a worker thread."""

    def __init__(self, ref: ContainerRef) -> None:
        self._ref = ref
        self._api = ref.api
        self._id = ref.id

    def check_running_blocking(self) -> None:
        """Raise SandboxUnavailableError unless the container is running."""
        check_running_blocking(self._ref)

    def _archive_url(self) -> str:
        api = self._api
        return f"{api.base_url}/v{api.api_version}/containers/{self._id}/archive"

    def _stat_blocking(self, path: str) -> dict[str, Any] | None:
        """The archive API's stat of ``path`` (not following a final symlink); ``None``
        when nothing is there or a parent is not a directory."""
        api = self._api
        response = api.head(self._archive_url(), params={"path": path})
        with contextlib.closing(response):
            if response.status_code == 404:
                return None
            if response.status_code >= 400:
                # A HEAD answer has no body: ask again to learn what went wrong.
                error = self._archive_failure_blocking(path)
                if isinstance(error, SandboxNotADirectoryError):
                    return None
                raise error
            return _decode_stat(response.headers.get("X-Docker-Container-Path-Stat"))

    def _archive_failure_blocking(self, path: str) -> SandboxError:
        api = self._api
        response = api.get(self._archive_url(), params={"path": path}, stream=True, headers=_RAW)
        with contextlib.closing(response):
            if response.status_code < 400:
                return SandboxError(f"the engine could not stat {path!r}")
            return archive_error(response.status_code, _response_message(response), path)

    def _resolved_stat_blocking(self, path: str) -> tuple[str, dict[str, Any] | None]:
        """Follow a final symlink once (the engine resolves the whole chain)."""
        stat = self._stat_blocking(path)
        if stat is not None and _is_symlink(stat) and stat.get("linkTarget"):
            target = str(stat["linkTarget"])
            return target, self._stat_blocking(target)
        return path, stat

    def read_blocking(self, path: str, limit: int) -> bytes:
        self.check_running_blocking()
        api = self._api
        target = path
        for _ in range(3):
            response = api.get(
                self._archive_url(), params={"path": target}, stream=True, headers=_RAW
            )
            with contextlib.closing(response):
                if response.status_code >= 400:
                    raise archive_error(response.status_code, _response_message(response), path)
                stat = _decode_stat(response.headers.get("X-Docker-Container-Path-Stat")) or {}
                if _is_symlink(stat) and stat.get("linkTarget"):
                    target = str(stat["linkTarget"])
                    continue
                if _is_dir(stat):
                    raise SandboxIsADirectoryError(path)
                if int(stat.get("mode", 0)) & _MODE_PIPE_OR_SOCKET:
                    raise SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
                if int(stat.get("size", 0)) > limit:
                    raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
                return _single_file(response, path, limit)
        raise error_for_errno(40, path, "too many levels of symbolic links")

    def write_temp_blocking(self, path: str, data: bytes) -> tuple[str, str]:
        """Upload ``data`` as a fresh temporary file next to the target: the engine
        extracts an archive in place (the old file removed first), so a cut upload would
        otherwise leave a partial file. Returns (temporary file, target)."""
        self.check_running_blocking()
        target, stat = self._resolved_stat_blocking(path)
        if path.endswith("/") or (stat is not None and _is_dir(stat)):
            raise SandboxIsADirectoryError(path)
        mode = int(stat["mode"]) & 0o777 if stat is not None else 0o644
        # The archive API cleans paths lexically ("a/../f" is "f"); the rename must too.
        target = posixpath.normpath(target)
        parent = posixpath.dirname(target) or "/"
        name = f"{_TEMP_PREFIX}{uuid.uuid4().hex[:16]}"
        temp = posixpath.join(parent, name)
        archive = _file_tar(name, data, mode)
        try:
            if not self._put_archive_blocking(parent, archive, path):
                self._make_dirs_blocking(parent, path)
                if not self._put_archive_blocking(parent, archive, path):
                    raise SandboxFileNotFoundError(path, "the parent directory vanished")
        except (SandboxError, OSError):
            # The engine leaves what it extracted before it failed (a full disk quota):
            # that part would hold the room the next write needs.
            self._remove_leftover_blocking(temp)
            raise
        return temp, target

    def _remove_leftover_blocking(self, temp: str) -> None:
        """Remove a temporary file a failed upload may have left (one exec as root, as the
        rename after a write is). Not raised when it fails (the upload's own error is):
        logged, with what to remove."""
        import docker.errors

        api = self._api
        try:
            exec_id = api.exec_create(self._id, ["rm", "-f", "--", temp], user="0")["Id"]
            api.exec_start(exec_id)
            code = api.exec_inspect(exec_id).get("ExitCode")
        except (docker.errors.DockerException, OSError) as exc:
            code, reason = None, str(exc)
        else:
            reason = f"exit code {code}"
        if code != 0:
            log.warning(
                "container %s: could not remove the partial upload %r after a failed write "
                "(%s); it holds room of the sandbox's disk until removed (rt.remove(%r))",
                self._id[:12],
                temp,
                reason,
                temp,
            )

    def _put_archive_blocking(self, directory: str, archive: bytes, shown: str) -> bool:
        """Extract ``archive`` into ``directory``; ``False`` if the directory is missing."""
        api = self._api
        response = api.put(
            self._archive_url(),
            params={"path": directory, "noOverwriteDirNonDir": "true"},
            data=archive,
            headers={"Content-Type": "application/x-tar"},
        )
        with contextlib.closing(response):
            if response.status_code == 404 and "no such container" not in response.text.lower():
                return False
            if response.status_code >= 400:
                raise archive_error(response.status_code, _response_message(response), shown)
        return True

    def _make_dirs_blocking(self, directory: str, shown: str) -> None:
        """Create ``directory`` and its missing parents with one archive of directory
        entries, extracted into the deepest ancestor that exists (never re-created, so
        its owner and mode stay as they are)."""
        missing: list[str] = []
        current = directory.rstrip("/") or "/"
        while current != "/":
            _, stat = self._resolved_stat_blocking(current)
            if stat is not None:
                if not _is_dir(stat):
                    raise SandboxNotADirectoryError(shown, f"{current} is not a directory")
                break
            current, name = posixpath.split(current)
            missing.append(name)
        if not missing:
            return
        names = []
        prefix = ""
        for name in reversed(missing):
            prefix = f"{prefix}{name}/"
            names.append(prefix)
        if not self._put_archive_blocking(current, _dirs_tar(names), shown):
            raise SandboxFileNotFoundError(shown, "a parent directory vanished")

    def exists_blocking(self, path: str) -> bool:
        self.check_running_blocking()
        return self._stat_blocking(path) is not None

    def upload_tree_blocking(self, archive: bytes, remote: str) -> None:
        """Extract a directory's ``archive`` into ``remote`` (created when missing)."""
        self.check_running_blocking()
        _, stat = self._resolved_stat_blocking(remote)
        if stat is None:
            self._make_dirs_blocking(remote, remote)
        elif not _is_dir(stat):
            raise SandboxNotADirectoryError(remote)
        if not self._put_archive_blocking(remote, archive, remote):
            raise SandboxFileNotFoundError(remote, "the directory vanished")

    def download_blocking(
        self,
        remote: str,
        local: Path,
        limit: int,
        skip_unsafe: bool = False,
        links: Links = "contained",
    ) -> None:
        self.check_running_blocking()
        target, stat = self._resolved_stat_blocking(remote)
        if stat is None:
            raise SandboxFileNotFoundError(remote)
        if not _is_dir(stat):
            write_local_file(local, self.read_blocking(target, limit))
            return
        api = self._api
        response = api.get(self._archive_url(), params={"path": target}, stream=True, headers=_RAW)
        with contextlib.closing(response), tempfile.TemporaryFile() as spool:
            if response.status_code >= 400:
                raise archive_error(response.status_code, _response_message(response), remote)
            size = 0
            for chunk in response.iter_content(STREAM_CHUNK):
                size += len(chunk)
                if size > limit + _TAR_SLACK:
                    raise OutputLimitExceededError(f"download of {remote!r}", limit, path=remote)
                spool.write(chunk)
            spool.seek(0)
            top = posixpath.basename(target.rstrip("/")) or "."
            _extract_tree(spool, top, local, skip_unsafe=skip_unsafe, links=links)


# ---------------------------------------------------------------------- the rename after a write

_REPLACE_SCRIPT = load("replace", "runtimes.docker.scripts")


async def replace_by_exec(run: RunOwn, temp: str, target: str, shown: str) -> None:
    """Rename an uploaded temporary file over its target (one exec).

    Raises:
        SandboxError: the rename failed (typed from the shell's message).
    """
    request, sink = own_request(["sh", "-c", _REPLACE_SCRIPT, "sh", temp, target])
    code = await run(request, sink)
    if code != 0:
        raise shell_error(shown, sink)
