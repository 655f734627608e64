"""The ``ssh`` runtime class: :class:`SSHRuntime` (lifecycle, connection upkeep, exec, files,
port forwarding, sweeping), built on the blocking pieces of this package."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import anyio
import anyio.to_thread

from .. import ownership
from .._extract import Links
from ..arguments import text_bytes
from ..channel import (
    ChannelHooks,
    ChannelTransport,
    verify_by_reading,
)
from ..config import RuntimeConfig
from ..errors import (
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
    cannot_run_as,
)
from ..models import ExecRequest, OutputSink, SandboxInfo
from ..routes import HostRoute, RouteKind
from ..snapshot import SandboxSnapshot, SnapshotNotFoundError, snapshot_from_labels
from ..sweep import MARK_VAR, sweep_argv
from ..wrapper import check_argv_size, new_nonce, spool_argv
from .client import Connection
from .config import SSHConfig
from .connected import ConnectedRuntime
from .control import (
    destroy_host_sandbox,
    destroy_host_snapshot,
    kill_script,
    list_host_sandboxes,
    list_host_snapshots,
    remove_script,
    run_control,
    setup_script,
    snapshot_script,
    valid_snapshot_dir,
)
from .files import is_dir, sftp_exists, sftp_read, sftp_read_or_none, sftp_write
from .process import (
    AgentTransport,
    RemoteCommand,
    Tools,
    agent_command_line,
    command_line,
    limit_options,
    limits_prefix,
    run_streams,
    sink_exited,
    sink_feeder,
    start_command,
    wrapped_argv,
)

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("runtimes.ssh")

T = TypeVar("T")

_INLINE_SCRIPT_LIMIT = 96 * 1024
"""Longer commands (big argv or env) have the wrapper read its arguments from an uploaded file:
sshd hands the whole command to the login shell as one argument, which the kernel caps at
128 KiB."""
_HEADER_WAIT = 5.0
_READER_WAIT = 5.0
_KILL_WAIT = 5.0
"""Seconds a process-group kill may take (at most ``io_timeout``): a server that does not
answer must not hold a timed-out exec for ``io_timeout``. A missed kill is retried before
the next command."""


class SSHRuntime(ConnectedRuntime):
    """A private directory on a remote host over SSH (paramiko). Isolation is the remote user's."""

    name = "ssh"
    config_model = SSHConfig
    keep_supported = True
    snapshot_holds = "workdir"

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self._dir: str | None = None
        self._tools: Tools | None = None
        self._limits: list[str] = []
        self._owns_workdir = True
        self._exec_slots: anyio.Semaphore | None = None
        self._stream_limiter: anyio.CapacityLimiter | None = None

    # ------------------------------------------------------------------ the channel's needs

    def _channel_hooks(self) -> ChannelHooks:
        return ChannelHooks(
            open_transport=self._open_agent,
            kill_group=self._kill_group_plainly,
            lost_means_dead=_never,
            verify_agent=self._verify_agent_files,
        )

    def _channel_wanted(self) -> bool:
        """The agent takes one of ``max_channels``: it needs five. Not with resource limits:
        they are set per command on the plain path (the agent's own threads and address space
        would count against them)."""
        wanted = self.config.channel and self.config.max_channels >= 5
        return wanted and not limit_options(self.config)

    def _channel_stall_timeout(self) -> float:
        return self.config.io_timeout

    def _channel_kill_wait(self) -> float:
        return self._kill_wait

    def _channel_env(self, request: ExecRequest) -> Mapping[str, str]:
        """The runtime's mark on the runtime's own bookkeeping commands too, as the plain
        path's wrapper sets it (a kill owed to one of them is guarded by it)."""
        return {MARK_VAR: self._mark}

    def _sweep_argv(self) -> list[str]:
        """Processes carrying the runtime's mark or working in a workdir of the sandbox's
        own; the channel agent's session is spared. Other processes of the login user are
        not the sandbox's: a leftover that scrubbed its environment and left the workdir is
        beyond reach (``docs/security.md``)."""
        home = self._workdir if self._owns_workdir else None
        agent = self._channel_agent_pid()
        users = ",".join(u for u in (self.policy_user, self.judge_user) if u)
        return sweep_argv("mark", self._mark_entry, keep=agent, user=users, home=home)

    @property
    def _mark_entry(self) -> str:
        """The mark as sweeps and kills look for it in ``/proc/PID/environ``."""
        return f"{MARK_VAR}={self._mark}"

    @property
    def sandbox_id(self) -> str | None:
        return self._dir

    def describe(self) -> str:
        where = f"{self.config.destination}:{self._dir}" if self._dir else self.config.destination
        return f"ssh sandbox {where}"

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> str:
        channels = self.config.max_channels
        self._connect_lock = anyio.Lock()
        self._sftp_lock = anyio.Lock()
        # SFTP, two control channels and (when enabled) the channel agent keep theirs.
        self._exec_slots = anyio.Semaphore(channels - 3 - int(self._channel_wanted()))
        self._control_slots = anyio.Semaphore(2)
        self._call_limiter = anyio.CapacityLimiter(channels)
        self._stream_limiter = anyio.CapacityLimiter(3 * channels)
        conn = await self._thread(self._open_connection)
        self._conn = conn
        meta = {
            "labels": ownership.ownership_labels(
                self.name, self.config.labels, keep=self.config.keep
            ),
            "destination": self.config.destination,
            "workdir": self.config.workdir,
        }
        snap = self._snapshot_source
        script = setup_script(
            self._mark,
            self.config.workdir,
            snap.id if snap is not None else None,
            passage=self._inherits_policy_account(),
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
        log.debug("opened %s (workdir %s)", self.describe(), workdir)
        await self._start_channel()
        return workdir

    # ------------------------------------------------------------------ snapshots

    def _check_fork_config(self) -> None:
        """A fork gets a private copy of the snapshot's workdir.

        Raises:
            SandboxInvalidArgumentError: the config names a ``workdir``.
        """
        if self.config.workdir is not None:
            raise SandboxInvalidArgumentError(
                "an ssh sandbox opened from a snapshot gets a private copy of the snapshot's "
                f"workdir: drop workdir={self.config.workdir!r} from its config"
            )

    async def _snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        """Copy the workdir into a snapshot directory under the remote temp dir (``cp -a``:
        links copied as links, reflinks where the filesystem has them).

        Raises:
            SandboxError: the copy failed (an unreadable file, no space), or the workdir is
                not a directory any more.
        """
        code, out, err = await self._control(
            snapshot_script(self.workdir),
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

    async def _close(self) -> None:
        try:
            if self._dir is not None and not self._keep:
                await self._remove_remote()
        finally:
            self._conn_released = True  # a call in flight must not reconnect now
            conn, self._conn = self._conn, None
            self._forwards.clear()
            if conn is not None:
                await anyio.to_thread.run_sync(conn.close)

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

    def close_at_exit(self) -> None:
        """Blocking cleanup at interpreter exit.

        paramiko's own atexit hook (registered after ours, so run before it) has already
        stopped every transport by then: reconnect to remove the sandbox.
        """
        self._close_channel_now()
        conn = self._conn
        try:
            if self._dir is not None and not self._keep:
                if conn is None or not conn.usable():
                    conn = self._open_connection()
                script = remove_script(self._dir, self._mark_entry, f"{self._dir}/work")
                run_control(conn.transport, script, None, self.config.io_timeout)
        finally:
            if conn is not None:
                conn.close()
            if self._conn is not None and self._conn is not conn:
                self._conn.close()
            self._conn = None
            self._mark_closed()

    def _host_routes(self) -> tuple[RouteKind, ...]:
        return ("forward",)

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        remote = await self.forward_remote(port)

        async def cancel() -> None:
            if not self.closed:
                await self.cancel_forward_remote(remote)

        return HostRoute("forward", "127.0.0.1", remote, _close=cancel)

    async def _alive(self) -> bool:
        assert self._dir is not None
        directory = self._dir
        try:
            return await self._retrying(self._sftp_call, is_dir, directory) is True
        except SandboxUnavailableError:
            return False

    # ------------------------------------------------------------------ exec

    def _run_as(self, request: ExecRequest) -> str | None:
        user = request.user
        if user is None or user == self.config.username:
            return None
        if self.config.username != "root":
            raise cannot_run_as(
                request.argv[0], user, f"logged in as {self.config.username!r}, not root"
            )
        if self._tools is None or self._tools.runuser is None:
            raise cannot_run_as(request.argv[0], user, "runuser is not installed")
        return user

    @property
    def policy_user(self) -> str | None:
        """``policy_user`` of the config (root logins only)."""
        return self.config.policy_user

    @property
    def judge_user(self) -> str | None:
        """``judge_user`` of the config (which needs ``policy_user``): an existing account."""
        return self.config.judge_user if self.policy_user is not None else None

    _creates_policy_user = False  # a host's accounts are not ours to make

    def _policy_passage(self) -> str:
        """The sandbox's private directory, above a workdir of its own (``mktemp -d``, 0700)."""
        return (self._dir or "") if self._owns_workdir else ""

    def _check_request(self, request: ExecRequest) -> None:
        """Refuse what the plain path would refuse before the channel sees it, so both paths
        give the same error: a user this login cannot switch to, an argv over the kernel's
        limits (the agent would only see E2BIG, without which limit).

        Raises:
            SandboxPermissionError: ``user`` cannot be switched to.
            SandboxInvalidArgumentError: the argv or env is over the kernel's limits.
        """
        self._run_as(request)
        check_argv_size(request.argv, request.env)

    async def _verify_agent_files(self, digests: Mapping[str, bytes]) -> str | None:
        """Before the channel agent restarts: the files the first agent ran from, read
        again through SFTP (the server's file access, no shell) and hashed."""

        async def read(path: str) -> bytes | None:
            return await self._retrying(self._sftp_call, sftp_read_or_none, path)

        return await verify_by_reading(read, digests)

    async def _open_agent(self, interpreter: str | None = None) -> ChannelTransport:
        """Start the channel agent on a channel of its own (stdin attached)."""
        conn, channel = await self._retrying(self._open_channel)
        command = text_bytes(agent_command_line(self._mark, interpreter), "the agent's command")
        with self._paramiko_calls(
            conn, "starting the channel agent", "the server refused the agent"
        ):
            await self._thread(start_command, channel, command, False, self.config.io_timeout)
        return AgentTransport(channel)

    async def _kill_group_plainly(self, pgid: int) -> None:
        """The channel's fallback kill, when its agent died holding a process group."""
        conn = self._conn
        if conn is None or not conn.usable():
            return  # the connection went: the agent saw its stdin end and killed the group
        try:
            await self._control(kill_script([pgid]), timeout=self._kill_wait)
        except SandboxError as exc:
            log.warning("%s: could not kill process group %s: %s", self.describe(), pgid, exc)
            self._remember_orphan(pgid)

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        run_as = self._run_as(request)
        assert self._exec_slots is not None and self._dir is not None
        assert self._tools is not None
        nonce = new_nonce()
        argv = wrapped_argv(request, nonce, self._mark, self._tools, run_as)
        # The limits are set on the wrapper: it, runuser and the command inherit them.
        command = command_line([*self._limits, *argv])
        if len(command) > _INLINE_SCRIPT_LIMIT:
            spool = f"{self._dir}/x/{nonce}.args"  # the wrapper removes it once read
            short, spooled = spool_argv(argv, spool)
            await self._retrying(self._sftp_call, sftp_write, spool, spooled)
            command = command_line([*self._limits, *short])
        async with self._exec_slots:
            conn, channel = await self._retrying(self._open_channel)
            remote = RemoteCommand(channel, nonce, sink_feeder(sink), sink_exited(sink))
            try:
                # Not retried from here on: the command may have started. Shielded so a
                # cancellation finds the command either not sent or sent and abortable.
                with anyio.CancelScope(shield=True):
                    await self._send_command(conn, channel, command, request)
                try:
                    return await self._run_remote(conn, remote, request, sink)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        # Once the caller returned at the exit, what is left is the sweep's.
                        await self._abort(remote, kill=not sink.detached)
                    raise
            finally:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(channel.close)

    async def _send_command(
        self, conn: Connection, channel: paramiko.Channel, command: bytes, request: ExecRequest
    ) -> None:
        what = f"exec of {request.argv[0]!r}"
        with self._paramiko_calls(conn, what, "the server refused the command"):
            await self._thread(
                start_command, channel, command, not request.stdin, self.config.io_timeout
            )

    async def _run_remote(
        self, conn: Connection, remote: RemoteCommand, request: ExecRequest, sink: OutputSink
    ) -> int:
        await run_streams(remote, request.stdin, sink, self._stream_limiter)
        report = remote.reader.report
        if report is not None and not report.ok:
            raise report.error(request, where=self.describe())
        if remote.failure is not None or (
            remote.exit_status in (None, -1) and not conn.transport.is_active()
        ):
            raise self._broken(
                conn,
                f"exec of {request.argv[0]!r} (it may still run)",
                remote.failure or EOFError(),
            )
        if remote.exit_status is None:  # the sink refused more output: the caller raises
            await self._abort(remote)
            return -1
        if report is None:
            said = (remote.reader.preamble + remote.reader.held).decode("utf-8", "replace")
            raise SandboxError(
                f"{self.describe()}: the remote login shell did not run the command wrapper "
                f"(a POSIX login shell is needed): {said.strip() or 'no output'}"
            )
        if remote.exit_status == -1:
            raise SandboxTransportError(
                f"{self.describe()}: the channel closed without an exit status"
            )
        if remote.reader.preamble:
            noise = remote.reader.preamble[:200]
            log.debug("%s: login shell said on stderr: %r", self.describe(), noise)
        return remote.exit_status

    async def _abort(self, remote: RemoteCommand, *, kill: bool = True) -> None:
        """Kill the command's process group (shielded by the caller; not without ``kill``),
        then drop the channel."""
        if remote.finished:
            return
        report = remote.reader.report
        if report is None:
            if not remote.started:
                # Cancelled before its pump ran: read just the header on a thread of our own.
                threading.Thread(target=remote.pump, args=(True,), daemon=True).start()
            await anyio.to_thread.run_sync(remote.header_seen.wait, _HEADER_WAIT)
        if remote.pgid is not None and kill:
            try:
                await self._control(kill_script([remote.pgid]), timeout=self._kill_wait)
            except SandboxError as exc:
                log.warning(
                    "%s: could not kill process group %s (retried before the next command): %s",
                    self.describe(),
                    remote.pgid,
                    exc,
                )
                self._remember_orphan(remote.pgid)
        elif kill and (report is None or report.ok):
            log.warning("%s: a cancelled command never reported its process group", self.describe())
        await anyio.to_thread.run_sync(remote.channel.close)
        if remote.started:
            await anyio.to_thread.run_sync(remote.done.wait, _READER_WAIT)

    @property
    def _kill_wait(self) -> float:
        return min(self.config.io_timeout, _KILL_WAIT)

    async def _kill_orphan_groups(self, pgids: frozenset[int]) -> None:
        """Kill the process groups earlier kills missed, if they are still ours (their
        leader carries the runtime's mark: after a reboot the ids mean other processes).

        Raises:
            SandboxError: the kill could not be delivered.
        """
        await self._control(kill_script(pgids, self._mark), timeout=self._kill_wait)

    # ------------------------------------------------------------------ files

    async def _read(self, path: str, limit: int) -> bytes:
        return await self._retrying(self._sftp_call, sftp_read, path, limit)

    async def _write(self, path: str, data: bytes) -> None:
        await self._sftp_call(sftp_write, path, data)

    async def _exists(self, path: str) -> bool:
        return await self._retrying(self._sftp_call, sftp_exists, path)

    async def _download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        parent = super()._download

        async def download() -> None:
            await parent(remote, local, skip_unsafe=skip_unsafe, links=links)

        await self._retrying(download)

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


async def _never() -> bool:
    """A dropped SSH channel says nothing about the host: the next call finds out."""
    return False
