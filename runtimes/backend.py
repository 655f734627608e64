"""The :class:`Backend` seam: how to reach one kind of sandbox, and nothing else.

A backend says how to create, destroy and probe its sandbox and how to run one process in it
with pipes (:meth:`Backend.spawn`). Everything else lives once, above it, in the
:class:`~runtimes.base.Runtime` that :func:`runtime_class` composes around it: argument
checks, paths, timeouts, output caps, the lifecycle, the channel routing, the sweep of the
processes a sandbox's commands left behind, the kills still owed, and a generic plain path
over ``spawn`` for every file operation (``head``, ``cat``, ``test``, ``rm``, ``tar`` in the
sandbox).

What a backend does better than that generic path it declares as a *capability*, by also
subclassing the capability's class; the runtime uses it where it is declared:

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
:class:`BlockingTeardown` a teardown without an event loop, for the exit backstop
:class:`MemoryKillProbe`  after an exit 137, whether the sandbox's memory limit dealt it
:class:`HostRouter`       ways for a process in the sandbox to reach a port on the host
========================  ===============================================================

A runtime plugin is a :class:`Backend` subclass named by an entry point in
``vf_sandbox.runtimes`` (docs/plugins.md builds one); the registry composes its runtime
(:func:`runtimes.composed.runtime_class`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import anyio

from ._extract import Links
from .channel.protocol import ChannelTransport
from .config import RuntimeConfig
from .models import ExecRequest, OutputSink, SandboxInfo
from .routes import HostRoute, RouteKind
from .snapshot import SandboxSnapshot, SnapshotHolds

__all__ = [
    "Backend",
    "BlockingTeardown",
    "CreateRequest",
    "FileFastPath",
    "HostRouter",
    "MemoryKillProbe",
    "ProcessSweeper",
    "RemoveFastPath",
    "SandboxLister",
    "ShellOpener",
    "Snapshotter",
    "StreamSpawner",
    "TreeFastPath",
    "TrustedReader",
    "bookkeeping_request",
]


class Backend(abc.ABC):
    """How to reach one kind of sandbox: four methods, an id and two class attributes.

    One instance serves one sandbox, from :meth:`create` to :meth:`destroy`. Every method
    may raise :class:`~runtimes.errors.SandboxUnavailableError` for a sandbox that is gone
    and :class:`~runtimes.errors.SandboxTransportError` for a connection to it that failed;
    anything that is not a :class:`~runtimes.errors.SandboxError` reaches the caller
    wrapped in one ("failed unexpectedly"), so raise typed errors.
    """

    name: ClassVar[str]
    """The type name (``{"type": name}`` in a config): in messages, labels and ``ls``."""
    config_model: ClassVar[type[RuntimeConfig]]
    """The config: a :class:`~runtimes.config.RuntimeConfig` subclass whose ``type`` is
    ``Literal[name]`` defaulting to ``name``."""
    keep_supported: ClassVar[bool] = False
    """Whether :meth:`destroy` honours ``keep=True`` (without it the config is refused)."""
    destroy_ends_processes: ClassVar[bool] = False
    """Whether :meth:`destroy` ends every process in the sandbox by itself (a container,
    a VM). When it does not, the runtime sweeps what its commands left before it."""
    pid_namespace: ClassVar[bool] = False
    """Whether the sandbox has a pid namespace of its own, so that every process started
    after :meth:`create` is one of its commands' however it detached itself (``setsid``,
    ``env -i``): the runtime's sweep then takes them all, not only those that carry the
    mark (the channel's agent spared)."""
    route_hint: ClassVar[str] = ""
    """What to tell a caller who asked for a route to the host this sandbox cannot offer."""

    def __init__(self, config: RuntimeConfig):
        self.config = config

    @property
    def sandbox_id(self) -> str | None:
        """The backend's own id for the sandbox (``None`` before :meth:`create`): the id
        :meth:`SandboxLister.list_sandboxes` reports, so a user who reads it in an error
        finds the same row in ``vf-sandbox ls``."""
        return None

    @abc.abstractmethod
    async def create(self, request: CreateRequest) -> str:
        """Create the sandbox (or attach to the one the config names) and return its
        absolute, writable workdir.

        Runs shielded from cancellation. Keep a handle on what was created before any
        further await: if ``create`` raises, :meth:`destroy` runs to remove what was made.
        Store ``request.labels`` with what you create, where a later process can read them
        and the sandbox's code cannot rewrite them (container labels, cloud tags, a file
        beside the sandbox): :meth:`SandboxLister.list_sandboxes` reports them.

        Raises:
            ProvisioningError: the sandbox could not be created.
        """

    @abc.abstractmethod
    async def destroy(self, *, keep: bool) -> None:
        """Destroy the sandbox, or release one the config only attached to. Runs once,
        after :meth:`create` began, and must cope with a half-finished ``create``.

        ``keep`` (only if :attr:`keep_supported`): release what the host holds and leave
        the sandbox, processes and all, for debugging.

        Raises:
            SandboxTransportError: the backend could not confirm the sandbox is gone.
        """

    @abc.abstractmethod
    async def alive(self) -> bool:
        """Whether the sandbox answers: ``False`` for a dead one, never an error for it.

        Raises:
            SandboxTransportError: the backend cannot tell.
        """

    @abc.abstractmethod
    async def spawn(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run one process in the sandbox with pipes; return its exit code (``128 + N``
        after signal N).

        Feed ``request.stdin`` (:func:`runtimes.stdin_feed.feed_stdin`), stream its output
        into ``sink`` as it comes (stop reading when ``sink.feed`` returns ``False``), call
        ``sink.exited(code)`` the moment the process exits and set ``sink.pid`` once known.
        When cancelled (a timeout, the output cap, the caller), kill its whole process
        group, shielded, then let the cancellation propagate.

        Raises:
            SandboxFileNotFoundError: the program or ``cwd`` is missing.
            SandboxPermissionError: the program cannot be run; ``user`` cannot be switched
                to (:func:`~runtimes.errors.cannot_run_as`).
            SandboxNotADirectoryError: ``cwd`` is not a directory.
            SandboxInvalidArgumentError: argv over the kernel's limit; an unknown ``user``
                (:func:`~runtimes.errors.no_such_user`).
        """

    @property
    def policy_user(self) -> str | None:
        """The unprivileged account a rollout's policy runs its commands as
        (:attr:`runtimes.Runtime.policy_user`; made on first use), or ``None``: the policy
        runs as the default user."""
        return None

    def live_cap(self) -> int | None:
        """How many sandboxes of this backend may be alive at once in this process (a
        config field such as ``max_live``); :meth:`runtimes.Runtime.start` waits for a
        slot. ``None``: no cap."""
        return None

    async def prepare(self, request: CreateRequest) -> None:
        """Cancellable work before the shielded :meth:`create`, with the live slot held:
        pacing against an API's rate limit, or a creation the backend can cancel itself
        (keep the handle at once, so that :meth:`destroy` removes it if the start goes no
        further)."""
        return None

    @property
    def attached(self) -> bool:
        """Whether :meth:`create` attached to a sandbox that existed before (code of others
        may have run in it) rather than making a fresh one. The runtime then kills what its
        commands left before letting it go, and never starts the channel's agent in it
        (the agent's interpreter would be found on that sandbox's ``PATH``)."""
        return False

    def describe(self) -> str:
        """A short human name for messages: the type name and the sandbox id."""
        return f"{self.name} sandbox {self.sandbox_id or '(not started)'}"


@dataclass(frozen=True)
class CreateRequest:
    """What the runtime asks of :meth:`Backend.create`, besides the config."""

    labels: dict[str, str]
    """The sandbox's labels (:func:`runtimes.ownership.ownership_labels`: its creator, the
    creation time, whether it is kept, the config's ``labels``)."""
    mark: str
    """The value of ``VF_SANDBOX_RUNTIME`` that every command of this sandbox carries
    (:data:`runtimes.sweep.MARK_VAR`): what sweeps find its processes by."""
    snapshot: SandboxSnapshot | None = None
    """The snapshot the sandbox's files start as (only for a :class:`Snapshotter`)."""


class FileFastPath(abc.ABC):
    """Capability: single files through the transport's own file API. Each gets an
    absolute, resolved path. (``lstat`` and ``mkdir`` take the generic path, or the
    channel.)"""

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


class StreamSpawner(abc.ABC):
    """Capability: a long-lived process whose stdin and stdout are one byte stream. The
    channel's agent (``docs/channel.md``) runs over it when the config's ``channel`` field
    is true: every ``exec``, ``read``, ``write``, ``exists``, ``remove`` then costs about a
    millisecond instead of a process each. The runtime supplies the rest of what the
    channel needs: kills through :meth:`Backend.spawn`, :meth:`Backend.alive` as the death
    probe, and, where the backend is a :class:`TrustedReader`, the check of the agent's
    files before a restart. Never in a sandbox the backend :attr:`~Backend.attached` to."""

    @abc.abstractmethod
    async def open_stream(self, argv: list[str]) -> ChannelTransport:
        """Start ``argv`` in the sandbox (as the default user, in the workdir, with no
        environment of the caller's) with its stdin attached, and return its stdin and
        stdout as one stream.

        Raises:
            SandboxError: the process could not be started.
        """


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


def bookkeeping_request(
    argv: list[str], *, cwd: str, stdin: bytes | None = None, limit: int = 1 << 20
) -> tuple[ExecRequest, OutputSink]:
    """A request (and its sink) for the machinery's own commands in the sandbox: no caller
    environment, the default user, no timeout, output capped at ``limit``."""
    request = ExecRequest(
        argv=tuple(argv),
        cwd=cwd,
        env={},
        stdin=stdin,
        user=None,
        timeout=None,
        output_limit=limit,
    )
    return request, OutputSink(limit)
