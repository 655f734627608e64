"""The :class:`~runtimes.base.Runtime` composed around a :class:`~runtimes.backend.Backend`.

:func:`runtime_class` makes one runtime class per backend class (the registry calls it for a
backend plugin). The runtime keeps what every backend shares: the lifecycle, argument
checks, timeouts, caps, the channel routing, the kills still owed, the generic plain path
over :meth:`~runtimes.backend.Backend.spawn` for every file operation, and the sweep of what
the sandbox's commands leave running. It asks the backend only how to reach the sandbox, and
uses a capability (:mod:`runtimes.backend`) where the backend declares one.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, cast

from . import ownership
from ._extract import Links
from .backend import (
    Backend,
    CreateRequest,
    bookkeeping_request,
)
from .base import Runtime
from .capabilities import (
    AgentFilesCheck,
    BlockingTeardown,
    FileFastPath,
    HostRouter,
    MemoryKillProbe,
    ProcessSweeper,
    RemoveFastPath,
    SandboxLister,
    ShellOpener,
    Snapshotter,
    StreamSpawner,
    TreeFastPath,
    TrustedReader,
)
from .channel import ChannelHooks, ChannelTransport, verify_by_reading
from .channel.agent.wire import SweepHeader
from .channel.bootstrap import agent_command
from .config import RuntimeConfig
from .errors import ProvisioningError, SandboxError
from .models import ExecRequest, OutputSink, SandboxInfo
from .processes import close_processes
from .routes import HostRoute, RouteKind
from .shell.session import close_sessions
from .snapshot import SandboxSnapshot
from .sweep import CLOCK_TICK_SCRIPT, MARK_VAR, sweep_argv

__all__ = ["BackendRuntime", "runtime_class"]

log = logging.getLogger("runtimes")


class BackendRuntime(Runtime):
    """The runtime over one :class:`Backend` instance (``self.backend``), made for a backend
    class by :func:`runtime_class`."""

    backend_class: ClassVar[type[Backend]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that names its ``backend_class`` takes the backend's name, config and
        keep support, and the classmethod capabilities it declares: added only where
        declared, so that "does not list" stays visible
        (:func:`runtimes.cleanup.lists_sandboxes`)."""
        super().__init_subclass__(**kwargs)
        backend = cls.__dict__.get("backend_class")
        if backend is None:
            return
        cls.name = backend.name
        cls.config_model = backend.config_model
        cls.keep_supported = backend.keep_supported
        cls._creates_policy_user = backend.creates_policy_user
        if issubclass(backend, SandboxLister):
            cls.list_sandboxes = classmethod(_list_sandboxes)  # type: ignore[assignment]
            cls.destroy_sandbox = classmethod(_destroy_sandbox)  # type: ignore[assignment]
        if issubclass(backend, Snapshotter):
            cls.snapshot_holds = backend.snapshot_holds
            cls.list_snapshots = classmethod(_list_snapshots)  # type: ignore[assignment]
            cls.destroy_snapshot = classmethod(_destroy_snapshot)  # type: ignore[assignment]
            cls._destroy_snapshot_at_exit = classmethod(  # type: ignore[assignment]
                _destroy_snapshot_at_exit
            )
        if issubclass(backend, ShellOpener):
            cls.shell_argv = classmethod(_shell_argv)  # type: ignore[assignment]
            cls.shell_hint = classmethod(_shell_hint)  # type: ignore[assignment]

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.backend = self.backend_class(config)
        self._orphans = self.backend.owed_kills  # one set: the backend owes, the runtime pays
        self._create_request: CreateRequest | None = None
        self._started_at: int | None = None
        """The sandbox's clock tick when it became ours (a backend with a pid namespace of
        its own): every process that started later is its commands'."""

    @property
    def sandbox_id(self) -> str | None:
        return self.backend.sandbox_id

    def describe(self) -> str:
        return self.backend.describe()

    # ------------------------------------------------------------------ lifecycle

    def _request(self) -> CreateRequest:
        """What :meth:`Backend.prepare` and :meth:`Backend.create` are asked (made once)."""
        if self._create_request is None:
            labels = ownership.ownership_labels(
                self.name, self.config.labels, keep=self.config.keep
            )
            self._create_request = CreateRequest(
                labels,
                self._mark,
                self._snapshot_source,
                policy_account_made=self._inherits_policy_account(),
            )
        return self._create_request

    def _live_cap(self) -> int | None:
        return self.backend.live_cap()

    async def _before_start(self) -> None:
        await self.backend.prepare(self._request())

    async def _start(self) -> str:
        workdir = await self.backend.create(self._request())
        self._workdir = workdir  # the channel's agent starts there
        await self._start_channel()
        if self.backend.pid_namespace:
            self._started_at = await self._clock_tick()
        return workdir

    async def _clock_tick(self) -> int:
        """The sandbox's clock tick now (:data:`runtimes.sweep.CLOCK_TICK_SCRIPT`).

        Raises:
            ProvisioningError: the sandbox cannot run ``sh`` or has no ``/proc``.
        """
        request, sink = self._internal(["sh", "-c", CLOCK_TICK_SCRIPT])
        code = await self._routed_exec(request, sink)
        text = bytes(sink.stdout).decode("utf-8", "replace").strip()
        if code != 0 or not text.isdigit():
            detail = bytes(sink.stderr).decode("utf-8", "replace").strip()
            raise ProvisioningError(f"{self.describe()}: cannot read /proc ({code}): {detail}")
        return int(text)

    def _sweep_header(self) -> SweepHeader:
        """The backend's :class:`~runtimes.backend.SweepScope` as the sweep's arguments: in
        a sandbox with a pid namespace of its own, every process that started after it
        became ours, however it detached itself."""
        scope = self.backend.sweep_scope()
        mode: str = scope.mode
        if self._started_at is not None and mode == "mark":
            mode = f"since:{self._started_at}"
        users = ",".join(scope.users)
        return SweepHeader(mode, f"{MARK_VAR}={self._mark}", users, scope.home or "")

    def _sweep_argv(self) -> list[str]:
        header = self._sweep_header()
        return sweep_argv(
            header.mode,
            header.mark,
            keep=self._channel_agent_pid(),
            user=header.user,
            home=header.home,
        )

    async def _sweep(self, *, plain: bool = False) -> int:
        """The sweep of :meth:`stop_processes` and close: the backend's own
        (:class:`ProcessSweeper`), else the agent's where the scope runs as root and a root
        agent runs (it forks nothing), else the sweep script (through :meth:`Backend.spawn`
        when ``plain``: at close, the channel has gone)."""
        if isinstance(self.backend, ProcessSweeper):
            return await self.backend.sweep()
        scope = self.backend.sweep_scope()
        if scope.as_root and not plain:
            killed = await self._sweep_by_agent(self._sweep_header())
            if killed is not None:
                return killed
        # From /: the policy may have removed the workdir.
        request, sink = bookkeeping_request(self._sweep_argv(), cwd="/")
        if scope.as_root:
            request = dataclasses.replace(request, user="0")
        if plain or scope.as_root:
            return self._swept(await self.backend.spawn(request, sink), sink)
        return self._swept(await self._routed_exec(request, sink), sink)

    async def _sweep_by_agent(self, header: SweepHeader) -> int | None:
        """How many processes the channel's agent killed sweeping as ``header`` says;
        ``None`` when no trusted root agent runs (one of another user could not signal the
        others' processes) or the channel died meanwhile: the script serves then.

        Raises:
            SandboxError: the agent's sweep failed.
        """
        supervisor = self._supervisor
        if supervisor is None:
            return None

        async def by_agent(chan: Any) -> int | None:
            hello = chan.hello
            if hello is None or hello.uid != 0:
                return None
            return int(await chan.sweep(header))

        async def by_script() -> int | None:
            return None

        return await supervisor.file_call(by_agent, by_script, "stop_processes", idempotent=True)

    def _route_hint(self) -> str:
        return self.backend.route_hint() or super()._route_hint()

    @property
    def policy_user(self) -> str | None:
        return self.backend.policy_user

    @property
    def judge_user(self) -> str | None:
        return self.backend.judge_user

    def _makes_accounts(self) -> bool:
        return self.backend.makes_accounts()

    def _policy_passage(self) -> str:
        return self.backend.policy_passage()

    async def system_tampered(self) -> str | None:
        self._check_open()
        with self._guard("reading the sandbox's changes"):
            return await self.backend.system_tampered()

    def _check_request(self, request: ExecRequest) -> None:
        self.backend.check_request(request)

    def close_at_exit(self) -> None:
        """The exit backstop: a :class:`BlockingTeardown`'s, else ``close()`` on a fresh
        event loop."""
        if not isinstance(self.backend, BlockingTeardown):
            return super().close_at_exit()
        self._close_channel_now()
        try:
            self.backend.destroy_now(keep=self._keep)
        finally:
            self._mark_closed()

    # ------------------------------------------------------------------ the channel

    def _channel_hooks(self) -> ChannelHooks | None:
        """The channel over a :class:`StreamSpawner`'s stream: kills through ``spawn``, the
        backend's ``alive`` as the death probe, a restart verified through its
        :class:`AgentFilesCheck` or :class:`TrustedReader` (none without one: the plain path
        serves from then on)."""
        if not isinstance(self.backend, StreamSpawner):
            return None
        backend = self.backend
        verify_agent: Callable[[Mapping[str, bytes]], Awaitable[str | None]] | None = None
        if isinstance(backend, AgentFilesCheck):
            verify_agent = backend.agent_files_changed
        elif isinstance(backend, TrustedReader):
            verify_agent = self._verify_agent_files
        return ChannelHooks(
            open_transport=self._open_agent,
            kill_group=self._kill_group_plainly,
            lost_means_dead=backend.lost_means_dead,
            probe_dead=backend.silence_means_dead if backend.probes_silence else None,
            verify_agent=verify_agent,
            # The first agent finds python3 on the sandbox's PATH: in a sandbox others ran
            # code in, that may be theirs (attack class 4) unless the backend can tell.
            verify_first=backend.first_agent_untrusted,
        )

    def _channel_wanted(self) -> bool:
        backend = self.backend
        wanted = isinstance(backend, StreamSpawner) and backend.channel_wanted()
        return wanted and super()._channel_wanted()

    def _channel_stall_timeout(self) -> float | None:
        if isinstance(self.backend, StreamSpawner):
            return self.backend.channel_stall_timeout()
        return None

    def _channel_kill_wait(self) -> float:
        if isinstance(self.backend, StreamSpawner):
            return self.backend.channel_kill_wait()
        return super()._channel_kill_wait()

    def _channel_env(self, request: ExecRequest) -> Mapping[str, str]:
        if isinstance(self.backend, StreamSpawner):
            return self.backend.channel_env()
        return {}

    async def _open_agent(self, interpreter: str | None) -> ChannelTransport:
        assert isinstance(self.backend, StreamSpawner)
        return await self.backend.open_stream(agent_command(interpreter))

    async def _close_channel(self) -> None:
        """Before the stream goes: where the backend asks it, the root agent kills every
        process but PID 1, so that the sandbox can go without waiting for them."""
        backend = self.backend
        supervisor = self._channel_supervisor
        if (
            isinstance(backend, StreamSpawner)
            and supervisor is not None
            and not self._keep
            and backend.agent_halts()
        ):
            backend.halted = await supervisor.halt()
        await super()._close_channel()

    def keeps_sandbox(self) -> bool:
        return self.backend.attached

    async def _kill_group_plainly(self, pgid: int) -> None:
        """The channel's agent died holding ``pgid``: killed now (the id is fresh); a kill
        that cannot be delivered is owed, and paid with the mark's guard before the next
        command."""
        try:
            await self.backend.kill_groups([pgid], mark=None)
        except SandboxError as exc:
            log.warning("%s: could not kill process group %s: %s", self.describe(), pgid, exc)
            self._remember_orphan(pgid)

    async def _kill_orphan_groups(self, pgids: frozenset[int]) -> None:
        await self.backend.kill_groups(pgids, mark=f"{MARK_VAR}={self._mark}")

    async def _verify_agent_files(self, digests: Mapping[str, bytes]) -> str | None:
        assert isinstance(self.backend, TrustedReader)
        return await verify_by_reading(self.backend.read_trusted, digests)

    async def _close(self) -> None:
        # What the sandbox's commands left running dies with it (a sandbox that ends its
        # processes itself, a container, has nothing left to sweep); one it attached to is
        # only let go, so what they left is swept first.
        ends = self.backend.destroy_ends_processes and not self.backend.attached
        if not self._keep and self._workdir is not None and not ends:
            await self._sweep_quietly(self._sweep(plain=True))
        await self.backend.destroy(keep=self._keep)

    async def _sweep_quietly(self, sweep: Awaitable[int]) -> None:
        """A sweep before the sandbox goes: what it could not kill is logged, and the
        sandbox is destroyed all the same."""
        try:
            await sweep
        except SandboxError as exc:
            log.warning("%s: the sweep before close failed: %s", self.describe(), exc)

    async def _alive(self) -> bool:
        return await self.backend.alive()

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        return await self.backend.spawn(request, sink)

    async def stop_processes(self) -> int:
        self._check_open()
        with self._guard("stop_processes"):
            return await self._sweep()

    async def end_uses(self) -> int:
        """End everything this runtime's users opened, leaving the sandbox up: shell
        sessions, background runs, the channel's relays (routes to the host), then every
        process left (:meth:`stop_processes`), whose count it returns. The first step of a
        recycle (:mod:`runtimes.recycle`).

        Raises:
            SandboxUnavailableError: the runtime is not open, or the sandbox is gone.
            SandboxError: as :meth:`stop_processes`.
        """
        self._check_open()
        await close_sessions(self)
        await close_processes(self)
        if self._channel_supervisor is not None:
            await self._channel_supervisor.close_relays()
        return await self.stop_processes()

    # ------------------------------------------------------------------ capabilities

    async def _read(self, path: str, limit: int) -> bytes:
        if isinstance(self.backend, FileFastPath) and self.backend.serves_files():
            return await self.backend.read(path, limit)
        return await super()._read(path, limit)

    async def _write(self, path: str, data: bytes) -> None:
        if isinstance(self.backend, FileFastPath) and self.backend.serves_files():
            return await self.backend.write(path, data)
        return await super()._write(path, data)

    async def _exists(self, path: str) -> bool:
        if isinstance(self.backend, FileFastPath) and self.backend.serves_files():
            return await self.backend.exists(path)
        return await super()._exists(path)

    async def _remove(self, path: str) -> None:
        if isinstance(self.backend, RemoveFastPath):
            return await self.backend.remove(path)
        return await super()._remove(path)

    async def _upload(self, source: Path, remote: str) -> None:
        if isinstance(self.backend, TreeFastPath) and self.backend.serves_files():
            return await self.backend.upload(source, remote)
        return await super()._upload(source, remote)

    async def _download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        if isinstance(self.backend, TreeFastPath) and self.backend.serves_files():
            return await self.backend.download(remote, local, skip_unsafe=skip_unsafe, links=links)
        return await super()._download(remote, local, skip_unsafe=skip_unsafe, links=links)

    async def _memory_kill(self, since: float) -> str | None:
        if isinstance(self.backend, MemoryKillProbe):
            return await self.backend.memory_kill(since)
        return None

    def _host_routes(self) -> tuple[RouteKind, ...]:
        if isinstance(self.backend, HostRouter):
            return self.backend.host_routes()
        return super()._host_routes()

    async def _host_bind_address(self, via: RouteKind) -> str:
        if isinstance(self.backend, HostRouter):
            return await self.backend.host_bind_address(via)
        return await super()._host_bind_address(via)

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        if isinstance(self.backend, HostRouter):
            return await self.backend.expose_host(port, via)
        return await super()._expose_host(port, via)

    async def _snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        if isinstance(self.backend, Snapshotter):
            return await self.backend.snapshot(labels)
        return await super()._snapshot(labels)

    def _check_fork_config(self) -> None:
        if isinstance(self.backend, Snapshotter):
            self.backend.check_fork_config()


