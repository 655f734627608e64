"""The capabilities a :class:`~runtimes.backend.Backend` may declare, by also subclassing
the capability's class: what its transport does better than the runtime's generic path over
:meth:`~runtimes.backend.Backend.spawn`. The runtime (:mod:`runtimes.composed`) checks
``isinstance`` and uses the capability where it is declared:

========================  ===============================================================
:class:`FileFastPath`     ``read`` / ``write`` / ``exists`` through the transport's file API
                          (Docker's archive API, SFTP, a local file)
:class:`TreeFastPath`     ``upload`` / ``download`` of whole trees the same way
:class:`RemoveFastPath`   ``remove`` the same way
:class:`SandboxLister`    ``list_sandboxes`` / ``destroy_sandbox``: ``vf-sandbox ls`` and
                          ``cleanup`` see the backend's sandboxes
:class:`Snapshotter`      snapshots of the sandbox's files, forks opened from them
:class:`ProcessSweeper`   a sweep stronger than the mark's (``stop_processes``, close)
:class:`ShellOpener`      ``vf-sandbox shell ID`` into a listed sandbox
:class:`StreamSpawner`    a process whose pipes are one stream: the channel's agent runs
                          over it
:class:`TrustedReader`    a file read without running the sandbox's code (a restarted
                          agent's files checked)
:class:`AgentFilesCheck`  a restarted agent's files checked another way (Docker: the
                          engine's diff against the image)
:class:`BlockingTeardown` a teardown without an event loop, for the exit backstop
:class:`MemoryKillProbe`  after an exit 137, whether the sandbox's memory limit dealt it
:class:`HostRouter`       ways for a process in the sandbox to reach a port on the host
:class:`ResetProof`       a sandbox whose writable surface is fully known, so a reset back
                          to its state after start can be proven (``RuntimePool(recycle=)``)
========================  ===============================================================
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import anyio

from ._extract import Links
from .backend import Backend
from .channel import KILL_WAIT
from .channel.protocol import ChannelTransport
from .config import RuntimeConfig
from .errors import SandboxError
from .models import SandboxInfo
from .routes import HostRoute, RouteKind
from .snapshot import SandboxSnapshot, SnapshotHolds

__all__ = [
    "AgentFilesCheck",
    "BlockingTeardown",
    "FileFastPath",
    "HostRouter",
    "MemoryKillProbe",
    "ProcessSweeper",
    "RemoveFastPath",
    "ResetProof",
    "SandboxLister",
    "ShellOpener",
    "Snapshotter",
    "StreamSpawner",
    "TreeFastPath",
    "TrustedReader",
]


class FileFastPath(abc.ABC):
    """Capability: single files through the transport's own file API. Each gets an
    absolute, resolved path. (``lstat`` and ``mkdir`` take the generic path, or the
    channel.)"""

    def serves_files(self) -> bool:
        """Whether the fast path serves now; ``False`` hands every call to the generic path
        (Docker's archive API writes as root: a sandbox whose default user is not root
        gets its files through commands run as that user)."""
        return True

    @abc.abstractmethod
    async def read(self, path: str, limit: int) -> bytes:
        """The file's bytes, following symlinks: at most ``limit + 1`` of them (the runtime
        raises ``OutputLimitExceededError`` over ``limit``).

        Raises:
            SandboxFileNotFoundError, SandboxIsADirectoryError, SandboxNotADirectoryError,
            SandboxPermissionError: naming ``path``.
        """

    @abc.abstractmethod
    async def write(self, path: str, data: bytes) -> None:
        """Replace the file's content in place (its mode kept, a symlink written through, no
        temporary file beside it), creating missing parents.

        Raises:
            SandboxIsADirectoryError, SandboxNotADirectoryError, SandboxPermissionError:
                naming ``path``.
        """

    @abc.abstractmethod
    async def exists(self, path: str) -> bool:
        """Whether ``path`` exists (a dangling symlink does; a path through a file does not).

        Raises:
            SandboxPermissionError: a parent cannot be searched.
        """


class TreeFastPath(abc.ABC):
    """Capability: whole trees through the transport's own file API."""

    def serves_files(self) -> bool:
        """Whether the fast path serves now; ``False`` hands every call to the generic path
        (Docker's archive API writes as root: a sandbox whose default user is not root
        gets its files through commands run as that user)."""
        return True

    @abc.abstractmethod
    async def upload(self, source: Path, remote: str) -> None:
        """Copy the local file or directory ``source`` to the absolute ``remote``."""

    @abc.abstractmethod
    async def download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        """Copy ``remote`` to the fresh local path ``local``. A directory is unpacked with
        :func:`runtimes.untar_into` or an equivalent that treats the sandbox's archive as
        hostile (``skip_unsafe``, ``links``: as it documents).

        Raises:
            SandboxFileNotFoundError: ``remote`` does not exist.
        """


