"""Commands on the SSH connection: :class:`SSHExec`, the half of
:class:`~runtimes.ssh.SSHBackend` that runs one process per exec channel under the exec
wrapper (:mod:`.process`) and kills process groups over a control channel."""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from ..config import RuntimeConfig
from ..errors import SandboxError, SandboxTransportError, cannot_run_as
from ..models import ExecRequest, OutputSink
from ..wrapper import check_argv_size, new_nonce, spool_argv
from .client import Connection
from .connected import ConnectedBackend
from .control import kill_script
from .files import sftp_write
from .process import (
    RemoteCommand,
    Tools,
    command_line,
    run_streams,
    sink_exited,
    sink_feeder,
    start_command,
    wrapped_argv,
)

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("runtimes.ssh")

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


class SSHExec(ConnectedBackend):
    """Processes in the sandbox directory: :meth:`spawn` and :meth:`kill_groups` (the
    subclass's ``create`` sets the directory, the tools and the slots)."""

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self._dir: str | None = None
        self._mark: str | None = None
        self._tools: Tools | None = None
        self._limits: list[str] = []
        self._exec_slots: anyio.Semaphore | None = None
        self._stream_limiter: anyio.CapacityLimiter | None = None

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

    def check_request(self, request: ExecRequest) -> None:
        """Refuse what the plain path would refuse before the channel sees it, so both paths
        give the same error: a user this login cannot switch to, an argv over the kernel's
        limits (the agent would only see E2BIG, without which limit).

        Raises:
            SandboxPermissionError: ``user`` cannot be switched to.
            SandboxInvalidArgumentError: the argv or env is over the kernel's limits.
        """
        self._run_as(request)
        check_argv_size(request.argv, request.env)

    async def spawn(self, request: ExecRequest, sink: OutputSink) -> int:
        run_as = self._run_as(request)
        assert self._exec_slots is not None and self._dir is not None
        assert self._tools is not None and self._mark is not None
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
                self.owe_kill(remote.pgid)
        elif kill and (report is None or report.ok):
            log.warning("%s: a cancelled command never reported its process group", self.describe())
        await anyio.to_thread.run_sync(remote.channel.close)
        if remote.started:
            await anyio.to_thread.run_sync(remote.done.wait, _READER_WAIT)

    @property
    def _kill_wait(self) -> float:
        return min(self.config.io_timeout, _KILL_WAIT)

    async def kill_groups(self, pgids: Collection[int], *, mark: str | None) -> None:
        """Kill process groups over a control channel (no wrapper, no exec slot).

        With ``mark``: the kills earlier ones missed, only of groups still ours (their leader
        carries the mark: after a reboot the ids mean other processes). Without: the
        channel's fallback, its agent dead holding a fresh group; when the connection went
        too, there is nothing to do (the agent saw its stdin end and killed the group).

        Raises:
            SandboxError: the kill could not be delivered.
        """
        if mark is None:
            conn = self._conn
            if conn is None or not conn.usable():
                return
        await self._control(kill_script(pgids, mark), timeout=self._kill_wait)
