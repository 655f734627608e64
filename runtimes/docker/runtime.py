"""The ``docker`` backend: one container per sandbox, driven through the Engine API.

Owned sandboxes: :meth:`DockerBackend.create` creates a container from ``image`` with a
keep-alive command, vf-sandbox labels (:mod:`runtimes.ownership`), no network by default,
``docker-init`` as PID 1 when the engine has it, and the workdir; ``destroy`` removes it.
Attach mode (``container=``): commands and files go to a running container the caller
owns; ``close()`` sweeps what this runtime's commands left (by their mark) and leaves it
running.

Commands run through ``exec_create`` + a hijacked ``exec_start`` connection
(:mod:`.stream`), with the 8-byte stream headers demultiplexed as output arrives and stdin
streamed then half-closed. Each command starts through the one exec wrapper
(:mod:`.process`, :mod:`runtimes.wrapper`), which reports its PID, the command's process
group: ``timeout=``, the output cap and cancellation kill the whole tree with a second exec
(``kill -9 -PGID``). Images therefore need ``/bin/sh``. The channel (routing, fallback,
restart) is the runtime's (:mod:`runtimes.composed`); this backend supplies the agent's
stream and the engine's checks of it.

Files go through the archive API (:mod:`.fastpath`) when the sandbox's default user is root;
with a non-root user they go through the runtime's generic path as that user, so permissions
mean what they mean for the user's commands.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import anyio

from ..backend import (
    Backend,
    CreateRequest,
    SweepScope,
)
from ..capabilities import (
    AgentFilesCheck,
    BlockingTeardown,
    HostRouter,
    MemoryKillProbe,
    SandboxLister,
    ShellOpener,
    Snapshotter,
    StreamSpawner,
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
from ..limits import creation_rate
from ..machinery import machinery_env
from ..models import ExecRequest, OutputSink, SandboxInfo
from ..reaper import remove_in_background
from ..routes import HostRoute, RouteKind
from ..snapshot import SandboxSnapshot
from .agent import judge_untrusted, open_agent_stream, untrusted_change, untrusted_python
from .client import (
    ContainerRef,
    changed_paths,
    client_for,
    engine_call,
    engine_name,
    inspect_container,
    is_running,
    is_stopped,
    remove_container_blocking,
    retried_in_this_thread,
)
from .config import DEFAULT_WORKDIR, DockerConfig, as_docker_config, is_root_user
from .container import (
    confirm_running_blocking,
    create_container,
    creation_config,
    destroy_sandbox,
    inspect_attached,
    list_sandboxes,
    prepare_workdir,
)
from .fastpath import DockerFiles
from .network import GATEWAY_TIMEOUT, ROUTE_TABLE, host_gateway, host_routes, route_hint
from .oom import memory_kill_setting
from .ports import engine_host, published_address
from .process import (
    check_user_ceiling,
    died_with_container,
    kill_group,
    kill_orphan_groups,
    own_request,
    run_exec,
)
from .recycling import DockerResetProof
from .snapshots import (
    check_snapshot_holds_the_workdir,
    commit_snapshot,
    destroy_snapshot,
    destroy_snapshot_at_exit,
    list_snapshots,
)

if TYPE_CHECKING:
    import docker

log = logging.getLogger("runtimes.docker")


class DockerBackend(
    Backend,
    DockerFiles,
    StreamSpawner,
    AgentFilesCheck,
    SandboxLister,
    Snapshotter,
    ShellOpener,
    MemoryKillProbe,
    HostRouter,
    BlockingTeardown,
    DockerResetProof,
):
    """A Docker container as a sandbox (owned, or attached to a running one)."""

    name = "docker"
    config_model = DockerConfig
    keep_supported = True
    destroy_ends_processes = True  # an owned container is removed; an attached one is swept
    snapshot_holds = "filesystem"

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: DockerConfig
        self._client: docker.DockerClient | None = None
        self._container_id: str | None = None
        self._owned = self.config.container is None
        self._default_user: str | None = self.config.user
        self._files_as_root = True
        self._snapshot_lock = anyio.Lock()  # one commit at a time: each pauses the container
        self._source: SandboxSnapshot | None = None
        """The snapshot this sandbox was opened from (a fork), if any."""
        self._untrusted_image: str | None = None
        """Why the image (a snapshot's) may hold an interpreter that is not the original
        image's: the channel never runs it (see :mod:`.snapshots`)."""
        self._init_is_pid1 = False

    @property
    def sandbox_id(self) -> str | None:
        """The container's full id, once created (or attached)."""
        return self._container_id

    @property
    def policy_user(self) -> str | None:
        """``policy_user`` (``vf-policy`` by default) in a container this backend created
        whose default user is root; ``None`` otherwise (an attached container is not ours to
        add accounts to; a non-root default user cannot become another)."""
        if not self._owned or not self.config.policy_user:
            return None
        return self.config.policy_user if is_root_user(self._default_user) else None

    def makes_accounts(self) -> bool:
        return not self.config.read_only  # a read-only /etc takes no new account

    @property
    def attached(self) -> bool:
        """Whether this backend borrows a container it did not create."""
        return not self._owned

    def route_hint(self) -> str:
        return route_hint(self.config)

    def check_request(self, request: ExecRequest) -> None:
        """The sandbox's user is the ceiling (see :func:`.process.check_user_ceiling`).

        Raises:
            SandboxPermissionError: root asked for in a sandbox of another user.
        """
        check_user_ceiling(request, self._default_user)

    def sweep_scope(self) -> SweepScope:
        """In a container of our own, every process outside the keep-alive's session 1
        (every exec is a session of its own: docker exec calls setsid), as root, however it
        detached itself; in an attached one, what carries the mark (the container's own
        processes are not ours)."""
        return SweepScope(mode="all", as_root=True) if self._owned else SweepScope()

    # ------------------------------------------------------------------ lifecycle

    def live_cap(self) -> int | None:
        """A container this backend creates takes a slot under ``max_live`` (process-wide)."""
        return self.config.max_live if self._owned else None

    async def prepare(self, request: CreateRequest) -> None:
        """Before creating, waits (cancellably) for the ``creations_per_second`` pace."""
        if self._owned:
            await creation_rate(self.name).wait(self.config.creations_per_second)

    async def create(self, request: CreateRequest) -> str:
        """Create the container (or find the one to attach to), confirm it runs and prepare
        its workdir.

        Raises:
            ProvisioningError: the engine cannot be reached, the image is missing, the
                engine refused, or the container was not ready within ``start_timeout``.
        """
        self._source = request.snapshot
        try:
            self._client = await engine_call(
                lambda: client_for(self.config), self.config, idempotent=True
            )
        except SandboxTransportError as exc:
            raise ProvisioningError(f"cannot reach {engine_name(self.config)}: {exc}") from exc
        container = None
        if self._owned:
            workdir, container = await self._create_container(request)
        else:
            workdir = await self._attach()
        await self._confirm_ready(container, workdir)
        return workdir

    async def _confirm_ready(self, container: Any, workdir: str) -> None:
        try:
            if container is not None:
                await engine_call(
                    lambda: confirm_running_blocking(container, self.config.image), self.config
                )
            with anyio.fail_after(self.config.start_timeout):
                await self._prepare(workdir)
        except TimeoutError:
            raise ProvisioningError(
                f"{self.describe()} was not ready within {self.config.start_timeout:g}s"
            ) from None
        except ProvisioningError:
            raise
        except SandboxError as exc:
            raise ProvisioningError(f"{self.describe()} is not usable: {exc}") from exc

    async def _create_container(self, request: CreateRequest) -> tuple[str, Any]:
        """Create and start the container (see :func:`.container.create_container`); return
        the workdir and the SDK's container (not yet confirmed running)."""
        client = self._require_client()
        made = await creation_config(client, self.config, request.snapshot)
        self._untrusted_image = made.untrusted
        container, self._init_is_pid1 = await create_container(
            client,
            made,
            self.name,
            fork=request.snapshot is not None,
            record=self._record_container,
        )
        self._default_user = made.config.user or made.image_user or None
        self._files_as_root = is_root_user(self._default_user)
        return made.config.workdir or DEFAULT_WORKDIR, container

    def _record_container(self, container_id: str | None) -> None:
        self._container_id = container_id

    async def _attach(self) -> str:
        cfg = self.config
        info = await inspect_attached(self._require_client(), cfg)
        self._container_id = str(info["Id"])
        settings = info.get("Config") or {}
        self._default_user = cfg.user or settings.get("User") or None
        self._files_as_root = is_root_user(self._default_user)
        return cfg.workdir or settings.get("WorkingDir") or "/"

    async def _prepare(self, workdir: str) -> None:
        """Readiness (see :func:`.container.prepare_workdir`)."""
        owner = "" if is_root_user(self._default_user) else self._default_user or ""
        if self._owned and not owner:
            return  # ready once it runs: the engine created the workdir (``working_dir``)
        need_dir = self._owned or self.config.workdir is not None
        await prepare_workdir(self.spawn, workdir, owner, need_dir, self.describe())

    def _removes_container(self, keep: bool) -> bool:
        """Whether destroy removes the container: one this backend created and does not keep."""
        owned = self._owned and self._container_id is not None and self._client is not None
        return owned and not keep

    def agent_halts(self) -> bool:
        """Before the stream goes, the root agent kills everything but itself and docker-init
        (whose child, the keep-alive, dies with the rest: the container stops). Without
        docker-init, PID 1 is the keep-alive loop, which would start a new ``sleep`` from the
        sandbox's files: then destroy removes the container itself."""
        return self._removes_container(keep=False) and self._init_is_pid1

    async def destroy(self, *, keep: bool) -> None:
        """Remove the container: in the background (:mod:`runtimes.reaper`) when the root
        agent killed every process of it (:attr:`halted`), nothing of it running any more;
        else here, on the caller's path (the engine kills and removes it). An attached or
        kept container is left as it is.

        Raises:
            SandboxTransportError: the engine did not answer.
            SandboxError: the engine refused to remove it.
        """
        if not self._removes_container(keep):
            return
        if self.halted:
            self._remove_in_background()
        else:
            await engine_call(self._remove_blocking, self.config, idempotent=True)

    def _remove_in_background(self) -> None:
        remove_in_background(
            self.describe(), lambda: retried_in_this_thread(self._remove_blocking, self.config)
        )

    def _remove_blocking(self) -> None:
        remove_container_blocking(self._require_client().api, self._require_id(), self.describe())

    def destroy_now(self, *, keep: bool) -> None:
        """The exit backstop: remove the container synchronously through the SDK (a failure
        is logged: its labels leave it to ``vf-sandbox cleanup``)."""
        if not self._removes_container(keep):
            return
        try:
            self._remove_blocking()
        except SandboxError as exc:
            log.warning("%s: could not remove it at exit: %s", self.describe(), exc)

    # ------------------------------------------------------------------ host routes

    def host_routes(self) -> tuple[RouteKind, ...]:
        return host_routes(self.config)

    async def host_bind_address(self, via: RouteKind) -> str:
        """``127.0.0.1``, or for ``gateway`` the container's default gateway.

        Raises:
            HostRouteError: the gateway is missing or not this host's.
        """
        return "127.0.0.1" if via != "gateway" else await self._gateway()

    async def expose_host(self, port: int, via: RouteKind) -> HostRoute:
        """The host's loopback as it is (``network="host"``), or the container's gateway.

        Raises:
            HostRouteError: the gateway is missing or not this host's.
        """
        if via == "loopback":
            return HostRoute("loopback", "127.0.0.1", port)
        return HostRoute("gateway", await self._gateway(), port)

    async def _gateway(self) -> str:
        """The container's default gateway (:func:`.network.host_gateway`), from its
        ``/proc/net/route`` read as the machinery (``/``, the fixed ``PATH``).

        Raises:
            HostRouteError: no default route, or not an address of this host.
        """
        request, sink = self._internal(ROUTE_TABLE)
        code: int | None = None
        with anyio.move_on_after(GATEWAY_TIMEOUT):
            code = await self.spawn(request, sink)
        table = bytes(sink.stdout).decode("utf-8", "replace") if code == 0 else None
        return host_gateway(table, self.describe())

    def _internal(self, argv: list[str]) -> tuple[ExecRequest, OutputSink]:
        """A request for the backend's own command: ``cwd`` ``/`` and the machinery's
        environment (:mod:`runtimes.machinery`), as the default user."""
        return own_request(argv, env=machinery_env())

    async def host_port(self, port: int, protocol: str = "tcp") -> tuple[str, int]:
        """:meth:`DockerRuntime.host_port`.

        Raises:
            SandboxInvalidArgumentError: the port is not published.
            SandboxUnavailableError: the container is gone.
        """
        info = await inspect_container(self._ref())
        where = engine_host(self.config.base_url)
        return published_address(info, port, protocol, self.describe(), where)

    async def alive(self) -> bool:
        return await is_running(self._ref())

    def _require_client(self) -> docker.DockerClient:
        if self._client is None:
            raise SandboxUnavailableError(f"{self.describe()} has no engine connection")
        return self._client

    def _require_id(self) -> str:
        if self._container_id is None:
            raise SandboxUnavailableError(f"{self.describe()} has no container")
        return self._container_id

    def _ref(self) -> ContainerRef:
        return ContainerRef(
            self._require_client().api,
            self._require_id(),
            self.config,
            self.describe(),
            self._default_user or "",
        )

    # ------------------------------------------------------------------ exec

    async def spawn(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run a command (the runtime's own ones too, which may use root); a command this
        call lost track of is owed a kill."""
        return await run_exec(
            self._ref(),
            request,
            sink,
            kill_group=self._kill_group,
            died=self.lost_means_dead,
            lost=self.owe_kill,
        )

    async def memory_kill(self, since: float) -> str | None:
        return await memory_kill_setting(self._ref(), since)

    async def _kill_group(self, pid: int | None) -> None:
        """Kill a command's process group (see :func:`.process.kill_group`); a kill that
        could not be delivered is owed."""
        if pid is not None and not await kill_group(self._ref(), pid):
            self.owe_kill(pid)

    async def kill_groups(self, pgids: Collection[int], *, mark: str | None) -> None:
        """As root, outside the wrapper (see :func:`.process.kill_orphan_groups`).

        Raises:
            SandboxError: the kill could not be delivered.
        """
        await kill_orphan_groups(self._ref(), mark, pgids)

    # ------------------------------------------------------------------ the channel

    def channel_stall_timeout(self) -> float | None:
        return self.config.api_timeout

    async def open_stream(self, argv: list[str]) -> ChannelTransport:
        return await open_agent_stream(self._ref(), argv)

    async def agent_files_changed(self, digests: Mapping[str, bytes]) -> str | None:
        """Before the channel agent restarts: the engine's own diff of the container against
        its image (no sandbox code runs) shows no change to the files the first agent ran
        from, to the dynamic loader's configuration, or to a shared library. The image is
        trusted; whatever a command changed in those places is not."""
        return untrusted_change(await changed_paths(self._ref()), digests)

    async def outside_view(self) -> tuple[str, ...]:
        """The engine's diff against the image (:func:`.client.changed_paths`)."""
        return tuple(await changed_paths(self._ref()))

    async def system_tampered(self) -> str | None:
        """The engine's diff against the image: a changed loader preload/configuration or
        judge shell (:func:`.agent.judge_untrusted`). Reads nothing in the sandbox."""
        return judge_untrusted(await changed_paths(self._ref()))

    async def first_agent_untrusted(self) -> str | None:
        """Before the first agent starts in a container this backend did not create
        (commands may have run there: a rollout's): no ``python*`` anywhere and no system
        library changed since the image (the engine's diff). A container of our own is new;
        a fork's image is a snapshot, checked when it was taken (:mod:`.snapshots`)."""
        if self._owned:
            return self._untrusted_image
        return untrusted_python(await changed_paths(self._ref()))

    async def silence_means_dead(self) -> bool:
        return await is_stopped(self._ref())

    async def lost_means_dead(self) -> bool:
        """After a command died of SIGKILL, or the channel was lost: was that the container
        going down? (See :func:`.process.died_with_container`.)"""
        return await died_with_container(self.spawn, self.alive, self.describe())

    # ------------------------------------------------------------------ snapshots

    def check_fork_config(self) -> None:
        """A fork is a container of our own, from the snapshot's image.

        Raises:
            SandboxInvalidArgumentError: the config attaches to a ``container``.
        """
        if not self._owned:
            raise SandboxInvalidArgumentError(
                f"a docker sandbox opened from a snapshot is a new container: drop "
                f"container={self.config.container!r} from its config"
            )

    async def snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        """Commit the container to a labelled image, paused meanwhile (see :mod:`.snapshots`).

        Raises:
            SnapshotUnsupportedError: the sandbox keeps its workdir and ``/tmp`` in volumes
                (``disk`` or ``read_only``), which the engine's commit leaves out.
            SandboxUnavailableError: the container is gone or stopped.
            SandboxTransportError: the engine did not answer.
            SandboxError: the engine refused to commit.
        """
        check_snapshot_holds_the_workdir(self.config, self.describe())
        inherited = self._untrusted_image
        if inherited is None and self._source is not None:
            inherited = self._source.untrusted
        # With a policy account of its own for its whole life, nothing but the host's own
        # (root) commands could change the system files: no diff to read.
        check = not (self._owned and self.policy_user is not None)
        async with self._snapshot_lock:
            return await commit_snapshot(self._ref(), labels, inherited, check=check)

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """Every image carrying the ``vf-sandbox.snapshot`` label on the engine (see
        :func:`.snapshots.list_snapshots`).

        Raises:
            SandboxTransportError: the engine did not answer.
        """
        return await list_snapshots(as_docker_config(config))

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Remove a snapshot's image, gone already is fine (see
        :func:`.snapshots.destroy_snapshot`).

        Raises:
            SandboxInvalidArgumentError: the image is not a vf-sandbox snapshot.
            SandboxError: a sandbox opened from it still uses it.
        """
        await destroy_snapshot(snapshot, as_docker_config(config))

    @classmethod
    def destroy_snapshot_now(cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None) -> None:
        """Through the SDK's blocking calls (no event loop at interpreter exit)."""
        destroy_snapshot_at_exit(snapshot, as_docker_config(config))

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Every container carrying the ``vf-sandbox.session`` label on the engine (see
        :func:`.container.list_sandboxes`).

        Raises:
            SandboxTransportError: the engine did not answer.
        """
        return await list_sandboxes(as_docker_config(config), cls.name)

    @classmethod
    async def shell_argv(
        cls, info: SandboxInfo, config: RuntimeConfig | None = None, *, tty: bool
    ) -> list[str]:
        """``docker exec -i [-t] -w WORKDIR ID /bin/sh`` (see :mod:`.shell`).

        Raises:
            SandboxFileNotFoundError: the docker CLI is not installed.
            SandboxUnavailableError: the container is gone or not running.
            SandboxTransportError: the engine did not answer.
        """
        from .shell import docker_shell_argv

        return await docker_shell_argv(info, as_docker_config(config), tty=tty)

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Force-remove one container :meth:`list_sandboxes` found, gone already is fine
        (see :func:`.container.destroy_sandbox`).

        Raises:
            SandboxTransportError: the engine did not answer.
            SandboxError: the engine refused to remove it.
        """
        await destroy_sandbox(info, as_docker_config(config))


class DockerRuntime(BackendRuntime):
    """The runtime over :class:`DockerBackend` (``open_runtime({"type": "docker", ...})``):
    a Docker container as a sandbox, owned or attached to a running one."""

    backend_class = DockerBackend
    backend: DockerBackend

    @property
    def attached(self) -> bool:
        """Whether this runtime borrows a container it did not create."""
        return self.backend.attached

    async def host_port(self, port: int, protocol: str = "tcp") -> tuple[str, int]:
        """``(host, port)`` where the engine published container ``port`` (config ``ports``).

        Raises:
            SandboxInvalidArgumentError: the port is not published.
            SandboxUnavailableError: the sandbox is closed or its container is gone.
        """
        self._check_open()
        return await self.backend.host_port(port, protocol)
