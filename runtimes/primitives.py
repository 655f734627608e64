"""How a runtime's calls reach its sandbox: the backend's primitives, and the routing
through the channel in front of them.

:class:`Primitives` is the half of :class:`~runtimes.base.Runtime` that
:class:`~runtimes.composed.BackendRuntime` fills in from its :class:`~runtimes.Backend`. The
``_``-prefixed primitives (``_exec``, ``_read``, ``_write``, ``_exists``, ``_remove``,
``_upload``, ``_download``) are the *plain* paths, which work without the channel. The
``_routed_*`` methods put the channel in front of them when the backend has one
(:meth:`Primitives._channel_hooks`): the supervisor (:mod:`runtimes.channel`) serves the call,
restarts the agent, probes a silent sandbox, and hands an idempotent call (or one it never
sent) to the plain path when the channel dies. Kills that could not be delivered are owed
(:meth:`Primitives._remember_orphan`) and paid before the next command.
"""

from __future__ import annotations

import abc
import errno
import logging
import signal
import time
from collections.abc import Mapping
from pathlib import Path

import anyio

from ._extract import Links
from ._local_files import shell_error, tar_directory, untar_into, write_local_file
from .backend import bookkeeping_request
from .channel import KILL_WAIT, ChannelHooks, ChannelInfo, ChannelSupervisor
from .channel.agent.wire import KINDS, PathInfo
from .config import RuntimeConfig
from .errors import (
    HostRouteError,
    OutputLimitExceededError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxResourceError,
    error_for_errno,
)
from .models import ExecRequest, OutputSink
from .sweep import MARK_VAR, kill_argv

log = logging.getLogger("runtimes")

_SIGKILLED = 128 + signal.SIGKILL

__all__ = ["Primitives"]

_LSTAT_SCRIPT = r"""
f=$1 max=$2
if [ -L "$f" ]; then
  printf 'symlink '; stat -c '%f %u %g %h %s' -- "$f" || exit 5; readlink -- "$f" | head -c 4096
  exit 0
fi
if [ ! -e "$f" ]; then echo "absent 0 0 0 0 0"; exit 0; fi
if [ -d "$f" ]; then printf 'directory '; exec stat -c '%f %u %g %h %s' -- "$f"; fi
if [ ! -f "$f" ]; then printf 'other '; exec stat -c '%f %u %g %h %s' -- "$f"; fi
printf 'file '; stat -c '%f %u %g %h %s' -- "$f" || exit 5
[ "$max" -gt 0 ] && head -c "$((max + 1))" -- "$f"
exit 0
"""
"""``lstat`` on the plain path: ``kind mode(hex) uid gid links size``, a newline, then the
link's target or the file's first ``max + 1`` bytes."""

_MKDIR_SCRIPT = r"""
p=$1; parent=${p%/*}
if [ -L "${parent:-/}" ]; then echo "$parent is a symlink" >&2; exit 20; fi
if [ -e "$p" ] || [ -L "$p" ]; then echo "$p exists" >&2; exit 17; fi
mkdir -m "$2" -- "$p" || exit 1
if [ "$3" != ":" ]; then chown -h -- "$3" "$p" || exit 1; fi
chmod "$2" -- "$p"
"""

_NO_CHANNEL = ChannelInfo(
    state="disabled", agent_pid=None, python=None, restarts=0, served=0, fallbacks=0, reason=None
)


