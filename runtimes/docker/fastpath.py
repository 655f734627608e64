"""The Docker backend's files through the Engine API's archive endpoints (:mod:`.files`):
:class:`DockerFiles`, the :class:`~runtimes.backend.FileFastPath` and
:class:`~runtimes.backend.TreeFastPath` of :class:`~runtimes.docker.runtime.DockerBackend`.

The archive API reads and writes as root: it serves only a sandbox whose default user is
root. With another user every file call takes the runtime's generic path (commands run as
that user), so permissions mean what they mean for the user's commands.
"""

from __future__ import annotations

import abc
import functools
from pathlib import Path

import anyio

from .._extract import Links
from .._local_files import tar_directory
from ..capabilities import (
    FileFastPath,
    TreeFastPath,
)
from ..models import ExecRequest, OutputSink
from .client import ContainerRef, engine_call
from .config import DockerConfig
from .files import ContainerArchive, replace_by_exec


class DockerFiles(FileFastPath, TreeFastPath):
    """Files and trees through the archive API (a write: a temporary file the engine
    extracts beside the target, then one exec renames it over the target)."""

    config: DockerConfig
    _files_as_root: bool

    @abc.abstractmethod
    def _ref(self) -> ContainerRef:
        """The container, for the engine's calls."""

    @abc.abstractmethod
    async def spawn(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run one command in the container (the backend's)."""

    def serves_files(self) -> bool:
        """Only where the sandbox's default user is root (the archive API writes as root)."""
        return self._files_as_root

    def _archive(self) -> ContainerArchive:
        return ContainerArchive(self._ref())

    async def read(self, path: str, limit: int) -> bytes:
        archive = self._archive()
        return await engine_call(
            lambda: archive.read_blocking(path, limit), self.config, idempotent=True
        )

    async def write(self, path: str, data: bytes) -> None:
        archive = self._archive()
        temp, target = await engine_call(
            lambda: archive.write_temp_blocking(path, data), self.config
        )
        await replace_by_exec(self.spawn, temp, target, path)

    async def exists(self, path: str) -> bool:
        archive = self._archive()
        return await engine_call(
            lambda: archive.exists_blocking(path), self.config, idempotent=True
        )

    async def upload(self, source: Path, remote: str) -> None:
        """A file as :meth:`write`; a directory as one archive extracted in place (its
        entries root-owned)."""
        if await anyio.Path(source).is_file():
            await self.write(remote, await anyio.Path(source).read_bytes())
            return
        tree = await anyio.to_thread.run_sync(
            functools.partial(tar_directory, source, root_owned=True)
        )
        archive = self._archive()
        await engine_call(lambda: archive.upload_tree_blocking(tree, remote), self.config)

    async def download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        archive, limit = self._archive(), self.config.read_limit
        await engine_call(
            lambda: archive.download_blocking(remote, local, limit, skip_unsafe, links),
            self.config,
            idempotent=True,
        )
