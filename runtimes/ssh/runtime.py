"""The ``ssh`` backend: :class:`SSHBackend` (lifecycle, files over SFTP, snapshots, the channel's
stream, port forwarding, sweeping), built on the connection upkeep of :mod:`.connected` and the
commands of :mod:`.commands`; and :class:`SSHRuntime`, the runtime composed around it."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import anyio

from ..arguments import text_bytes
from ..backend import (
    CreateRequest,
    SweepScope,
)
from ..capabilities import (
    BlockingTeardown,
    FileFastPath,
    HostRouter,
    SandboxLister,
    ShellOpener,
    Snapshotter,
    StreamSpawner,
    TrustedReader,
)
from ..channel import ChannelTransport
from ..composed import BackendRuntime
from ..config import RuntimeConfig
from ..errors import (
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from ..models import SandboxInfo
from ..routes import HostRoute, RouteKind
from ..snapshot import SandboxSnapshot, SnapshotNotFoundError, snapshot_from_labels
from ..sweep import MARK_VAR
from .commands import SSHExec
from .config import SSHConfig
from .control import (
    destroy_host_sandbox,
    destroy_host_snapshot,
    list_host_sandboxes,
    list_host_snapshots,
    remove_script,
    run_control,
    setup_script,
    snapshot_script,
    valid_snapshot_dir,
)
from .faults import paramiko_failures
from .files import is_dir, sftp_exists, sftp_read, sftp_read_or_none, sftp_write
from .process import (
    AgentTransport,
    Tools,
    agent_command_line,
    limit_options,
    limits_prefix,
    start_command,
)

log = logging.getLogger("runtimes.ssh")


class SSHBackend(
    SSHExec,
    StreamSpawner,
    TrustedReader,
    FileFastPath,
    SandboxLister,
    Snapshotter,
    ShellOpener,
    BlockingTeardown,
    HostRouter,
):
    """A private directory on a remote host over SSH (paramiko). Isolation is the remote user's.

    Its removal (:meth:`destroy`) kills what carries the mark or works in a workdir of the
    sandbox's own, then removes the directory: the runtime sweeps nothing before it.
    """

    name = "ssh"
    config_model = SSHConfig
    keep_supported = True
    destroy_ends_processes = True  # remove.sh sweeps the mark and the workdir first
    creates_policy_user = False  # a host's accounts are not ours to make
    probes_silence = False  # a probe is an SFTP call on the same connection
    snapshot_holds = "workdir"

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: SSHConfig
        self._workdir: str | None = None
        self._owns_workdir = True

    @property
    def _mark_entry(self) -> str:
        """The mark as sweeps and kills look for it in ``/proc/PID/environ``."""
        assert self._mark is not None
        return f"{MARK_VAR}={self._mark}"

    @property
    def sandbox_id(self) -> str | None:
        return self._dir

    def describe(self) -> str:
        where = f"{self.config.destination}:{self._dir}" if self._dir else self.config.destination
        return f"ssh sandbox {where}"

    # ------------------------------------------------------------------ the channel's needs

    def channel_wanted(self) -> bool:
        """The agent takes one of ``max_channels``: it needs five. Not with resource limits:
        they are set per command on the plain path (the agent's own threads and address space
        would count against them)."""
        wanted = self.config.channel and self.config.max_channels >= 5
        return wanted and not limit_options(self.config)

    def channel_stall_timeout(self) -> float:
        return self.config.io_timeout

    def channel_kill_wait(self) -> float:
        return self._kill_wait

    def channel_env(self) -> Mapping[str, str]:
        """The runtime's mark on the runtime's own bookkeeping commands too, as the plain
        path's wrapper sets it (a kill owed to one of them is guarded by it)."""
        assert self._mark is not None
        return {MARK_VAR: self._mark}

    async def lost_means_dead(self) -> bool:
        """A dropped SSH channel says nothing about the host: the next call finds out."""
        return False

    async def open_stream(self, argv: list[str]) -> ChannelTransport:
        """Start the channel agent on a channel of its own (stdin attached), carrying the
        mark (so that the removal finds it).

        Raises:
            SandboxError: the server refused the agent's command.
            SandboxTransportError: the connection failed.
        """
        assert self._mark is not None
        conn, channel = await self._retrying(self._open_channel)
        command = text_bytes(agent_command_line(self._mark, argv), "the agent's command")
        with self._paramiko_calls(
            conn, "starting the channel agent", "the server refused the agent"
        ):
            await self._thread(start_command, channel, command, False, self.config.io_timeout)
        return AgentTransport(channel)

    async def read_trusted(self, path: str) -> bytes | None:
        """A file the channel agent ran from, read through SFTP (the server's file access,
        no shell).

        Raises:
            SandboxError: SFTP refused the read (a directory, too large).
        """
        return await self._retrying(self._sftp_call, sftp_read_or_none, path)

    def sweep_scope(self) -> SweepScope:
        """Processes carrying the runtime's mark, running as the policy's or judges'
        account, or working in a workdir of the sandbox's own. Other processes of the login
        user are not the sandbox's: a leftover that scrubbed its environment and left the
        workdir is beyond reach (``docs/security.md``)."""
        users = tuple(u for u in (self.policy_user, self.judge_user) if u)
        home = self._workdir if self._owns_workdir else None
        return SweepScope("mark", users=users, home=home)

    # ------------------------------------------------------------------ lifecycle

    async def create(self, request: CreateRequest) -> str:
        """Connect, then make the sandbox directory ``vf-sandbox.<mark>`` (its labels
        beside it) and its workdir: a private one, the config's, or a copy of the
        snapshot's.

        Raises:
            ProvisioningError: the host cannot be reached or refuses us, or the directory
                could not be made.
            SnapshotNotFoundError: the snapshot is gone from the host.
        """
        channels = self.config.max_channels
        self._mark = request.mark
        # SFTP, two control channels and (when enabled) the channel agent keep theirs.
        self._exec_slots = anyio.Semaphore(channels - 3 - int(self.channel_wanted()))
        self._stream_limiter = anyio.CapacityLimiter(3 * channels)
        await self._connect_first()
        meta = {
            "labels": request.labels,
            "destination": self.config.destination,
            "workdir": self.config.workdir,
        }
        snap = request.snapshot
        script = setup_script(
            request.mark,
            self.config.workdir,
            snap.id if snap is not None else None,
            passage=request.policy_account_made,
        )
        timeout = self.config.snapshot_timeout if snap is not None else None
        try:
            code, out, err = await self._control(script, json.dumps(meta).encode(), timeout=timeout)
        except SandboxError as exc:
            raise ProvisioningError(
                f"{self.describe()}: setting up the sandbox failed: {exc}"
            ) from exc
        lines = out.decode("utf-8", "replace").split("\n")
        if code == 6 and snap is not None:
            raise SnapshotNotFoundError(f"{snap.describe()} is gone from {self.config.destination}")
        if code != 0 or len(lines) != 7:
            detail = err.decode("utf-8", "replace").strip() or f"exit status {code}"
            raise ProvisioningError(
                f"{self.describe()}: cannot create the sandbox directory: {detail}"
            )
        self._dir, workdir, setsid, env, runuser, prlimit, _ = lines
        self._tools = Tools(setsid=setsid, env=env, runuser=runuser or None)
        self._limits = limits_prefix(self.config, prlimit or None, self.describe())
        self._owns_workdir = self.config.workdir is None
        self._workdir = workdir
        log.debug("opened %s (workdir %s)", self.describe(), workdir)
        return workdir

    async def destroy(self, *, keep: bool) -> None:
        """Sweep and remove the sandbox directory (unless ``keep``), then let the connection
        go. A host unreachable now leaves the directory to ``vf-sandbox cleanup``.

        Raises:
            SandboxTransportError: the removal failed.
        """
        try:
            if self._dir is not None and not keep:
                await self._remove_remote()
        finally:
            await self._release_connection()

    async def _remove_remote(self) -> None:
        assert self._dir is not None
        script = remove_script(self._dir, self._mark_entry, f"{self._dir}/work")
        try:
            code, _, err = await self._control(script)
        except (SandboxUnavailableError, ProvisioningError) as exc:
            log.warning(
                "%s: host unreachable at close, directory left to `vf-sandbox cleanup`: %s",
                self.describe(),
                exc,
            )
            return
        if code != 0:
            raise SandboxTransportError(
                f"{self.describe()}: removing the sandbox failed: {err.decode('utf-8', 'replace')}"
            )

    def destroy_now(self, *, keep: bool) -> None:
        """Blocking cleanup at interpreter exit.

        paramiko's own atexit hook (registered after ours, so run before it) has already
        stopped every transport by then: reconnect to remove the sandbox. What fails is
        logged; the directory is then left to ``vf-sandbox cleanup``.
        """
        self._conn_released = True
        conn = self._conn
        failures: tuple[type[BaseException], ...] = (SandboxError, *paramiko_failures())
        try:
            if self._dir is not None and not keep:
                if conn is None or not conn.usable():
                    conn = self._open_connection()
                script = remove_script(self._dir, self._mark_entry, f"{self._dir}/work")
                code, _, err = run_control(conn.transport, script, None, self.config.io_timeout)
                if code != 0:
                    log.warning(
                        "%s: removing the sandbox at exit failed: %s",
                        self.describe(),
                        err.decode("utf-8", "replace").strip(),
                    )
        except failures as exc:
            log.warning(
                "%s: could not remove the sandbox at exit, left to `vf-sandbox cleanup`: %s",
                self.describe(),
                exc,
            )
        finally:
            if conn is not None:
                conn.close()
            if self._conn is not None and self._conn is not conn:
                self._conn.close()
            self._conn = None

    async def alive(self) -> bool:
        assert self._dir is not None
        directory = self._dir
        try:
            return await self._retrying(self._sftp_call, is_dir, directory) is True
        except SandboxUnavailableError:
            return False

    @property
    def policy_user(self) -> str | None:
        """``policy_user`` of the config (root logins only)."""
        return self.config.policy_user

    @property
    def judge_user(self) -> str | None:
        """``judge_user`` of the config (which needs ``policy_user``): an existing account."""
        return self.config.judge_user if self.policy_user is not None else None

    def policy_passage(self) -> str:
        """The sandbox's private directory, above a workdir of its own (``mktemp -d``, 0700)."""
        return (self._dir or "") if self._owns_workdir else ""

    # ------------------------------------------------------------------ routes to the host

    def host_routes(self) -> tuple[RouteKind, ...]:
        return ("forward",)

    async def expose_host(self, port: int, via: RouteKind) -> HostRoute:
        """A reverse port forward (:meth:`forward_remote`).

        Raises:
            SandboxError: the server refused the forward.
        """
        remote = await self.forward_remote(port)

        async def cancel() -> None:
            await self.cancel_forward_remote(remote)  # nothing once the connection went

        return HostRoute("forward", "127.0.0.1", remote, _close=cancel)

    # ------------------------------------------------------------------ files

    async def read(self, path: str, limit: int) -> bytes:
        return await self._retrying(self._sftp_call, sftp_read, path, limit)

    async def write(self, path: str, data: bytes) -> None:
        await self._sftp_call(sftp_write, path, data)

    async def exists(self, path: str) -> bool:
        return await self._retrying(self._sftp_call, sftp_exists, path)

    # ------------------------------------------------------------------ snapshots

    def check_fork_config(self) -> None:
        """A fork gets a private copy of the snapshot's workdir.

        Raises:
            SandboxInvalidArgumentError: the config names a ``workdir``.
        """
        if self.config.workdir is not None:
            raise SandboxInvalidArgumentError(
                "an ssh sandbox opened from a snapshot gets a private copy of the snapshot's "
                f"workdir: drop workdir={self.config.workdir!r} from its config"
            )

    async def snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        """Copy the workdir into a snapshot directory under the remote temp dir (``cp -a``:
        links copied as links, reflinks where the filesystem has them).

        Raises:
            SandboxError: the copy failed (an unreadable file, no space), or the workdir is
                not a directory any more.
        """
        assert self._workdir is not None
        code, out, err = await self._control(
            snapshot_script(self._workdir),
            json.dumps({"labels": labels}).encode(),
            timeout=self.config.snapshot_timeout,
        )
        directory = out.decode("utf-8", "replace").strip()
        if code != 0 or not valid_snapshot_dir(directory):
            detail = err.decode("utf-8", "replace").strip() or f"exit status {code}"
            raise SandboxError(f"{self.describe()}: the snapshot failed: {detail}")
        return snapshot_from_labels(self.name, directory, labels, "workdir")

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """Snapshot directories on ``config``'s host (none without an SSH config).

        Raises:
            ProvisioningError: the host cannot be reached or refuses the credentials.
            SandboxTransportError: the listing command failed.
        """
        if not isinstance(config, SSHConfig):
            return []
        return await list_host_snapshots(config)

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Remove a snapshot directory (gone already is fine).

        Raises:
            SandboxInvalidArgumentError: no SSH config, or ``snapshot.id`` is not a snapshot
                directory.
            ProvisioningError: the host cannot be reached or refuses the credentials.
            SandboxTransportError: the removal failed.
        """
        if not isinstance(config, SSHConfig):
            raise SandboxInvalidArgumentError("removing an ssh snapshot needs its SSHConfig")
        await destroy_host_snapshot(snapshot, config)

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Sandbox directories on ``config``'s host (none without an SSH config).

        Raises:
            ProvisioningError: the host cannot be reached or refuses the credentials.
            SandboxTransportError: the listing command failed.
        """
        if not isinstance(config, SSHConfig):
            return []
        return await list_host_sandboxes(config)

    @classmethod
    async def shell_argv(
        cls, info: SandboxInfo, config: RuntimeConfig | None = None, *, tty: bool
    ) -> list[str]:
        """``ssh -t`` to the host, in the sandbox's workdir (see :mod:`.shell`).

        Raises:
            SandboxInvalidArgumentError: no SSH config, ``info`` is not an SSH sandbox dir,
                or the config authenticates only with ``key_env``.
            SandboxFileNotFoundError: the ssh CLI is not installed.
        """
        from .shell import ssh_shell_argv

        if not isinstance(config, SSHConfig):
            raise SandboxInvalidArgumentError("a shell in an ssh sandbox needs its SSHConfig")
        return ssh_shell_argv(info, config, tty=tty)

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Kill what still runs in a listed sandbox and remove its directory.

        Raises:
            SandboxInvalidArgumentError: no SSH config, or ``info`` is not an SSH sandbox dir.
            ProvisioningError: the host cannot be reached or refuses the credentials.
            SandboxTransportError: the removal failed.
        """
        if not isinstance(config, SSHConfig):
            raise SandboxInvalidArgumentError("destroying an ssh sandbox needs its SSHConfig")
        await destroy_host_sandbox(info, config)


class SSHRuntime(BackendRuntime):
    """The runtime over :class:`SSHBackend` (``open_runtime({"type": "ssh", ...})``), with
    the reverse port forwards of its connection."""

    backend_class = SSHBackend
    backend: SSHBackend

    async def forward_remote(
        self, local_port: int, remote_port: int = 0, *, local_host: str = "127.0.0.1"
    ) -> int:
        """Make ``127.0.0.1:<port>`` on the remote host reach ``local_host:local_port`` here:
        a reverse (``ssh -R``) forward on this sandbox's connection, re-established on
        reconnect, ending with the runtime (:meth:`ConnectedBackend.forward_remote
        <runtimes.ssh.connected.ConnectedBackend.forward_remote>`); the remote port.

        Raises:
            SandboxInvalidArgumentError: a port out of range.
            SandboxError: the server refused the forward (``AllowTcpForwarding``, port in use).
            SandboxTransportError: the connection failed.
            SandboxUnavailableError: the sandbox is closed or its host is gone.
        """
        self._check_open()
        return await self.backend.forward_remote(local_port, remote_port, local_host=local_host)

    async def cancel_forward_remote(self, remote_port: int) -> None:
        """Stop a forward made by :meth:`forward_remote`. Unknown ports are ignored.

        Raises:
            SandboxUnavailableError: the sandbox is closed.
            SandboxTransportError: the connection failed.
        """
        self._check_open()
        await self.backend.cancel_forward_remote(remote_port)
