"""The :class:`Runtime` contract: one async API over every kind of sandbox.

Lifecycle (``start`` / ``close``) is kept apart from the operations on a live sandbox
(``exec``, ``read``, ``write``, ...). The public methods here validate arguments,
resolve paths, enforce timeouts and caps, keep state, and route calls through the
sandbox's channel when it has one (:mod:`runtimes.channel`: routing, fallback, restart
and dead-sandbox probing all happen here, not in backends). A backend implements the
small ``_``-prefixed primitives, the *plain* paths that work without the channel, and
never repeats that work.

Writing a backend: subclass :class:`Runtime`, set ``config_model``, implement
``_start``, ``_close``, ``_alive``, ``_exec``, ``_read`` and ``_write``. The defaults of
``_exists``, ``_remove``, ``_upload`` and ``_download`` go through ``_exec`` with POSIX
tools (``test``, ``rm``, ``tar``); override them where the transport does better. A
backend that can run the channel's agent returns its :class:`ChannelHooks` from
``_channel_hooks`` (the transport to run the agent over, and how to kill, probe and
verify through the plain path) and calls ``_start_channel`` inside ``_start``. Then run
the conformance suite (:mod:`runtimes.testing`) against it.
"""

from __future__ import annotations

import logging
import posixpath
import uuid
from collections.abc import AsyncIterable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self, TypeVar

import anyio
import anyio.lowlevel

from . import lifecycle, limits
from . import snapshot as snapshots
from ._extract import LINKS, Links
from ._local_files import shell_error, write_local_file
from ._staging import download_staged
from .arguments import PathLike, check_local_path, exec_request, resolve_sandbox_path, text_bytes
from .channel import ChannelSupervisor
from .channel.agent.wire import PathInfo
from .config import RuntimeConfig
from .errors import (
    HostRouteError,
    OutputLimitExceededError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxUnavailableError,
)
from .keep import Keeping, announce_kept
from .lifecycle import State, live_runtimes
from .listing import Listing
from .machinery import run_machinery
from .models import ExecRequest, ExecResult, OutputSink, SandboxInfo, Stream
from .policy import DEFAULT_JUDGE_USER, JUDGE_UID, PolicyAccount
from .primitives import Primitives
from .processes import (
    BACKGROUND_BUFFER,
    UNCAPPED,
    BackgroundProcess,
    background_processes,
    close_processes,
    run_command,
    start_background,
)
from .routes import HostRoute, RouteKind, channel_route, choose_route
from .shell.session import ShellSession, close_sessions
from .snapshot import SandboxSnapshot, SnapshotHolds, SnapshotUnsupportedError, snapshot_labels
from .sweep import CLOCK_TICK_SCRIPT, MARK_VAR, SWEEP_SCRIPT, sweep_argv

log = logging.getLogger("runtimes")

T = TypeVar("T")

NEVER_STARTED_HINT = (
    ": open it first, with `async with runtime as rt:` or `await runtime.start()` (factories "
    "and fixtures such as sandbox_factory and attached_container_runtime hand out unstarted "
    "runtimes)"
)
"""What an operation on a runtime that was never started says to do."""

_write_local_file = write_local_file  # the name backends imported before the split


