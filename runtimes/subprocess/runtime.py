"""The subprocess backend and its runtime (see :mod:`runtimes.subprocess`)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import subprocess
import tempfile
from pathlib import Path

import anyio
import anyio.abc

from .._extract import Links
from ..backend import (
    Backend,
    CreateRequest,
)
from ..capabilities import (
    BlockingTeardown,
    FileFastPath,
    HostRouter,
    ProcessSweeper,
    RemoveFastPath,
    SandboxLister,
    ShellOpener,
    Snapshotter,
    TreeFastPath,
)
from ..composed import BackendRuntime
from ..config import RuntimeConfig
from ..errors import (
    SandboxError,
    cannot_run_as,
    error_for_errno,
    no_such_user,
)
from ..models import ExecRequest, OutputSink, SandboxInfo
from ..routes import HostRoute, RouteKind
from ..snapshot import SandboxSnapshot, snapshot_from_labels
from .config import META_FILE, SubprocessConfig, default_root
from .files import (
    CreatedDir,
    copy_local_tree,
    download_tree,
    open_for_read,
    open_for_write,
    prepare_workdir,
    read_file,
    read_opened,
    remove_path,
    remove_sandbox_dir,
    write_file,
    write_opened,
)
from .mounts import INLINE_READ_BYTES, INLINE_WRITE_BYTES, WATCH
from .process import (
    HAS_EPOLL,
    EpollPump,
    ExitWatch,
    drain_fd,
    feed_pipe,
    kill_group,
    pump_with_stdin_source,
    report_exit,
    spawn_error,
)
from .snapshots import copy_snapshot_into, destroy_snapshot_dir, scan_snapshots, take_snapshot
from .sweep import (
    SINCE_MARGIN_TICKS,
    SweepTarget,
    boot_ticks,
    destroy_dir,
    forget_sessions,
    real_dirs,
    record_session,
    scan_root,
    sweep_target,
)

log = logging.getLogger("runtimes.subprocess")


class SubprocessBackend(
    Backend,
    BlockingTeardown,
    FileFastPath,
    TreeFastPath,
    RemoveFastPath,
    SandboxLister,
    Snapshotter,
    ProcessSweeper,
    ShellOpener,
    HostRouter,
):
    """A private directory on the host plus process-group discipline. Not isolation.

    ``create()`` raises :class:`SandboxFileNotFoundError` when the config names a ``workdir``
    that does not exist (unless ``create_workdir``), :class:`SandboxNotADirectoryError` when
    it is not a directory, and :class:`ProvisioningError` when a directory cannot be made.
    Every file operation is the host's own (no process), and :meth:`destroy` sweeps what the
    sandbox's commands left (freeze-then-kill of ``/proc``) before it removes the directory.
    """

    name = "subprocess"
    config_model = SubprocessConfig
    keep_supported = True
    destroy_ends_processes = True
    snapshot_holds = "workdir"

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: SubprocessConfig
        self._workdir: str | None = None
        self._dir: Path | None = None
        self._owns_workdir = True
        self._sessions: dict[int, int] = {}  # session id (its leader's pid) -> leader start
        self._target: SweepTarget | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of self._dir
        self._created: CreatedDir | None = None  # what create_workdir made, removed on close

    @property
    def sandbox_id(self) -> str | None:
        return self._dir.name if self._dir else None

    async def create(self, request: CreateRequest) -> str:
        self._workdir = await anyio.to_thread.run_sync(self._make_dirs, request)
        return self._workdir

    def _given_workdir(self) -> Path | None:
        """The config's ``workdir``, checked (or created with ``create_workdir``); None
        when the config names none."""
        if not self.config.workdir:
            return None
        self._owns_workdir = False
        workdir = Path(self.config.workdir).absolute()
        try:
            self._created = prepare_workdir(workdir, create=self.config.create_workdir)
        except OSError as exc:
            if isinstance(exc, SandboxError):
                raise
            from ..errors import ProvisioningError

            raise ProvisioningError(f"cannot create the workdir {workdir}: {exc}") from exc
        return workdir

    def _root(self) -> Path:
        return Path(self.config.root or default_root())

    def _make_dirs(self, request: CreateRequest) -> str:
        given = self._given_workdir()
        root = self._root()
        try:
            root.mkdir(parents=True, exist_ok=True)
            since = boot_ticks() - SINCE_MARGIN_TICKS
            self._dir = Path(tempfile.mkdtemp(prefix="sbx-", dir=root))
            st = os.lstat(self._dir)
            self._identity = (st.st_dev, st.st_ino)
            meta: dict[str, object] = {
                "labels": request.labels,
                "mark": request.mark,
                "since": since,
            }
            if given is None:
                workdir = self._dir / "work"
            else:
                workdir = given
                meta["workdir"] = str(workdir)
                if self._created is not None:
                    meta["created"] = self._created.to_meta()
            # Labelled before anything long (a fork's copy): a holder killed meanwhile
            # leaves a directory that `vf-sandbox cleanup` finds.
            (self._dir / META_FILE).write_text(json.dumps(meta))
            if given is None and request.snapshot is not None:
                copy_snapshot_into(request.snapshot, workdir)
            elif given is None:
                workdir.mkdir()
            self._target = SweepTarget(
                mark=request.mark,
                dirs=real_dirs(self._dir, workdir),
                sessions=self._sessions,
                since=since,
            )
        except OSError as exc:
            from ..errors import ProvisioningError

            raise ProvisioningError(
                f"cannot create a sandbox directory under {root}: {exc}"
            ) from exc
        return str(workdir)

    async def destroy(self, *, keep: bool) -> None:
        await anyio.to_thread.run_sync(self._teardown, keep)

    # ------------------------------------------------------------------ snapshots

    def check_fork_config(self) -> None:
        """A fork gets a private copy of the snapshot's workdir, never a directory of yours.

        Raises:
            SandboxInvalidArgumentError: the config names a ``workdir``.
        """
        if self.config.workdir:
            from ..errors import SandboxInvalidArgumentError

            raise SandboxInvalidArgumentError(
                "a subprocess sandbox opened from a snapshot gets a private copy of the "
                f"snapshot's workdir: drop workdir={self.config.workdir!r} from its config"
            )

    async def snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        """Copy the workdir into ``<root>/snap-*/tree`` (see :mod:`.snapshots`).

        Raises:
            SandboxError: the copy failed (an unreadable file, no space), or the workdir was
                replaced by a link.
        """
        assert self._workdir is not None
        root, workdir = self._root(), Path(self._workdir)
        directory = await anyio.to_thread.run_sync(take_snapshot, root, workdir, labels)
        return snapshot_from_labels(self.name, str(directory), labels, "workdir")

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """The snapshot directories of this user under the config's root."""
        root = Path(getattr(config, "root", None) or default_root())
        return await anyio.to_thread.run_sync(scan_snapshots, root)

    @classmethod
    def destroy_snapshot_now(cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None) -> None:
        destroy_snapshot_dir(snapshot)

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Remove a snapshot's directory (never following a link); gone already is fine.

        Raises:
            SandboxInvalidArgumentError: ``snapshot.id`` is not a snapshot directory of this
                user's.
        """
        await anyio.to_thread.run_sync(destroy_snapshot_dir, snapshot)

    def destroy_now(self, *, keep: bool) -> None:
        """:meth:`destroy`, synchronous (the exit backstop needs no event loop)."""
        self._teardown(keep)

    def _teardown(self, keep: bool) -> None:
        """Kill every process of the sandbox (freeze-then-kill), then remove its directory
        without following a link. Never raises: what could not be done is logged. A kept
        sandbox (``keep=True``) is left as it is, processes and all."""
        if keep:
            self._sessions.clear()
            return
        if self._target is not None:
            try:
                _killed, survivors = sweep_target(self._target)
            except OSError as exc:  # /proc unreadable: fall back to the groups we started
                log.warning("%s: process sweep failed: %s", self.describe(), exc)
                survivors = []
                for pgid, leader_start in list(self._sessions.items()):
                    kill_group(pgid, leader_start)
            if survivors:
                log.warning(
                    "%s: processes still running after close(): %s", self.describe(), survivors
                )
            forget_sessions(self._sessions)
            self._sessions.clear()
        if self._created is not None:
            self._created.remove()
        if self._dir is not None:
            remove_sandbox_dir(self._dir, self._identity)

    def host_routes(self) -> tuple[RouteKind, ...]:
        return ("loopback",)  # the host's own network namespace

    async def expose_host(self, port: int, via: RouteKind) -> HostRoute:
        return HostRoute("loopback", "127.0.0.1", port)

    async def alive(self) -> bool:
        return self._workdir is not None and await anyio.Path(self._workdir).is_dir()

    # ------------------------------------------------------------------ exec

    def _base_env(self, request: ExecRequest, home: str) -> dict[str, str]:
        if self.config.inherit_env:
            env = dict(os.environ)
        else:
            env = {
                "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
                "LANG": os.environ.get("LANG", "C.UTF-8"),
                "HOME": home,
            }
        env.update(request.env)
        return env

    def _user_for(self, request: ExecRequest) -> str | None:
        user = request.user or self.config.user
        if user is None:
            return None
        try:
            entry = pwd.getpwnam(user) if not user.isdigit() else pwd.getpwuid(int(user))
        except KeyError:
            raise no_such_user(user) from None
        if entry.pw_uid == os.geteuid():
            return None
        if os.geteuid() != 0:
            raise cannot_run_as(request.argv[0], user, "the host process is not root")
        return entry.pw_name

    async def spawn(self, request: ExecRequest, sink: OutputSink) -> int:
        user = self._user_for(request)
        assert self._workdir is not None
        # Popen directly (no await until the handle is ours, so no cancellation can lose
        # the child), its pipes read with the event loop's own fd readiness and its exit
        # seen through a pidfd: no asyncio transports, no child-watcher thread per command.
        try:
            process = subprocess.Popen(  # noqa: ASYNC220 - fork+exec only, as asyncio does
                list(request.argv),
                stdin=subprocess.PIPE if request.stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=request.cwd,
                env=self._base_env(request, self._workdir),
                start_new_session=True,
                user=user,
            )
        except OSError as exc:
            raise spawn_error(exc, request) from None
        exit_watch = ExitWatch(process)
        self._sessions[process.pid] = exit_watch.leader_start
        if self._target is not None:
            record_session(self._target.mark, process.pid, exit_watch.leader_start)
        sink.pid = process.pid
        assert process.stdout is not None and process.stderr is not None
        try:
            stdin = request.stdin
            if stdin is not None and not isinstance(stdin, bytes):
                code = await pump_with_stdin_source(process, stdin, sink, exit_watch)
            elif HAS_EPOLL:
                code = await EpollPump(process, stdin, sink, exit_watch).run()
            else:
                async with anyio.create_task_group() as tg:
                    if process.stdin is not None:
                        tg.start_soon(feed_pipe, process.stdin, stdin)
                    tg.start_soon(drain_fd, process.stderr.fileno(), sink, "stderr")
                    tg.start_soon(report_exit, exit_watch, sink)
                    await drain_fd(process.stdout.fileno(), sink, "stdout")
                code = await exit_watch.wait()
        except BaseException:
            # Timeout, output cap or caller cancellation: the whole group goes, now. Not
            # once the caller returned at the exit (sink.detached): what is left of the
            # group is the sweep's, close()'s or a kept sandbox's.
            with anyio.CancelScope(shield=True):
                if not sink.detached:
                    exit_watch.kill_group()
                    await exit_watch.wait()
            raise
        finally:
            exit_watch.close()
            for pipe in (process.stdin, process.stdout, process.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        # Background processes the command left behind keep running until close().
        return 128 - code if code < 0 else code

    # ------------------------------------------------------------------ files

    async def read(self, path: str, limit: int) -> bytes:
        """The file's bytes (at most ``limit`` + 1). A regular file of up to
        :data:`~.mounts.INLINE_READ_BYTES` is read in the event loop's thread while every
        mount is local (:mod:`.mounts`); anything else in a worker thread.

        Raises:
            OutputLimitExceededError: the file is larger than ``limit``.
            SandboxError: typed by errno (no such file, a directory, a FIFO...).
        """
        if not WATCH.all_local():
            return await anyio.to_thread.run_sync(read_file, path, limit)
        opened = open_for_read(path, limit, local=True)
        _fd, size, regular, _path, _limit = opened
        if regular and 0 < size <= INLINE_READ_BYTES:
            return read_opened(*opened)
        # The thread owns the fd from here: shielded, so that no cancellation before it
        # runs leaves the fd open (a running thread cannot be cancelled anyway).
        with anyio.CancelScope(shield=True):
            data = await anyio.to_thread.run_sync(read_opened, *opened)
        return data

    async def write(self, path: str, data: bytes) -> None:
        """Write ``data`` (parents made). Up to :data:`~.mounts.INLINE_WRITE_BYTES` to a
        regular file is written in the event loop's thread while every mount is local
        (:mod:`.mounts`); anything else in a worker thread.

        Raises:
            SandboxError: typed by errno (a directory, a parent that is a file, a FIFO...).
        """
        if len(data) > INLINE_WRITE_BYTES or not WATCH.all_local():
            await anyio.to_thread.run_sync(write_file, path, data)
            return
        fd, regular = open_for_write(path, local=True)
        if regular:
            write_opened(fd, path, data)
            return
        with anyio.CancelScope(shield=True):  # the thread owns the fd (see read)
            await anyio.to_thread.run_sync(write_opened, fd, path, data)

    async def exists(self, path: str) -> bool:
        try:
            if WATCH.all_local():
                os.lstat(path)
            else:
                await anyio.to_thread.run_sync(os.lstat, path)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            return False
        except OSError as exc:
            raise error_for_errno(exc.errno, path, exc.strerror) from None
        return True

    async def remove(self, path: str) -> None:
        await anyio.to_thread.run_sync(remove_path, path)

    async def upload(self, source: Path, remote: str) -> None:
        await anyio.to_thread.run_sync(copy_local_tree, source, Path(remote), remote)

    async def download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        # the host's own tree, copied keeping every link as a link (never followed)
        await anyio.to_thread.run_sync(download_tree, remote, local, self.config.read_limit)

    async def sweep(self) -> int:
        """Kill every process of this sandbox that is still running; return how many
        (``stop_processes()``).

        Unlike the runtime's own sweep (an environment-mark scan), this freezes before it
        kills: every process started after the sandbox that carries its environment mark,
        belongs to a session one of its commands started, or has its cwd, root, executable,
        an open file or a mapping under the sandbox's directories is SIGSTOPped, the scan
        repeats until a pass finds nothing new, and then all are SIGKILLed. Processes that
        ``setsid`` or ``env -i`` and fork loops are caught; see the module's docstring and
        the README for what still escapes (a process that left every trace behind).

        Raises:
            SandboxError: some process of the sandbox is still running after the sweep
                (it could not be signalled, or kept appearing until the sweep's deadline).
        """
        assert self._target is not None
        killed, survivors = await anyio.to_thread.run_sync(sweep_target, self._target)
        if survivors:
            raise SandboxError(
                f"{self.describe()}: processes still running after stop_processes(): {survivors}"
            )
        return killed

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        root = Path(getattr(config, "root", None) or default_root())
        return await anyio.to_thread.run_sync(scan_root, root)

    @classmethod
    async def shell_argv(
        cls, info: SandboxInfo, config: RuntimeConfig | None = None, *, tty: bool
    ) -> list[str]:
        """``/bin/sh`` on the host, in the sandbox's workdir (see :mod:`.shell`).

        Raises:
            SandboxUnavailableError: the sandbox's directory or workdir is gone.
        """
        from .shell import local_shell_argv

        root = Path(getattr(config, "root", None) or default_root())
        return local_shell_argv(root / info.id)

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        root = Path(getattr(config, "root", None) or default_root())
        await anyio.to_thread.run_sync(destroy_dir, root / info.id)


class SubprocessRuntime(BackendRuntime):
    """The runtime over :class:`SubprocessBackend`: the embedded default
    (``open_runtime("subprocess")``)."""

    backend_class = SubprocessBackend
    backend: SubprocessBackend


# ---------------------------------------------------------------------- exec helpers