class Primitives(abc.ABC):
    """The backend's primitives and the routing in front of them (see the module)."""

    config: RuntimeConfig
    _mark: str
    _workdir: str | None
    _orphans: set[int]
    _channel_supervisor: ChannelSupervisor | None
    _channel_built: bool

    @abc.abstractmethod
    def describe(self) -> str:
        """A short human name for messages."""

    # ------------------------------------------------------------------ the channel

    @property
    def channel_info(self) -> ChannelInfo:
        """The state of the persistent channel (``docs/channel.md``); ``disabled`` for a
        runtime without one."""
        channel = self._supervisor
        return _NO_CHANNEL if channel is None else channel.info

    @property
    def _supervisor(self) -> ChannelSupervisor | None:
        """The channel's supervisor, built on first use from :meth:`_channel_hooks`."""
        if not self._channel_built:
            self._channel_built = True
            hooks = self._channel_hooks()
            if hooks is not None:
                self._channel_supervisor = ChannelSupervisor(
                    self._channel_wanted(),
                    self.describe,
                    hooks,
                    stall_timeout=self._channel_stall_timeout(),
                    kill_wait=self._channel_kill_wait(),
                    first_interpreter=self._channel_first_interpreter(),
                )
        return self._channel_supervisor

    def _channel_first_interpreter(self) -> str | None:
        """The absolute interpreter the first agent starts from (``None``: ``sh`` finds
        ``python3``)."""
        return None

    def _require_supervisor(self) -> ChannelSupervisor:
        channel = self._supervisor
        if channel is None:
            raise HostRouteError(f"{self.describe()} has no channel", via="channel")
        return channel

    def _channel_hooks(self) -> ChannelHooks | None:
        """What the channel needs from this backend (``None``: the backend has no channel)."""
        return None

    def _channel_wanted(self) -> bool:
        """Whether the config asks for the channel."""
        return bool(getattr(self.config, "channel", False))

    def _channel_stall_timeout(self) -> float | None:
        """How long a channel may stay silent under a request before the sandbox is probed."""
        return None

    def _channel_kill_wait(self) -> float:
        """How long a kill through the plain path may take after the channel died holding a
        process group."""
        return KILL_WAIT

    def _channel_env(self, request: ExecRequest) -> Mapping[str, str]:
        """Variables the agent adds to a command's environment (the plain path's wrapper
        adds them itself)."""
        return {}

    def _channel_agent_pid(self) -> int | None:
        """The agent's pid in the sandbox (sweeps spare its session), if it runs."""
        channel = self._supervisor
        return None if channel is None else channel.info.agent_pid

    async def _start_channel(self) -> None:
        """Start the agent; a backend calls this inside ``_start`` where it fits. Never
        raises: a sandbox without a channel still works through the plain path."""
        channel = self._supervisor
        if channel is not None:
            await channel.start()

    async def _close_channel(self) -> None:
        if self._channel_supervisor is not None:
            await self._channel_supervisor.close()

    def _close_channel_now(self) -> None:
        """Blocking close of the channel, for :meth:`close_at_exit`."""
        if self._channel_supervisor is not None:
            self._channel_supervisor.close_now()

    def _check_request(self, request: ExecRequest) -> None:
        """Refuse, before either path sees it, what the plain path would refuse in its own
        words (so the channel gives the same error). Raises a ``SandboxError``."""
        return None

    async def _routed_exec(self, request: ExecRequest, sink: OutputSink) -> int:
        """Every command: checked, the kills still owed paid, then the channel, else ``_exec``.

        Raises:
            SandboxResourceError: the command died of SIGKILL and the backend tells that the
                sandbox's memory limit dealt it (:meth:`_memory_kill`).
        """
        self._check_request(request)
        if self._orphans:
            await self._kill_orphans()
        started = time.monotonic()
        channel = self._supervisor
        if channel is None:
            code = await self._exec(request, sink)
        else:
            code = await channel.exec(
                request, sink, lambda: self._exec(request, sink), self._channel_env(request)
            )
        if code == _SIGKILLED:
            # The command has finished: a timeout or cancellation that falls due while the
            # backend looks must not turn its result into a timeout (the check is bounded).
            with anyio.CancelScope(shield=True):
                setting = await self._memory_kill(started)
            if setting is not None:
                raise SandboxResourceError(
                    "memory",
                    list(request.argv),
                    code,
                    bytes(sink.stdout),
                    bytes(sink.stderr),
                    setting=setting or None,
                )
        return code

    async def _memory_kill(self, since: float) -> str | None:
        """After a command died of SIGKILL: whether the sandbox's memory limit killed a
        process since ``time.monotonic()`` was ``since``, as seen from outside the sandbox
        (which the workload cannot forge). The limit's setting (``"64MiB"``, ``""`` if not
        known) if so, else ``None``: the default, so a 137 stays a result. Runs shielded from
        cancellation, so it must bound its own time; never raises."""
        return None

    async def _routed_read(self, path: str, limit: int) -> bytes:
        channel = self._supervisor
        if channel is None:
            return await self._read(path, limit)
        return await channel.read(path, limit, lambda: self._read(path, limit))

    async def _routed_write(self, path: str, data: bytes) -> None:
        channel = self._supervisor
        if channel is None:
            return await self._write(path, data)
        return await channel.write(path, data, lambda: self._write(path, data))

    async def _routed_exists(self, path: str) -> bool:
        channel = self._supervisor
        if channel is None:
            return await self._exists(path)
        return await channel.exists(path, lambda: self._exists(path))

    async def _routed_lstat(self, path: str, limit: int) -> PathInfo:
        channel = self._supervisor
        if channel is None:
            return await self._lstat(path, limit)
        return await channel.lstat(path, limit, lambda: self._lstat(path, limit))

    async def _routed_mkdir(self, path: str, mode: int, uid: int, gid: int) -> None:
        channel = self._supervisor
        if channel is None:
            return await self._mkdir(path, mode, uid, gid)
        return await channel.mkdir(path, mode, uid, gid, lambda: self._mkdir(path, mode, uid, gid))

    async def _routed_remove(self, path: str) -> None:
        channel = self._supervisor
        if channel is None:
            return await self._remove(path)
        return await channel.remove(path, lambda: self._remove(path))

    # ------------------------------------------------------------------ orphaned kills

    def _remember_orphan(self, pgid: int) -> None:
        """A process group whose kill could not be delivered: retried before the next
        command, and before a borrowed sandbox is let go."""
        self._orphans.add(pgid)

    async def _kill_orphans(self) -> None:
        """Retry the kills still owed; those that fail again stay owed (logged)."""
        orphans = frozenset(self._orphans)
        self._orphans.clear()  # in place: a backend may share the set (Backend.owed_kills)
        try:
            with anyio.CancelScope(shield=True):
                await self._kill_orphan_groups(orphans)
        except SandboxError as exc:
            self._orphans.update(orphans)
            log.warning(
                "%s: could not kill process groups %s: %s", self.describe(), sorted(orphans), exc
            )

    async def _kill_orphan_groups(self, pgids: frozenset[int]) -> None:
        """Kill these process groups if their leader still carries this runtime's mark
        (a restarted sandbox reuses pids), through the plain path.

        Raises:
            SandboxError: the kill could not be delivered.
        """
        mark = f"{MARK_VAR}={self._mark}"
        request, sink = self._internal(kill_argv(pgids, mark=mark))
        await self._exec(request, sink)

    def keeps_sandbox(self) -> bool:
        """Whether the sandbox outlives this runtime (attached to, borrowed), so what the
        runtime's commands left must be killed before it is let go."""
        return False

    # ------------------------------------------------------------------ backend primitives

    def _live_cap(self) -> int | None:
        """The ``max_live`` slot this runtime takes before creating its sandbox (``None``:
        none, e.g. a sandbox it only attaches to)."""
        return None

    async def _before_start(self) -> None:
        """Awaited by :meth:`start` outside the shield (cancellable), with the live slot
        held, before ``_start``: pacing, or a creation the backend can cancel itself."""
        return None

    @abc.abstractmethod
    async def _start(self) -> str:
        """Create or attach to the sandbox; return its absolute workdir.

        Runs shielded. Keep a handle on what was created before any further await, so
        that ``_close`` can remove it if readiness then fails.
        """

    @abc.abstractmethod
    async def _close(self) -> None:
        """Destroy (or release) the sandbox. Must cope with a half-finished ``_start``."""

    @abc.abstractmethod
    async def _alive(self) -> bool:
        """Liveness probe: ``False`` for a dead sandbox, never an exception for it."""

    @abc.abstractmethod
    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run the command, feeding output to ``sink``; return the exit code (128+N on signal).

        When cancelled (timeout, output cap, or the caller), kill the whole process tree
        inside the sandbox, shielded, then let the cancellation propagate.
        """

    async def _read(self, path: str, limit: int) -> bytes:
        """Read a file. May return more than ``limit`` bytes (the caller raises), or raise
        ``OutputLimitExceededError`` itself without transferring the content.

        The default is the generic plain path: ``head -c`` through :meth:`_routed_exec`
        (one byte over ``limit``, so the caller can tell a file over it)."""
        request, sink = self._internal(["head", "-c", str(limit + 1), "--", path], limit=limit + 1)
        if await self._routed_exec(request, sink) != 0:
            raise shell_error(path, sink)
        return bytes(sink.stdout)

    async def _write(self, path: str, data: bytes) -> None:
        """Write a file in place (mode kept, a symlink written through), creating parents.

        The default is the generic plain path: ``mkdir -p`` and ``cat`` through
        :meth:`_routed_exec`."""
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        request, sink = self._internal(["sh", "-c", script, "sh", path], stdin=data)
        if await self._routed_exec(request, sink) != 0:
            if b"file exists" in bytes(sink.stderr).lower():  # mkdir -p met a file
                raise error_for_errno(errno.ENOTDIR, path, "a parent is a file")
            raise shell_error(path, sink)

    async def _exists(self, path: str) -> bool:
        request, sink = self._internal(["sh", "-c", 'test -e "$1" || test -L "$1"', "sh", path])
        return await self._routed_exec(request, sink) == 0

    async def _lstat(self, path: str, limit: int) -> PathInfo:
        """The plain path of ``lstat``: the sandbox's ``sh``, ``stat`` and ``head`` (which a
        root policy may have replaced: the channel's answer is preferred)."""
        request, sink = self._internal(
            ["sh", "-c", _LSTAT_SCRIPT, "sh", path, str(limit)], limit=limit + 8192
        )
        code = await self._routed_exec(request, sink)
        header, _, rest = bytes(sink.stdout).partition(b"\n")
        fields = header.decode("utf-8", "replace").split()
        if code != 0 or len(fields) != 6 or fields[0] not in KINDS:
            raise shell_error(path, sink)
        kind, numbers = fields[0], fields[1:]
        try:
            mode, uid, gid, links, size = (int(numbers[0], 16), *map(int, numbers[1:]))
        except ValueError:
            raise shell_error(path, sink) from None
        mode &= 0o7777
        if kind == "symlink":
            target = rest.removesuffix(b"\n").decode("utf-8", "surrogateescape")
            return PathInfo(kind, mode, uid, gid, links, size, target=target)
        return PathInfo(kind, mode, uid, gid, links, size, content=rest if kind == "file" else b"")

    async def _mkdir(self, path: str, mode: int, uid: int, gid: int) -> None:
        owner = f"{uid if uid >= 0 else ''}:{gid if gid >= 0 else ''}"
        argv = ["sh", "-c", _MKDIR_SCRIPT, "sh", path, f"{mode:o}", owner]
        request, sink = self._internal(argv)
        code = await self._routed_exec(request, sink)
        if code == 17:
            raise error_for_errno(errno.EEXIST, path)
        if code != 0:
            raise shell_error(path, sink)

    async def _remove(self, path: str) -> None:
        request, sink = self._internal(["rm", "-rf", "--", path])
        if await self._routed_exec(request, sink) != 0:
            raise shell_error(path, sink)

    async def _upload(self, source: Path, remote: str) -> None:
        if await anyio.Path(source).is_file():
            await self._routed_write(remote, await anyio.Path(source).read_bytes())
            return
        archive = await anyio.to_thread.run_sync(tar_directory, source)
        request, sink = self._internal(
            ["sh", "-c", 'mkdir -p -- "$1" && tar -x -f - -C "$1"', "sh", remote], stdin=archive
        )
        if await self._routed_exec(request, sink) != 0:
            raise shell_error(remote, sink)

    async def _download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        """Copy ``remote`` to ``local`` (a fresh path: the runtime stages downloads); a
        directory goes through :func:`~runtimes._local_files.untar_into`, which treats the
        archive as hostile (``skip_unsafe``: leave unsafe members out; ``links``: see
        :data:`runtimes._extract.Links`)."""
        request, sink = self._internal(
            [
                "sh",
                "-c",
                'if [ -d "$1" ]; then exit 3; elif [ -e "$1" ]; then exit 4; else exit 2; fi',
                "sh",
                remote,
            ]
        )
        kind = await self._routed_exec(request, sink)
        if kind == 2:
            raise SandboxFileNotFoundError(remote)
        if kind == 4:
            data = await self._routed_read(remote, self.config.read_limit)
            await anyio.to_thread.run_sync(write_local_file, local, data)
            return
        request, sink = self._internal(
            ["tar", "-c", "-f", "-", "-C", remote, "."], limit=self.config.read_limit
        )
        code = await self._routed_exec(request, sink)
        if sink.overflowed:
            raise OutputLimitExceededError(
                f"download of {remote!r}", self.config.read_limit, path=remote
            )
        if code != 0:
            raise shell_error(remote, sink)
        await anyio.to_thread.run_sync(
            lambda: untar_into(bytes(sink.stdout), local, skip_unsafe=skip_unsafe, links=links)
        )

    def _internal(
        self, argv: list[str], *, stdin: bytes | None = None, limit: int = 1 << 20
    ) -> tuple[ExecRequest, OutputSink]:
        """An exec request for the runtime's own bookkeeping commands, in the workdir."""
        return bookkeeping_request(argv, cwd=self._workdir or "/", stdin=stdin, limit=limit)