class Runtime(Primitives, Keeping, Listing):
    """One sandbox, as an async context manager.

    ``async with SomeRuntime(config) as rt:`` creates the sandbox, and leaving the block
    destroys it (or, for runtimes that borrow an existing sandbox, lets it go).

    Every method documents the errors it raises. Beyond those listed, any method can
    raise :class:`~runtimes.errors.SandboxUnavailableError` when the sandbox is dead,
    stopped, removed or closed, and :class:`~runtimes.errors.SandboxTransportError` when
    the channel to it failed (after bounded retries for idempotent calls). Nothing a
    runtime raises is a bare ``Exception``: anything unexpected from a backend surfaces
    as :class:`~runtimes.errors.SandboxError` with the original chained.
    """

    name: ClassVar[str] = "runtime"
    config_model: ClassVar[type[RuntimeConfig]] = RuntimeConfig

    def __init__(self, config: RuntimeConfig):
        if not isinstance(config, self.config_model):
            raise SandboxInvalidArgumentError(
                f"{type(self).__name__} needs a {self.config_model.__name__}, "
                f"got {type(config).__name__}"
            )
        self.config = config
        self._check_keep()
        self._state = State.NEW
        self._workdir: str | None = None
        self._mark = uuid.uuid4().hex
        self._policy_account = PolicyAccount()
        self._judge_account = PolicyAccount()
        self._holds_slot = False
        self._orphans: set[int] = set()
        """Process groups whose kill could not be delivered (the sandbox was paused, the
        transport failed): killed before the next command, or before a borrowed sandbox
        is let go."""
        self._channel: ChannelSupervisor | None = None
        self._channel_built = False
        self._snapshot_source: SandboxSnapshot | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        """Create (or attach to) the sandbox and wait until it is ready.

        A runtime that creates its sandbox first waits (cancellably) for a slot under its
        config's ``max_live`` (process-wide per backend), then for :meth:`_before_start`
        (a backend's pacing). Creation is then shielded from cancellation until the
        backend holds a handle on what it created; if the caller was cancelled meanwhile,
        the sandbox is closed again before the cancellation propagates, so nothing leaks.

        Raises:
            ProvisioningError: the sandbox could not be created (image missing, quota,
                authentication, unreachable host).
            SandboxUnavailableError: the runtime was already started or closed.
        """
        if self._state != State.NEW:
            raise SandboxUnavailableError(
                f"{self.describe()} was already started ({self._state.value})"
            )
        await self._take_live_slot()
        try:
            await self._before_start()
        except BaseException:
            self._release_live_slot()
            raise
        if self.closed:  # closed while it waited: discard what _before_start made
            with anyio.CancelScope(shield=True):
                await self._discard_early_start()
            raise SandboxUnavailableError(
                f"{self.describe()} was already started ({self._state.value})"
            )
        self._state = State.STARTING
        try:
            with anyio.CancelScope(shield=True):
                self._workdir = await self._start()
                self._inherit_policy_account()
                self._state = State.OPEN
                self._keep = self.config.keep
                lifecycle.hold(self)
            await anyio.lowlevel.checkpoint()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._close_quietly()
            raise
        return self

    async def _discard_early_start(self) -> None:
        """``close()`` ran while :meth:`_before_start` waited or created: it skipped
        ``_close`` (nothing had started), so whatever ``_before_start`` made goes now."""
        self._release_live_slot()
        try:
            await self._close()
        except Exception:
            log.warning(
                "closing %s after a start cut short by close() also failed",
                self.describe(),
                exc_info=True,
            )

    async def _take_live_slot(self) -> None:
        limit = self._live_cap()
        if limit is not None:
            await limits.live_cap(self.name).acquire(limit)
            self._holds_slot = True

    def _release_live_slot(self) -> None:
        if self._holds_slot:
            self._holds_slot = False
            limits.live_cap(self.name).release()

    async def close(self) -> None:
        """Destroy the sandbox (release a borrowed one, leave a ``keep=True`` one: :mod:`.keep`).

        Returns once nothing in the sandbox runs any more (sessions ended, channel
        closed, processes killed). A backend may finish the removal in the background
        (Docker does, when its root agent killed every process: :mod:`.reaper`);
        :func:`runtimes.drain_removals` waits for it. Idempotent and shielded: safe to
        call twice, from a cancelled task, or on a runtime that never started.

        Raises:
            SandboxTransportError: the backend could not confirm the sandbox is gone;
                the sandbox is left to ``vf-sandbox cleanup``.
        """
        with anyio.CancelScope(shield=True):
            if self._state in (State.CLOSED, State.CLOSING):
                return
            was = self._state
            self._state = State.CLOSING
            lifecycle.release(self)
            try:
                if was == State.OPEN:
                    await close_sessions(self)  # each ends its shell over its own exec
                    # Background runs: each kills its tree, unless the sandbox is kept.
                    await close_processes(self, keep=self._keep or self._keeps_sandbox())
                if was in (State.STARTING, State.OPEN):
                    await self._close_channel()
                    if self._orphans and (self._keeps_sandbox() or self._keep):
                        await self._kill_orphans()
                    await self._close()
            finally:
                self._mark_closed()

    def _mark_closed(self) -> None:
        """The one way to mark this runtime closed: out of the exit registry, its live
        slot given back. ``close()`` ends with it; a backend's synchronous
        :meth:`_close_at_exit` calls it once the sandbox is gone."""
        self._state = State.CLOSED
        lifecycle.release(self)
        self._release_live_slot()
        if self._keep:
            self._keep = False  # announced once
            announce_kept(self)

    async def _close_quietly(self) -> None:
        try:
            await self.close()
        except Exception:
            log.warning(
                "closing %s after a failed start also failed", self.describe(), exc_info=True
            )

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def workdir(self) -> str:
        """The sandbox's absolute working directory (the default ``cwd``)."""
        self._check_open()
        assert self._workdir is not None
        return self._workdir

    @property
    def closed(self) -> bool:
        return self._state == State.CLOSED

    @property
    def state(self) -> State:
        """Where this runtime is in its life (:class:`~runtimes.lifecycle.State`)."""
        return self._state

    def describe(self) -> str:
        """A short human name for messages: backend plus sandbox id."""
        return f"{self.name} sandbox {self.sandbox_id or '(not started)'}"

    @property
    def sandbox_id(self) -> str | None:
        """The backend's id for this sandbox (container id, remote dir...), once started."""
        return None

    @property
    def policy_user(self) -> str | None:
        """The unprivileged user a rollout's policy runs its commands as (``exec(user=)``),
        apart from the sandbox's default user, which the host's own machinery uses (judge
        inputs, judges, harness installs, the channel agent). The policy cannot write to,
        signal or ptrace what runs as the default user.

        ``None`` when the backend keeps no separate policy identity: the policy then runs
        as the default user (``docs/security.md`` says what still holds).
        """
        return None

    @property
    def judge_user(self) -> str | None:
        """The account judges run their commands as (``vf-judge``), apart from both the
        policy's account and the machinery's default user: what a judge runs — the
        policy's programs included — can neither replace the sandbox's system files (as
        root could) nor act as the policy. It exists where the policy has an account of its
        own in a sandbox whose accounts are the runtime's to make (Docker and Modal unless
        the root filesystem is read-only); ``None`` elsewhere (judges then run as the
        default user, as before). Made on first use, handed no directory.
        """
        if self.policy_user is None or not self._makes_accounts():
            return None
        return DEFAULT_JUDGE_USER

    def _makes_accounts(self) -> bool:
        """Whether accounts (the judges') may be added to this sandbox's ``/etc/passwd``."""
        return self._creates_policy_user

    async def system_tampered(self) -> str | None:
        """Why this sandbox's system can no longer be trusted to run a judge's commands —
        code every program would load (``/etc/ld.so.preload``) or a shell the commands run
        through, changed since the sandbox started from its image — or ``None``: nothing
        seen, or a backend that cannot tell without running the sandbox's own programs
        (only Docker reads the engine's diff). Judges placed in a rollout's sandbox (or a
        fork of it) are refused when it says why.

        Raises:
            SandboxError: the sandbox failed.
        """
        return None

    async def prepare_judge_user(self) -> str | None:
        """Make the judges' account now (it is made on first use otherwise); return
        :attr:`judge_user`.

        Raises:
            ProvisioningError: the account could not be made.
        """
        if self.judge_user is not None:
            await run_machinery(self, ["true"], user=self.judge_user, timeout=60)
        return self.judge_user

    async def prepare_policy_user(self) -> str | None:
        """Make the policy's account now (where it is made on first use) and hand it the
        workdir, as its first command would; return :attr:`policy_user`. Lets the host
        give the account something by name (``chown``) before the policy runs.

        Raises:
            ProvisioningError: the account could not be made.
        """
        if self.policy_user is not None:
            await run_machinery(self, ["true"], user=self.policy_user, timeout=60)
        return self.policy_user

    async def alive(self) -> bool:
        """Whether the sandbox answers. Never raises for a dead or closed sandbox.

        Raises:
            SandboxTransportError: liveness cannot be decided because the channel failed.
        """
        if self._state != State.OPEN:
            return False
        with self._guard("alive"):
            return await self._alive()

    # ------------------------------------------------------------------ operations

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | AsyncIterable[bytes] | None = None,
        user: str | None = None,
        output_limit: int | None = None,
        on_output: Callable[[Stream, bytes], object] | None = None,
        keep_output: bool = True,
        check: bool = False,
    ) -> ExecResult:
        """Run ``argv`` (never a shell string) inside the sandbox and wait for it.

        Returns when the command (the process it started) exits: output its background
        processes go on writing to the pipes they inherited is taken for
        :data:`~runtimes.processes.EXIT_GRACE` (0.2 s) more, then read and discarded; they
        keep running until they end, :meth:`stop_processes` or :meth:`close`
        (``docs/processes.md``). :meth:`spawn` starts a command without waiting.

        Args:
            argv: program and arguments. Callers who want a shell pass ``["sh", "-c", ...]``.
            timeout: seconds; on expiry (while the command runs) the whole process tree is
                killed.
            cwd: absolute, or relative to the workdir; defaults to the workdir.
            env: variables added to the sandbox's environment for this call only.
            stdin: bytes (or text, encoded as UTF-8) fed to the process, then closed; or an
                async iterable of bytes, written chunk by chunk as it yields (never read ahead
                of what the process took: a slow reader slows the iterable), closed when it
                ends. The command may end first: the iterable is then left unfinished. An
                exception it raises kills the tree and propagates. With ``on_output`` this
                answers an interactive program line by line (``docs/streaming.md``).
            user: run as this user (backends that cannot switch raise ``SandboxPermissionError``).
            output_limit: cap on stdout + stderr together, bytes (default: the config's).
            on_output: called on the event loop with ``("stdout" | "stderr", chunk)`` as
                output arrives, in order within each stream; the chunks are exactly the
                bytes the result holds. It runs inline: a slow callback slows the reader,
                never grows memory. An exception it raises kills the tree and propagates.
            keep_output: ``False`` passes output to ``on_output`` without keeping it: the
                result's ``stdout``/``stderr`` are empty and a stream of any length costs
                constant host memory; ``output_limit`` still caps the bytes streamed.
            check: raise :class:`CommandFailedError` (the result attached) when the
                command exits non-zero, like ``subprocess.run(check=True)``.

        Returns:
            The exit code (``128 + N`` for a death by signal N) and byte-exact output.
            A non-zero exit is a result, not an error (unless ``check``).

        Raises:
            CommandFailedError: ``check`` is set and the command exited non-zero.
            ProvisioningError: ``user`` is :attr:`policy_user` and its account could not be
                made or found at its first use.
            ExecTimeoutError: ``timeout`` expired; the tree was killed; partial output attached.
            OutputLimitExceededError: output went over the cap; the tree was killed;
                the output kept so far is attached.
            SandboxResourceError: the sandbox's memory limit killed the command (where the
                backend can tell: docs/resources.md); the output so far is attached.
            SandboxFileNotFoundError: the program or ``cwd`` does not exist.
            SandboxPermissionError: the program is not executable, or ``user`` is refused.
            SandboxNotADirectoryError: ``cwd`` is not a directory.
            SandboxInvalidArgumentError: empty argv, NUL bytes, bad env names, argv too large,
                text (argv, env, ``stdin``) with a lone surrogate that stands for no byte.

        Cancelling the awaiting task kills the process tree too, then lets the
        cancellation propagate.
        """
        self._check_open()
        request = self._exec_request(argv, timeout, cwd, env, stdin, user, output_limit)
        await self._ensure_account(request)
        sink = OutputSink(request.output_limit, on_output=on_output, keep=keep_output)
        return await run_command(self, request, sink, timeout, self._guarded_exec, check=check)

    async def _ensure_account(self, request: ExecRequest) -> None:
        """Make or find the policy's or the judge's account at its first use."""
        if request.user is not None and request.user == self.policy_user:
            await self._policy_account.ensure(
                request.user,
                self._run_as_machinery,
                self.workdir,
                create=self._creates_policy_user,
                through=self._policy_passage(),
            )
        elif request.user is not None and request.user == self.judge_user:
            await self._judge_account.ensure(
                request.user,
                self._run_as_machinery,
                "/",
                create=self._creates_policy_user,
                through=self._policy_passage(),
                uid=JUDGE_UID,
            )

    async def _guarded_exec(self, request: ExecRequest, sink: OutputSink) -> int:
        with self._guard("exec", request.argv[0]):
            return await self._routed_exec(request, sink)

    async def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | AsyncIterable[bytes] | None = None,
        user: str | None = None,
        on_output: Callable[[Stream, bytes], object] | None = None,
        buffer: int = BACKGROUND_BUFFER,
    ) -> BackgroundProcess:
        """Start ``argv`` in the background and return its handle at once:
        ``proc.pid``, ``await proc.wait(timeout=)``, ``await proc.kill()``,
        ``async for stream, chunk in proc`` (``docs/processes.md``).

        Args:
            argv, cwd, env, stdin, user: as for :meth:`exec`.
            on_output: called with ``("stdout" | "stderr", chunk)`` as output arrives, as
                for :meth:`exec`; an exception it raises kills the tree (``wait`` re-raises).
            buffer: bytes kept of each stream's tail (for ``wait``'s result) and queued for
                ``async for`` (the oldest dropped beyond it): host memory stays bounded
                however much the process writes. Its output is never capped.

        Raises:
            SandboxInvalidArgumentError: as for :meth:`exec` (checked before it starts), or
                ``buffer`` is not positive.
            ProvisioningError: ``user`` is :attr:`policy_user` and its account could not be
                made or found.

        A program or ``cwd`` that does not exist is reported by ``wait()`` (the typed
        errors of :meth:`exec`). :meth:`processes` lists the handles still running;
        :meth:`stop_processes` and :meth:`close` end them.
        """
        self._check_open()
        if buffer <= 0:
            raise SandboxInvalidArgumentError(f"buffer must be > 0, got {buffer}")
        request = self._exec_request(argv, None, cwd, env, stdin, user, UNCAPPED)
        await self._ensure_account(request)
        return start_background(
            self, request, self._guarded_exec, on_output=on_output, buffer=buffer
        )

    def processes(self) -> list[BackgroundProcess]:
        """The :meth:`spawn` handles whose command is still running."""
        return background_processes(self)

    def shell(
        self,
        *,
        pty: bool = False,
        size: tuple[int, int] = (24, 80),
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        interrupt_grace: float = 2.0,
        start_timeout: float = 30.0,
    ) -> ShellSession:
        """A persistent ``bash`` in the sandbox, to use as ``async with rt.shell() as sh:``;
        ``await sh.run("cd src && make", timeout=60)`` returns an :class:`ExecResult`, and
        ``cd``, variables, functions and activated venvs persist from one ``run`` to the next.

        Args:
            pty: run the shell on a terminal (programs that need one: ``top``, prompts,
                colour); output then comes back merged in ``stdout`` as the terminal wrote
                it (``\\r\\n`` line ends). Without it, stdout and stderr stay apart and
                commands read an empty stdin.
            size: the terminal's ``(rows, columns)`` (``pty`` only; ``sh.resize`` changes it).
            cwd, env, user: where the shell starts, variables it starts with, and who runs
                it, as for :meth:`exec`.
            interrupt_grace: seconds between the ``SIGINT`` that interrupts a timed-out or
                cancelled command and the ``SIGKILL`` that follows if it is still running.
            start_timeout: seconds for the shell to be ready.

        The session runs over one long ``exec`` (through the channel where the sandbox has
        one), so several sessions may run side by side; closing the runtime closes them.
        ``docs/shell.md`` has the details and the trust model.

        Raises (on entering the block):
            ShellSessionError: the shell could not start (no ``bash`` or ``python3`` in the
                sandbox, or it did not become ready in ``start_timeout``).
            SandboxInvalidArgumentError: a bad ``cwd``, ``env`` or ``size``.
        """
        self._check_open()
        return ShellSession(
            self,
            pty=pty,
            size=size,
            cwd=cwd,
            env=env,
            user=user,
            interrupt_grace=interrupt_grace,
            start_timeout=start_timeout,
        )

    async def read(self, path: PathLike, *, max_bytes: int | None = None) -> bytes:
        """The exact bytes of a file.

        Raises:
            SandboxFileNotFoundError: no such file.
            SandboxIsADirectoryError: ``path`` is a directory.
            SandboxNotADirectoryError: a parent of ``path`` is not a directory.
            SandboxPermissionError: not readable.
            OutputLimitExceededError: the file is larger than ``max_bytes`` (default:
                the config's ``read_limit``); nothing is returned.
            SandboxInvalidArgumentError: a malformed path (NUL byte, empty).
        """
        self._check_open()
        resolved = self.resolve_path(path)
        limit = self.config.read_limit if max_bytes is None else max_bytes
        if limit < 0:
            raise SandboxInvalidArgumentError(f"max_bytes must be >= 0, got {limit}")
        with self._guard("read", resolved):
            data = await self._routed_read(resolved, limit)
        if len(data) > limit:
            raise OutputLimitExceededError(f"read of {resolved!r}", limit, path=resolved)
        return data

    async def write(self, path: PathLike, data: bytes | str) -> None:
        """Write ``data`` to a file, creating parent directories, replacing any old content.

        Raises:
            SandboxIsADirectoryError: ``path`` is a directory.
            SandboxNotADirectoryError: a parent of ``path`` is a file.
            SandboxPermissionError: not writable.
            SandboxInvalidArgumentError: a malformed path (NUL byte, empty).
        """
        self._check_open()
        resolved = self.resolve_path(path)
        payload = text_bytes(data, "data") if isinstance(data, str) else bytes(data)
        with self._guard("write", resolved):
            await self._routed_write(resolved, payload)

    async def exists(self, path: PathLike) -> bool:
        """Whether anything (file, directory, symlink, even a dangling one) is at ``path``.

        A missing parent is ``False``, not an error.

        Raises:
            SandboxPermissionError: a parent directory cannot be searched.
            SandboxInvalidArgumentError: a malformed path.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        with self._guard("exists", resolved):
            return await self._routed_exists(resolved)

    async def lstat(self, path: PathLike, *, content_limit: int = 0) -> PathInfo:
        """What is at ``path``, never following a link there: its kind (``absent``,
        ``file``, ``directory``, ``symlink``, ``other``), mode bits, owner, link count,
        size, a link's target, and a regular file's first ``content_limit + 1`` bytes
        (read without following a link). Served by the channel agent where there is one,
        so a root policy that replaced ``sh`` or ``stat`` cannot answer for it.

        Raises:
            SandboxPermissionError: a parent cannot be searched, or the file not read.
            SandboxInvalidArgumentError: a malformed path, or a negative limit.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        if content_limit < 0:
            raise SandboxInvalidArgumentError(f"content_limit must be >= 0, got {content_limit}")
        with self._guard("lstat", resolved):
            return await self._routed_lstat(resolved, content_limit)

    async def mkdir(
        self, path: PathLike, *, mode: int = 0o755, uid: int = -1, gid: int = -1
    ) -> None:
        """Make one fresh directory at ``path`` with exactly ``mode`` (no umask) and owner
        ``uid``/``gid`` (-1: the sandbox's default user's), inside a parent that is a real
        directory (a link there is refused). Nothing may be at ``path`` yet.

        Raises:
            SandboxFileExistsError: something (a dangling link included) is at ``path``.
            SandboxError: its parent is a link or missing (typed by errno where it has a
                class: ``SandboxNotADirectoryError``, ``SandboxFileNotFoundError``).
            SandboxPermissionError: not allowed.
            SandboxInvalidArgumentError: a malformed path.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        with self._guard("mkdir", resolved):
            await self._routed_mkdir(resolved, mode, uid, gid)

    async def remove(self, path: PathLike, *, missing_ok: bool = False) -> None:
        """Remove a file, a symlink (not its target) or a whole directory tree.

        Raises:
            SandboxFileNotFoundError: nothing at ``path`` and not ``missing_ok``.
            SandboxPermissionError: not removable.
            SandboxInvalidArgumentError: a malformed path, or ``/``, the workdir or a
                parent of the workdir.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        target = posixpath.normpath(resolved)
        workdir = posixpath.normpath(self.workdir)
        if target == "/":
            raise SandboxInvalidArgumentError("refusing to remove '/'")
        if target == workdir or workdir.startswith(target + "/"):
            raise SandboxInvalidArgumentError(
                f"refusing to remove the workdir {self.workdir!r} or a parent of it ({resolved!r})"
            )
        with self._guard("remove", resolved):
            if not await self._routed_exists(resolved):
                if missing_ok:
                    return
                raise SandboxFileNotFoundError(resolved)
            await self._routed_remove(resolved)

    async def upload(self, local: PathLike, remote: PathLike) -> None:
        """Copy a local file or directory tree to ``remote`` (created, parents included).

        A directory's contents land inside ``remote``; existing files are replaced. A file
        uploaded to a ``remote`` ending in ``/`` lands inside that directory under its own
        name (``upload("f.txt", "d/")`` writes ``d/f.txt``, creating ``d``), as ``cp f d/``.
        A failed upload removes the directories it created (``d``, the ``remote`` of a
        directory upload, and their missing parents).

        Raises:
            FileNotFoundError: the local source does not exist (a host-side error).
            SandboxInvalidArgumentError: a NUL byte in ``local``, a malformed ``remote``.
            SandboxNotADirectoryError / SandboxIsADirectoryError: kinds clash at ``remote``.
            SandboxPermissionError: not writable.
        """
        self._check_open()
        check_local_path(local)
        source = Path(local)
        if not await anyio.Path(source).exists():
            raise FileNotFoundError(
                2, "No such file or directory (local upload source)", str(local)
            )
        resolved = self.resolve_path(remote)
        is_file = not await anyio.Path(source).is_dir()
        if is_file and isinstance(remote, str) and remote.endswith("/"):
            resolved = self.resolve_path(posixpath.join(resolved, source.name))
        # the directory this upload may create: the file's parent, or the tree's root
        made = posixpath.dirname(resolved) if is_file else resolved
        with self._guard("upload", resolved):
            created = await self._missing_top(made)
            try:
                await self._upload(source, resolved)
            except BaseException:
                if created is not None:
                    with anyio.CancelScope(shield=True):
                        try:
                            await self._routed_remove(created)
                        except SandboxError as exc:
                            log.warning("upload: could not remove %r: %s", created, exc)
                raise

    async def _missing_top(self, path: str) -> str | None:
        """The topmost of ``path`` and its parents that is missing, or ``None`` if
        ``path`` exists."""
        top = None
        current = posixpath.normpath(path)
        while current != "/" and not await self._routed_exists(current):
            top, current = current, posixpath.dirname(current)
        return top

    async def download(
        self,
        remote: PathLike,
        local: PathLike,
        *,
        skip_unsafe: bool = False,
        links: Links = "contained",
    ) -> None:
        """Copy a sandbox file or directory tree to ``local`` (parents created).

        All or nothing: the download lands in a fresh staging directory next to ``local``
        and is moved into place only once complete, so a failed download leaves ``local``
        exactly as it was (nothing created, not even its parents; nothing overwritten). A
        directory's contents land inside ``local`` (merged into an existing directory). With
        ``links="keep"`` every symlink is kept as a link, whatever it points to (a venv's
        ``bin/python -> /usr/bin/python3``), as ``docker cp`` does; none is ever followed
        on the host. The sandbox is treated as hostile:
        its tree is unpacked on the host without ever following a symlink, and nothing
        outside ``local`` is created or changed. A member that would leave ``local`` (an
        absolute or ``..`` name, a path through a symlink, a symlink that is absolute or
        resolves outside ``local``, a hard link to anything this download did not
        extract, a device or FIFO) raises :class:`UnsafeArchiveMemberError` naming it;
        with ``skip_unsafe=True`` such members are left out instead, each logged as a
        warning on the ``runtimes`` logger, and the rest is downloaded. (The subprocess
        backend copies its own host tree and keeps symlinks as links, never following
        them; it is not a boundary.) docs/files.md has the details.

        Raises:
            SandboxFileNotFoundError: nothing at ``remote``.
            SandboxPermissionError: not readable.
            OutputLimitExceededError: the tree is larger than the config's ``read_limit``.
            UnsafeArchiveMemberError: an unsafe member (above; the message names the option
                that would take it), more members or deeper paths than the extractor allows
                (the member count bound is never skipped), or a downloaded directory that
                meets a link or a file inside an existing ``local``.
            SandboxInvalidArgumentError: a NUL byte in ``local``, a malformed ``remote``, an
                unknown ``links``, or a directory downloaded onto a file (or the reverse).
            SandboxError: the sandbox's archive of the tree is malformed.
        """
        self._check_open()
        check_local_path(local)
        if links not in LINKS:
            raise SandboxInvalidArgumentError(f"links must be one of {LINKS}, got {links!r}")
        resolved = self.resolve_path(remote)
        with self._guard("download", resolved):
            await download_staged(
                Path(local),
                lambda staged: self._download(
                    resolved, staged, skip_unsafe=skip_unsafe, links=links
                ),
            )

    # ------------------------------------------------------------------ routes to the host

    def host_routes(self) -> tuple[RouteKind, ...]:
        """The routes by which a process in this sandbox can reach a port on the host,
        the default first (see :mod:`runtimes.routes`). Empty: none."""
        return self._all_host_routes() if self._state == State.OPEN else ()

    async def plan_host_route(self, via: str | None = None) -> tuple[RouteKind, str]:
        """The route :meth:`expose_host` will take (``via``, or the default) and the host
        address the service must listen on for it (``127.0.0.1`` except for ``gateway``).

        Raises:
            HostRouteError: the sandbox has no such route (or none); the message says what
                to configure.
            SandboxUnavailableError: the sandbox is closed.
            SandboxError: probing the sandbox failed.
        """
        self._check_open()
        kind = choose_route(self._all_host_routes(), via, self.describe(), self._route_hint())
        with self._guard("planning a route to the host"):
            return kind, await self._host_bind_address(kind)

    async def expose_host(self, port: int, *, via: str | None = None) -> HostRoute:
        """Make ``port`` of the host (listening on :meth:`plan_host_route`'s address)
        reachable from inside the sandbox; close the returned route when done (the runtime's
        ``close()`` ends it too).

        Raises:
            HostRouteError: no such route, or it could not be made (the channel is down,
                the agent could not listen, the forward was refused).
            SandboxInvalidArgumentError: ``port`` is not a TCP port.
            SandboxUnavailableError: the sandbox is closed or stopped answering.
        """
        self._check_open()
        if not 0 < port < 65536:
            raise SandboxInvalidArgumentError(f"not a TCP port: {port}")
        kind = choose_route(self._all_host_routes(), via, self.describe(), self._route_hint())
        with self._guard("exposing a host port"):
            if kind == "channel":
                return await channel_route(self._require_channel(), port)
            return await self._expose_host(port, kind)

    def _all_host_routes(self) -> tuple[RouteKind, ...]:
        """The backend's routes with the channel's relay: after ``loopback`` (no hop at
        all), before the rest (it needs no network)."""
        own = self._host_routes()
        channel = self._supervisor
        if channel is None or not channel.can_relay:
            return own
        direct = tuple(kind for kind in own if kind == "loopback")
        return (*direct, "channel", *(kind for kind in own if kind != "loopback"))

    def _host_routes(self) -> tuple[RouteKind, ...]:
        """The routes this backend makes itself, the default first (the base adds the
        channel's relay)."""
        return ()

    def _route_hint(self) -> str:
        """What to configure for a route (for :class:`HostRouteError` messages)."""
        return ""

    async def _host_bind_address(self, via: RouteKind) -> str:
        """Where a host service must listen for ``via`` (one of :meth:`_host_routes`)."""
        return "127.0.0.1"

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        """Make the route (``via`` is one of :meth:`_host_routes`, never ``channel``)."""
        raise HostRouteError(f"{self.describe()} cannot make a {via!r} route", via=via)

    async def stop_processes(self) -> int:
        """Kill every process this runtime's commands started that is still running;
        return how many.

        Background processes a command left behind (``nohup server &``) are found by the
        ``VF_SANDBOX_RUNTIME`` mark in their environment, which every ``exec`` sets; backends
        that own their sandbox find them however they detached (``setsid``, ``env -i``).
        Matches are frozen (``SIGSTOP``) until none is left running, then killed, so a fork
        loop cannot outrun the sweep. The placement layer calls this before a judge enters a
        rollout's sandbox, between its commands and before its verdict is read, so nothing
        the policy left can watch or tamper with the judge. ``docs/security.md`` says, per
        backend, which leftovers each sweep reaches.

        Raises:
            SandboxUnavailableError: the sandbox is closed or dead.
            SandboxError: the sweep itself failed (its stderr attached).
        """
        self._check_open()
        request, sink = self._internal(self._sweep_argv())
        with self._guard("stop_processes"):
            code = await self._routed_exec(request, sink)
        return self._swept(code, sink)

    def _sweep_argv(self) -> list[str]:
        """The sweep :meth:`stop_processes` runs: by default, processes carrying the mark."""
        return sweep_argv("mark", f"{MARK_VAR}={self._mark}")

    def _swept(self, code: int, sink: OutputSink) -> int:
        """How many processes a sweep killed, from its output.

        Raises:
            SandboxError: the sweep failed.
        """
        text = bytes(sink.stdout).decode("utf-8", "replace").strip()
        if code != 0 or not text.isdigit():
            detail = bytes(sink.stderr).decode("utf-8", "replace").strip()
            raise SandboxError(f"{self.describe()}: could not stop processes: {detail}")
        return int(text)

    # ------------------------------------------------------------------ snapshots

    snapshot_holds: ClassVar[SnapshotHolds | None] = None
    """What this backend's snapshots hold (``"filesystem"`` or ``"workdir"``); ``None``: it
    cannot take snapshots (:meth:`snapshot` and ``open_runtime(snapshot=)`` refuse)."""

    async def snapshot(
        self, *, keep: bool = False, labels: Mapping[str, str] | None = None
    ) -> SandboxSnapshot:
        """Snapshot the sandbox's files (``docs/snapshots.md``); open a fork of it with
        ``open_runtime(config, snapshot=snap)``. Processes are never part of it; the sandbox
        goes on running (Docker pauses it while the engine commits).

        The snapshot carries this session's labels, the config's and ``labels``. Unless
        ``keep``, it is removed at interpreter exit (and by ``vf-sandbox cleanup`` once this
        process is gone); a kept one stays until :func:`runtimes.snapshot.remove_snapshot`
        or ``vf-sandbox cleanup --kept``. Taking it is shielded from cancellation; a
        cancelled caller's snapshot is removed again before the cancellation propagates.

        Raises:
            SnapshotUnsupportedError: this backend cannot take snapshots.
            SandboxUnavailableError: the runtime is closed (or never started), or the sandbox
                is gone.
            SandboxTransportError: the backend could not be reached.
            SandboxError: the backend failed to take it (the cause attached): a workdir the
                copy cannot read (subprocess, SSH), an engine that refused to commit.
        """
        if self.snapshot_holds is None:
            raise SnapshotUnsupportedError(f"the {self.name} backend cannot take snapshots")
        self._check_open()
        tags = snapshot_labels(
            self.name,
            {**self.config.labels, **(labels or {})},
            keep=keep,
            source=str(self.sandbox_id),
            workdir=self.workdir,
            policy_user=self._prepared_policy_user(),
            python=self._channel.interpreter if self._channel is not None else None,
        )
        with anyio.CancelScope(shield=True), self._guard("snapshot"):
            taken = await self._snapshot(tags)
            if not keep:
                snapshots.hold(type(self), self.config, taken)
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._remove_quietly(taken)
            raise
        return taken

    async def _remove_quietly(self, snapshot: SandboxSnapshot) -> None:
        try:
            await snapshots.remove_snapshot(snapshot, self.config)
        except Exception:
            log.warning("removing %s again also failed", snapshot.describe(), exc_info=True)

    def fork_from(self, snapshot: SandboxSnapshot) -> Self:
        """Make this runtime, not yet started, start from ``snapshot``: its sandbox's files
        begin as the snapshot's (``open_runtime(config, snapshot=)`` calls this). Whether
        the snapshot still exists is found out by :meth:`start`, which raises
        :class:`~runtimes.snapshot.SnapshotNotFoundError` if it does not.

        Raises:
            SnapshotUnsupportedError: this backend cannot open sandboxes from snapshots.
            SandboxInvalidArgumentError: a snapshot of another backend, or a config that
                cannot start from one (a Docker ``container`` to attach to; a subprocess or
                SSH ``workdir`` of your own: a fork gets a private copy).
            SandboxUnavailableError: the runtime was already started.
        """
        if self.snapshot_holds is None:
            raise SnapshotUnsupportedError(
                f"the {self.name} backend cannot open sandboxes from snapshots"
            )
        if self._state != State.NEW:
            raise SandboxUnavailableError(
                f"{self.describe()} was already started ({self._state.value})"
            )
        if snapshot.backend != self.name:
            raise SandboxInvalidArgumentError(
                f"{snapshot.describe()} cannot open a {self.name} sandbox: open it with a "
                f"{snapshot.backend!r} config"
            )
        self._check_fork_config()
        self._snapshot_source = snapshot
        return self

    @property
    def snapshot_source(self) -> SandboxSnapshot | None:
        """The snapshot this runtime was opened from, if any."""
        return self._snapshot_source

    async def _snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        """Take the snapshot, storing ``labels`` with it (a backend with ``snapshot_holds``).

        Raises:
            SnapshotUnsupportedError: the default.
        """
        raise SnapshotUnsupportedError(f"the {self.name} backend cannot take snapshots")

    def _channel_first_interpreter(self) -> str | None:
        """A fork's first agent starts from the interpreter its snapshot's sandbox pinned
        (never through ``sh`` and ``PATH`` in the policy's filesystem)."""
        source = self._snapshot_source
        return source.python if source is not None and source.untrusted is None else None

    def _check_fork_config(self) -> None:
        """Refuse a config this backend cannot start from a snapshot (raises
        ``SandboxInvalidArgumentError``)."""
        return None

    def _prepared_policy_user(self) -> str | None:
        """The policy's account, if it was made and handed the workdir already."""
        ready = self._policy_account._ready  # the account's state, read by its owner
        return self.policy_user if ready else None

    def _inherits_policy_account(self) -> bool:
        """Whether the snapshot this sandbox starts from holds the policy's account already
        made, with the workdir handed to it (where this sandbox's workdir is)."""
        snap = self._snapshot_source
        if snap is None or snap.policy_user is None or snap.policy_user != self.policy_user:
            return False
        return snap.holds == "workdir" or snap.workdir == self._workdir

    def _inherit_policy_account(self) -> None:
        """A fork whose snapshot's policy account owns the workdir already skips making it
        again: its first use would ``chown -R`` the workdir and so change the owners of
        files the machinery wrote (``docs/snapshots.md``)."""
        if self._inherits_policy_account():
            self._policy_account._ready = True

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """Every labelled snapshot of this backend (for ``cleanup``/``ls``): none for a backend
        that cannot take them.

        Raises:
            SandboxTransportError: the backend could not be reached.
        """
        return []

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Remove one snapshot (gone already is fine): :func:`runtimes.snapshot.remove_snapshot`.

        Raises:
            SnapshotUnsupportedError: the default.
        """
        raise SnapshotUnsupportedError(f"the {cls.name} backend cannot take snapshots")

    @classmethod
    def _destroy_snapshot_at_exit(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None
    ) -> None:
        """The exit backstop of a snapshot nobody removed: :meth:`destroy_snapshot` on a
        fresh event loop (a backend whose client cannot run one at exit overrides it)."""
        anyio.run(cls.destroy_snapshot, snapshot, config)

    # ------------------------------------------------------------------ helpers

    def resolve_path(self, path: PathLike) -> str:
        """An absolute sandbox path: relative ones are joined to the workdir.

        Raises:
            SandboxInvalidArgumentError: empty, containing a NUL byte or a lone surrogate
                that stands for no byte, a component over 255 bytes (NAME_MAX) or the whole
                over 4095 bytes (PATH_MAX).
        """
        return resolve_sandbox_path(path, self.workdir)

    def _exec_request(
        self,
        argv: Sequence[str],
        timeout: float | None,
        cwd: PathLike | None,
        env: Mapping[str, str] | None,
        stdin: bytes | str | AsyncIterable[bytes] | None,
        user: str | None,
        output_limit: int | None,
    ) -> ExecRequest:
        return exec_request(
            argv,
            cwd=lambda: self.workdir if cwd is None else self.resolve_path(cwd),
            base_env={**self.config.env, MARK_VAR: self._mark},
            env=env,
            stdin=stdin,
            user=user,
            timeout=timeout,
            output_limit=self.config.output_limit if output_limit is None else output_limit,
        )

    _creates_policy_user: ClassVar[bool] = True
    """Whether a missing policy account is added to the sandbox (ours) or refused (a host
    whose accounts are not ours to make)."""

    def _policy_passage(self) -> str:
        """A directory above the workdir the policy account must be able to pass, or ""."""
        return ""

    async def _run_as_machinery(self, argv: list[str]) -> tuple[int, bytes]:
        request, sink = self._internal(argv)
        with self._guard("preparing the policy's account"):
            code = await self._routed_exec(request, sink)
        return code, bytes(sink.stderr)

    def _check_open(self) -> None:
        if self._state != State.OPEN:
            what = {State.NEW: f"was never started{NEVER_STARTED_HINT}"}.get(self._state)
            what = what or {State.STARTING: "is still starting"}.get(self._state, "is closed")
            raise SandboxUnavailableError(f"{self.describe()} {what}")

    @contextmanager
    def _guard(self, operation: str, subject: str | None = None) -> Iterator[None]:
        """Let typed errors through; turn anything else from a backend into a SandboxError."""
        try:
            yield
        except SandboxError:
            raise
        except Exception as exc:
            about = f" {subject!r}" if subject else ""
            raise SandboxError(
                f"{self.describe()}: {operation}{about} failed unexpectedly: {exc!r}"
            ) from exc

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Every sandbox of this backend carrying vf-sandbox labels (for ``cleanup``/``ls``).

        Backends that cannot enumerate their sandboxes return an empty list.
        """
        return []

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Remove one sandbox found by :meth:`list_sandboxes`."""
        raise SandboxError(f"{cls.name} cannot remove sandboxes it did not open")

    def _close_at_exit(self) -> None:
        """The atexit backstop: close this runtime on a fresh event loop. A backend whose
        client cannot run a fresh loop at exit overrides it with a synchronous teardown:
        :meth:`_close_channel_now`, remove the sandbox, then :meth:`_mark_closed`."""
        anyio.run(self.close)


__all__ = [
    "CLOCK_TICK_SCRIPT",
    "MARK_VAR",
    "SWEEP_SCRIPT",
    "Runtime",
    "State",
    "live_runtimes",
    "shell_error",
    "sweep_argv",
]