class RemoveFastPath(abc.ABC):
    """Capability: ``remove`` through the transport's own file API."""

    @abc.abstractmethod
    async def remove(self, path: str) -> None:
        """Remove ``path``: a file, a symlink (never what it points to) or a whole directory.
        A missing path is the runtime's to report: it calls this only for one that exists.

        Raises:
            SandboxPermissionError: naming ``path``.
        """


class SandboxLister(abc.ABC):
    """Capability: ``vf-sandbox ls`` and ``cleanup`` see this backend's sandboxes (without
    it they are invisible to both)."""

    @classmethod
    @abc.abstractmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Every labelled sandbox of this backend, of every creator (``config`` may be
        ``None``: look in the default place).

        Raises:
            SandboxError: the backend cannot be reached.
        """

    @classmethod
    @abc.abstractmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Remove one listed sandbox and everything in it; one already gone is fine. Treat
        ``info.id`` as input: refuse an id this backend could not have made.

        Raises:
            SandboxError: the removal failed.
        """


class MemoryKillProbe(abc.ABC):
    """Capability: tell a memory-limit kill from any other ``SIGKILL``."""

    @abc.abstractmethod
    async def memory_kill(self, since: float) -> str | None:
        """Whether the sandbox's memory limit killed a process since ``time.monotonic()``
        was ``since``, as seen from outside the sandbox: the limit's setting (``"64MiB"``,
        ``""`` if not known), else ``None``. Bounds its own time; never raises."""


