"""The :class:`Runtime` contract: one async API over every kind of sandbox.

Lifecycle (``start`` / ``close``) is kept apart from the operations on a live sandbox
(``exec``, ``read``, ``write``, ...). The public methods here validate arguments,
resolve paths, enforce timeouts and caps, keep state, and route calls through the
sandbox's channel when it has one (:mod:`runtimes.channel`: routing, fallback, restart
and dead-sandbox probing all happen here, not in backends). A backend implements the
small ``_``-prefixed primitives, the *plain* paths that work without the channel, and
never repeats that work.

Writing a backend: implement :class:`runtimes.Backend` (how to create, destroy, probe the
sandbox and run one process in it with pipes) and declare what it does better as
capabilities (:mod:`runtimes.capabilities`); :func:`runtimes.runtime_class` composes this
class around it (:mod:`runtimes.composed`, ``docs/plugins.md``). Then run the conformance
suite (:mod:`runtimes.testing`) against it. Subclassing :class:`Runtime` and filling in its
``_``-prefixed hooks directly is the older seam: the registry still loads such a plugin,
with a ``DeprecationWarning``.

How the class is made: :class:`~runtimes.primitives.Primitives` holds the ``_``-prefixed
hooks (which :class:`~runtimes.composed.BackendRuntime` fills in from its backend) for the
plain path and the channel routing in front of them;
:class:`~runtimes.guards.Guarded` the state and guards every operation checks; the
operations come in mixins over those, one module each: files (:mod:`.files`), routes to
the host (:mod:`.host_routes`), the policy's and judges' accounts (:mod:`.accounts`),
snapshots and forks (:mod:`.forking`, with the optional hooks of a backend that takes
them), listing (:mod:`.listing`) and keeping (:mod:`.keep`). This module keeps the
lifecycle, ``exec``/``spawn``/``shell`` and the process sweep.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterable, Callable, Mapping, Sequence
from types import TracebackType
from typing import ClassVar, Self, TypeVar

import anyio
import anyio.lowlevel

from . import lifecycle, limits
from ._local_files import shell_error
from .arguments import PathLike, exec_request
from .channel import ChannelSupervisor
from .config import RuntimeConfig
from .errors import SandboxError, SandboxInvalidArgumentError, SandboxUnavailableError
from .files import FileOperations
from .forking import Snapshotting
from .host_routes import HostRouting
from .keep import Keeping, announce_kept
from .lifecycle import State, live_runtimes
from .listing import Listing
from .models import ExecRequest, ExecResult, OutputSink, SandboxInfo, Stream
from .policy import PolicyAccount
from .processes import (
    BACKGROUND_BUFFER,
    UNCAPPED,
    BackgroundProcess,
    background_processes,
    close_processes,
    run_command,
    start_background,
)
from .shell.session import ShellSession, close_sessions
from .snapshot import SandboxSnapshot
from .sweep import CLOCK_TICK_SCRIPT, MARK_VAR, SWEEP_SCRIPT, sweep_argv

log = logging.getLogger("runtimes")

T = TypeVar("T")


class Runtime(FileOperations, HostRouting, Snapshotting, Keeping, Listing):
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
    forwards_host_side: ClassVar[bool] = False
    """Whether the whole host side lives in another process that this class forwards every
    call to (the ``ray`` runtime's actor on its node): such a runtime fills in the hooks
    itself rather than composing a :class:`~runtimes.Backend`."""

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
        self._channel_supervisor: ChannelSupervisor | None = None
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
                    await close_processes(self, keep=self._keep or self.keeps_sandbox())
                if was in (State.STARTING, State.OPEN):
                    await self._close_channel()
                    if self._orphans and (self.keeps_sandbox() or self._keep):
                        await self._kill_orphans()
                    await self._close()
            finally:
                self._mark_closed()

    def _mark_closed(self) -> None:
        """The one way to mark this runtime closed: out of the exit registry, its live
        slot given back. ``close()`` ends with it; a backend's synchronous
        :meth:`close_at_exit` calls it once the sandbox is gone."""
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

    def lost(self) -> str | None:
        """Why the sandbox is known to be gone without asking it (a ray sandbox whose node
        the cluster lists dead), else ``None``, which says nothing (:meth:`alive` asks).
        Free: no call is made. A pool hands out no ready sandbox that is lost."""
        return None

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

    async def stop_processes(self) -> int:
        """Kill every process this runtime's commands started that is still running;
        return how many. A process already dying (a timed-out command's, its ``SIGKILL``
        sent but not yet run by a loaded machine) is waited for, not counted.

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

    # ------------------------------------------------------------------ helpers

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

    # ------------------------------------------------------------- backend hooks: cleanup, exit

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

    def close_at_exit(self) -> None:
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