# The classmethod capabilities, which BackendRuntime.__init_subclass__ installs.


async def _list_sandboxes(
    cls: type[BackendRuntime], config: RuntimeConfig | None = None
) -> list[SandboxInfo]:
    return await cast("type[SandboxLister]", cls.backend_class).list_sandboxes(config)


async def _destroy_sandbox(
    cls: type[BackendRuntime], info: SandboxInfo, config: RuntimeConfig | None = None
) -> None:
    await cast("type[SandboxLister]", cls.backend_class).destroy_sandbox(info, config)


async def _list_snapshots(
    cls: type[BackendRuntime], config: RuntimeConfig | None = None
) -> list[SandboxSnapshot]:
    return await cast("type[Snapshotter]", cls.backend_class).list_snapshots(config)


async def _destroy_snapshot(
    cls: type[BackendRuntime], snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
) -> None:
    await cast("type[Snapshotter]", cls.backend_class).destroy_snapshot(snapshot, config)


def _destroy_snapshot_at_exit(
    cls: type[BackendRuntime], snapshot: SandboxSnapshot, config: RuntimeConfig | None
) -> None:
    cast("type[Snapshotter]", cls.backend_class).destroy_snapshot_now(snapshot, config)


def _shell_hint(cls: type[BackendRuntime], sandbox_id: str, config: RuntimeConfig) -> str:
    hint = cast("type[ShellOpener]", cls.backend_class).shell_hint(sandbox_id, config)
    return hint if hint is not None else BackendRuntime.shell_hint(sandbox_id, config)


async def _shell_argv(
    cls: type[BackendRuntime],
    info: SandboxInfo,
    config: RuntimeConfig | None = None,
    *,
    tty: bool,
) -> list[str]:
    return await cast("type[ShellOpener]", cls.backend_class).shell_argv(info, config, tty=tty)


@functools.cache
def runtime_class(backend: type[Backend]) -> type[BackendRuntime]:
    """The :class:`Runtime` class over ``backend``, one per backend class: what the registry
    returns for a backend plugin, and what ``open_runtime`` instantiates. (A package may
    also name the class itself: ``class SubprocessRuntime(BackendRuntime)`` with
    ``backend_class = SubprocessBackend``.)"""
    namespace = {
        "__module__": backend.__module__,
        "__qualname__": f"{backend.__qualname__}Runtime",
        "__doc__": f"The runtime over :class:`{backend.__qualname__}`.",
        "backend_class": backend,
    }
    return type(f"{backend.__name__}Runtime", (BackendRuntime,), namespace)