class Snapshotter(abc.ABC):
    """Capability: snapshots of the sandbox's files, and sandboxes opened from them
    (``docs/snapshots.md``)."""

    snapshot_holds: ClassVar[SnapshotHolds]
    """What a snapshot holds: ``"filesystem"`` (the whole root) or ``"workdir"``."""

    @abc.abstractmethod
    async def snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        """Take a snapshot of the live sandbox, stored with ``labels``.

        Raises:
            SandboxError: the backend failed to take it (the cause attached).
        """

    def check_fork_config(self) -> None:
        """Refuse a config this backend cannot start from a snapshot (a sandbox to attach
        to, a workdir of the user's own).

        Raises:
            SandboxInvalidArgumentError: the config cannot start from a snapshot.
        """
        return None

    @classmethod
    @abc.abstractmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """Every labelled snapshot of this backend, of every creator.

        Raises:
            SandboxTransportError: the backend could not be reached.
        """

    @classmethod
    @abc.abstractmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Remove one snapshot; one already gone is fine.

        Raises:
            SandboxInvalidArgumentError: ``snapshot.id`` is not one this backend made.
        """

    @classmethod
    def destroy_snapshot_now(cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None) -> None:
        """:meth:`destroy_snapshot` at interpreter exit (a snapshot nobody removed): on a
        fresh event loop by default; a backend whose client cannot run one overrides it."""
        anyio.run(cls.destroy_snapshot, snapshot, config)


class ProcessSweeper(abc.ABC):
    """Capability: a sweep stronger than the runtime's (which kills what carries the
    sandbox's mark, through :meth:`Backend.spawn`), for :meth:`runtimes.Runtime.stop_processes`
    and before :meth:`Backend.destroy`."""

    @abc.abstractmethod
    async def sweep(self) -> int:
        """Kill every process of the sandbox still running; return how many.

        Raises:
            SandboxError: some process is still running afterwards.
        """


class ShellOpener(abc.ABC):
    """Capability: ``vf-sandbox shell ID`` opens an interactive shell in a listed sandbox."""

    @classmethod
    @abc.abstractmethod
    async def shell_argv(
        cls, info: SandboxInfo, config: RuntimeConfig | None = None, *, tty: bool
    ) -> list[str]:
        """The host argv (for ``os.execvp``) of a shell in ``info``'s workdir (``tty``:
        whether stdin is a terminal).

        Raises:
            SandboxUnavailableError: the sandbox is gone.
            SandboxFileNotFoundError: a host tool the shell needs is not installed.
        """

    @classmethod
    def shell_hint(cls, sandbox_id: str, config: RuntimeConfig) -> str | None:
        """The command that gets into the sandbox, for the kept-sandbox notice (``None``:
        ``vf-sandbox shell ID --runtime ...``)."""
        return None


class BlockingTeardown(abc.ABC):
    """Capability: a teardown that needs no event loop, for the exit backstop (an SDK
    that cannot run on a fresh loop at interpreter exit)."""

    @abc.abstractmethod
    def destroy_now(self, *, keep: bool) -> None:
        """:meth:`Backend.destroy`, blocking and bounded. Never raises: what could not be
        done is logged (the sandbox's labels leave it to ``vf-sandbox cleanup``)."""


class TrustedReader(abc.ABC):
    """Capability: read a file without running any of the sandbox's code (a filesystem
    API, never ``cat``): the channel checks its agent's files through it before a
    restart, and trusts no restart without it."""

    @abc.abstractmethod
    async def read_trusted(self, path: str) -> bytes | None:
        """The file's bytes, ``None`` when it is missing.

        Raises:
            SandboxError: it cannot be read that way (a symlink, a directory, too large).
        """


class AgentFilesCheck(abc.ABC):
    """Capability: before a restart, the channel's agent's files checked without reading
    them (Docker: the engine's diff of the container against its image), in place of a
    :class:`TrustedReader`'s hashes."""

    @abc.abstractmethod
    async def agent_files_changed(self, digests: Mapping[str, bytes]) -> str | None:
        """Why the files the first agent ran from (``digests``: path to SHA-256, the
        interpreter's possibly unknown) can no longer be trusted, or ``None``.

        Raises:
            SandboxError: the check could not be made (no restart is trusted then).
        """


class StreamSpawner(abc.ABC):
    """Capability: a long-lived process whose stdin and stdout are one byte stream. The
    channel's agent (``docs/channel.md``) runs over it when the config's ``channel`` field
    is true: every ``exec``, ``read``, ``write``, ``exists``, ``remove`` then costs about a
    millisecond instead of a process each. The runtime supplies the rest of what the
    channel needs: kills through :meth:`Backend.spawn`, :meth:`Backend.alive` as the death
    probe, and, where the backend is a :class:`TrustedReader`, the check of the agent's
    files before a restart. Never in a sandbox the backend :attr:`~Backend.attached` to."""

    probes_silence: ClassVar[bool] = True
    """Whether a long silence of the channel is met with :meth:`lost_means_dead` (a cheap
    probe); ``False`` where a probe costs as much as the call it waits for."""
    halted: bool = False
    """Set by the runtime once the channel's root agent confirmed the halt
    (:meth:`agent_halts`): nothing of the sandbox runs but PID 1."""

    @abc.abstractmethod
    async def open_stream(self, argv: list[str]) -> ChannelTransport:
        """Start ``argv`` in the sandbox (as the default user, in the workdir, with no
        environment of the caller's) with its stdin attached, and return its stdin and
        stdout as one stream.

        Raises:
            SandboxError: the process could not be started.
        """

    def channel_wanted(self) -> bool:
        """Whether the channel may run with this config (the config's ``channel`` field
        asks for it; a backend may need more, such as spare connection slots)."""
        return True

    def channel_stall_timeout(self) -> float | None:
        """How long a file call on the channel may wait for an answer before it fails."""
        return None

    def channel_kill_wait(self) -> float:
        """How long a kill through :meth:`Backend.kill_groups` may take after the channel
        died holding a process group."""
        return KILL_WAIT

    def channel_env(self) -> Mapping[str, str]:
        """Variables the agent adds to every command's environment (what :meth:`spawn`
        adds itself)."""
        return {}

    async def lost_means_dead(self) -> bool:
        """After the stream ended, or during a long silence: whether the sandbox is gone.
        The default asks :meth:`Backend.alive` (a backend that cannot tell says no)."""
        assert isinstance(self, Backend)
        try:
            return not await self.alive()
        except SandboxError:
            return False

    async def silence_means_dead(self) -> bool:
        """During a long silence of the channel (with :attr:`probes_silence`): whether the
        sandbox stopped, a cheap probe. The default is :meth:`lost_means_dead`."""
        return await self.lost_means_dead()

    async def first_agent_untrusted(self) -> str | None:
        """Before the first agent starts: why the sandbox's ``python3`` cannot be trusted,
        or ``None``. By default a sandbox the backend :attr:`~Backend.attached` to is
        distrusted (code of others ran there); a backend that can check without running
        the sandbox's code says what it found."""
        assert isinstance(self, Backend)
        if self.attached:
            return "the channel's agent is not started in a sandbox this runtime attached to"
        return None

    def agent_halts(self) -> bool:
        """Whether, at close, the channel's agent (running as root) should kill every
        process of the sandbox but PID 1 before :meth:`Backend.destroy` (which can then let
        the sandbox go without waiting for its processes: :attr:`halted`)."""
        return False


class HostRouter(abc.ABC):
    """Capability: ways for a process in the sandbox to reach a port on the host."""

    @abc.abstractmethod
    def host_routes(self) -> tuple[RouteKind, ...]:
        """The route kinds this sandbox offers, best first (:mod:`runtimes.routes`)."""

    @abc.abstractmethod
    async def expose_host(self, port: int, via: RouteKind) -> HostRoute:
        """Make ``127.0.0.1:port`` on the host reachable from the sandbox through ``via``.

        Raises:
            HostRouteError: the route cannot be made.
        """

    async def host_bind_address(self, via: RouteKind) -> str:
        """Where a host service must listen for ``via`` (one of :meth:`host_routes`).

        Raises:
            HostRouteError: the route has no address on this host.
        """
        return "127.0.0.1"


class ResetProof(abc.ABC):
    """Capability: a sandbox whose writable surface is fully known (a read-only root file
    system; the writable places made by the runtime; an unprivileged policy), so that
    :mod:`runtimes.recycle` can return it to its state after start and prove it, for a
    pool's next acquirer (``docs/pools.md``, Recycling)."""

    @abc.abstractmethod
    def recycle_refusal(self) -> str | None:
        """Why this sandbox's config cannot be proven clean after use (a writable root file
        system, a root policy, a writable mount, a network), or ``None``: it can."""

    @abc.abstractmethod
    def wiped_places(self) -> tuple[str, ...]:
        """Every place in the sandbox anything but root can write, absolute paths: each
        is emptied and given back its owner and mode at a reset."""

    def watched_places(self) -> tuple[str, ...]:
        """Places only root can write that are not on the read-only root (Docker: ``/dev``,
        ``/sys/fs/cgroup``): the host's machinery runs as root, and so may what a judge
        without an account of its own runs. Listed one level deep at each survey, never
        emptied: anything new there keeps the sandbox from being recycled."""
        return ()

    @abc.abstractmethod
    async def outside_view(self) -> tuple[str, ...]:
        """What the host sees of the sandbox's file system without running anything in it
        (Docker: the engine's diff against the image), compared with the view after start.

        Raises:
            SandboxError: the view could not be read (the sandbox is not recycled then).
        """
