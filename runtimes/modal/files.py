"""Files in a Modal sandbox: ``Sandbox.filesystem`` (``stat``, ``read_bytes``,
``write_bytes``, ``remove``), reads too large for it or through a symlink streamed by ``cat``."""

from __future__ import annotations

import logging

import anyio

from ..errors import (
    OutputLimitExceededError,
    SandboxError,
    SandboxFileExistsError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
)
from .client import SdkBackend, TooLargeForFilesystemApi

log = logging.getLogger("runtimes.modal")


class ModalFiles(SdkBackend):
    """The part of :class:`~runtimes.modal.ModalBackend` that reads and writes files."""

    async def read(self, path: str, limit: int) -> bytes:
        # A read whose length is not the size ``stat`` just gave is read once more: the
        # file may have changed in between (then the second answer stands), or the
        # output stream was cut short under the worker (then the second one is whole).
        for attempt in range(2):
            info = await self._files("stat", path, path)
            kind = getattr(info.type, "value", info.type)
            if kind == "directory":
                raise SandboxIsADirectoryError(path)
            if kind == "symlink":
                return await self._read_streamed(path, limit)
            if info.size > limit:
                raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
            try:
                data: bytes = await self._files("read_bytes", path, path)
            except TooLargeForFilesystemApi:
                return await self._read_streamed(path, limit)
            if len(data) == info.size or attempt:
                break
            log.debug("modal: read of %r gave %d bytes, stat said %d", path, len(data), info.size)
        if len(data) > limit:
            raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
        return data

    async def _read_streamed(self, path: str, limit: int) -> bytes:
        """Read through ``cat`` with a capped sink: follows symlinks, bounded memory."""
        request, sink = self._internal(["cat", "--", path], limit=limit)
        with anyio.CancelScope() as scope:
            sink.on_overflow = scope.cancel
            code = await self.spawn(request, sink)
        if sink.overflowed:
            raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
        if code != 0:
            raise await self._diagnosed(
                SandboxError(bytes(sink.stderr).decode("utf-8", "replace").strip()), "read", path
            )
        return bytes(sink.stdout)

    async def write(self, path: str, data: bytes) -> None:
        await self._files("write_bytes", path, data, path)

    async def exists(self, path: str) -> bool:
        try:
            await self._files("stat", path, path)
        except (SandboxFileNotFoundError, SandboxNotADirectoryError):
            return False
        return True

    async def remove(self, path: str) -> None:
        try:
            try:
                await self._files("remove", path, path, recursive=False)
            except SandboxFileExistsError:  # a non-empty directory: now, and only now, recurse
                await self._files("remove", path, path, recursive=True)
        except SandboxFileNotFoundError:
            return  # removed meanwhile (or by an attempt whose answer was lost)

    async def read_trusted(self, path: str) -> bytes | None:
        """A file read through the filesystem API alone (no command runs in the sandbox):
        what the channel checks a restarted agent's files with."""
        try:
            info = await self._files("stat", path, path)
        except (SandboxFileNotFoundError, SandboxNotADirectoryError):
            return None
        kind = getattr(info.type, "value", info.type)
        if kind != "file":
            raise SandboxError(f"{path!r} is a {kind}, not the file it was")
        data: bytes = await self._files("read_bytes", path, path)
        return data
