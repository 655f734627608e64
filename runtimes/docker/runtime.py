"""The ``docker`` runtime: one container per sandbox, driven through the Engine API.

Owned sandboxes: :meth:`DockerRuntime.start` creates a container from ``image`` with a
keep-alive command, vf-sandbox labels (:mod:`runtimes.ownership`), no network by default,
``docker-init`` as PID 1 when the engine has it, and the workdir; ``close()`` removes it.
Attach mode (``container=``): commands and files go to a running container the caller
owns; ``close()`` leaves it running and untouched.

Commands run through ``exec_create`` + a hijacked ``exec_start`` connection
(:mod:`.stream`), with the 8-byte stream headers demultiplexed as output arrives and stdin
streamed then half-closed. Each command starts through the one exec wrapper
(:mod:`.process`, :mod:`runtimes.wrapper`), which reports its PID, the command's process
group: ``timeout=``, the output cap and cancellation kill the whole tree with a second exec
(``kill -9 -PGID``). Images therefore need ``/bin/sh``. The channel (routing, fallback,
restart) is the base's; this class supplies the agent's transport and the plain paths.

Files go through the archive API (:mod:`.files`) when the sandbox's default user is root;
with a non-root user they go through exec as that user, so permissions mean what they mean
for the user's commands.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from .._extract import Links
from .._local_files import tar_directory
from ..base import Runtime
from ..channel import ChannelHooks, ChannelTransport
from ..channel.agent.wire import SweepHeader
from ..config import RuntimeConfig
from ..errors import (
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from ..limits import creation_rate
from ..models import ExecRequest, OutputSink, SandboxInfo
from ..reaper import remove_in_background
from ..routes import HostRoute, RouteKind
from ..snapshot import SandboxSnapshot
from ..sweep import MARK_VAR, sweep_argv
from .agent import (
    judge_untrusted,
    open_agent_stream,
    sweep_by_agent,
    untrusted_change,
    untrusted_python,
)
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
from .files import ContainerArchive, read_by_exec, replace_by_exec, write_by_exec
from .network import host_gateway, host_routes, route_hint
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
from .snapshots import (
    check_snapshot_holds_the_workdir,
    commit_snapshot,
    destroy_snapshot,
    destroy_snapshot_at_exit,
    list_snapshots,
)

if TYPE_CHECKING:
    import docker


# ---------------------------------------------------------------------- the runtime


class DockerRuntime(Runtime):
    """A Docker container as a sandbox (owned, or attached to a running one)."""

    name = "docker"
    config_model = DockerConfig
    keep_supported = True
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
        self._untrusted_image: str | None = None
        """Why the image (a snapshot's) may hold an interpreter that is not the original
        image's: the channel never runs it (see :mod:`.snapshots`)."""
        self._init_is_pid1 = False
        self._halted = False
        """close(): the root agent killed every process but itself and docker-init."""

    @property
    def sandbox_id(self) -> str | None:
        """The container's full id, once created (or attached)."""
        return self._container_id

    @property
    def policy_user(self) -> str | None:
        """``policy_user`` (``vf-policy`` by default) in a container this runtime created
        whose default user is root; ``None`` otherwise (an attached container is not ours to
        add accounts to; a non-root default user cannot become another)."""
        if not self._owned or not self.config.policy_user:
            return None
        return self.config.policy_user if is_root_user(self._default_user) else None

    def _makes_accounts(self) -> bool:
        return not self.config.read_only  # a read-only /etc takes no new account

    @property
    def attached(self) -> bool:
        """Whether this runtime borrows a container it did not create."""
        return not self._owned

    # ------------------------------------------------------------------ lifecycle

    def _live_cap(self) -> int | None:
        """A container this runtime creates takes a slot under ``max_live`` (process-wide)."""
        return self.config.max_live if self._owned else None

    async def _before_start(self) -> None:
        """Before creating, waits (cancellably) for the ``creations_per_second`` pace."""
        if self._owned:
            await creation_rate(self.name).wait(self.config.creations_per_second)

    def keeps_sandbox(self) -> bool:
        return not self._owned

    def _channel_hooks(self) -> ChannelHooks:
        return ChannelHooks(
            open_transport=self._open_agent_stream,
            kill_group=self._kill_group,
            lost_means_dead=self._died_with_container,
            probe_dead=self._stopped,
            verify_agent=self._verify_agent_files,
            verify_first=self._verify_attached_python,
        )

    def _channel_stall_timeout(self) -> float | None:
        return self.config.api_timeout

    async def _start(self) -> str:
        try:
            self._client = await engine_call(
                lambda: client_for(self.config), self.config, idempotent=True
            )
        except SandboxTransportError as exc:
            raise ProvisioningError(f"cannot reach {engine_name(self.config)}: {exc}") from exc
        container = None
        if self._owned:
            workdir, container = await self._create_container()
        else:
            workdir = await self._attach()
        failures: list[Exception] = []
        async with anyio.create_task_group() as tg:
            # The channel's agent boots (tens of milliseconds) while the engine confirms
            # that the container runs and the workdir is prepared.
            tg.start_soon(self._start_channel)
            try:
                await self._confirm_ready(container, workdir)
            except Exception as exc:  # noqa: BLE001 - raised below, outside the task group
                failures.append(exc)
                tg.cancel_scope.cancel()
        if failures:
            raise failures[0]
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

    async def _create_container(self) -> tuple[str, Any]:
        """Create and start the container (see :func:`.container.create_container`); return
        the workdir and the SDK's container (not yet confirmed running)."""
        client = self._require_client()
        made = await creation_config(client, self.config, self._snapshot_source)
        self._untrusted_image = made.untrusted
        container, self._init_is_pid1 = await create_container(
            client,
            made,
            self.name,
            fork=self._snapshot_source is not None,
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
        await prepare_workdir(self._run, workdir, owner, need_dir, self.describe())

    def _removes_container(self) -> bool:
        """Whether close() removes the container: one this runtime created and does not keep."""
        return self._owned and not self._keep and self._container_id is not None

    async def _close_channel(self) -> None:
        # Before the stream goes: the root agent kills everything but itself and
        # docker-init (whose child, the keep-alive, dies with the rest: the container stops).
        # Without docker-init, PID 1 is the keep-alive loop, which would start a new
        # `sleep` from the sandbox's files: then close() removes the container itself.
        if (
            self._removes_container()
            and self._init_is_pid1
            and self._channel_supervisor is not None
        ):
            self._halted = await self._channel_supervisor.halt()
        await super()._close_channel()

    async def _close(self) -> None:
        """Remove the container: in the background (:mod:`runtimes.reaper`) when the root
        agent killed every process of it (:meth:`_close_channel`), nothing of it running any
        more; else here, on the caller's path (the engine kills and removes it)."""
        if not (self._removes_container() and self._client is not None):
            return
        if self._halted:
            self._remove_in_background()
        else:
            await engine_call(self._remove_blocking, self.config, idempotent=True)

    def _remove_in_background(self) -> None:
        remove_in_background(
            self.describe(), lambda: retried_in_this_thread(self._remove_blocking, self.config)
        )

    def _remove_blocking(self) -> None:
        remove_container_blocking(self._require_client().api, self._require_id(), self.describe())

    def close_at_exit(self) -> None:
        """atexit backstop: remove the container synchronously through the SDK."""
        self._close_channel_now()
        try:
            if self._removes_container() and self._client is not None:
                self._remove_blocking()
        finally:
            self._mark_closed()

    def _host_routes(self) -> tuple[RouteKind, ...]:
        return host_routes(self.config)

    def _route_hint(self) -> str:
        return route_hint(self.config)

    async def _host_bind_address(self, via: RouteKind) -> str:
        return "127.0.0.1" if via != "gateway" else await host_gateway(self)

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        if via == "loopback":
            return HostRoute("loopback", "127.0.0.1", port)
        return HostRoute("gateway", await host_gateway(self), port)

    async def host_port(self, port: int, protocol: str = "tcp") -> tuple[str, int]:
        """``(host, port)`` where the engine published container ``port`` (config ``ports``).

        Raises:
            SandboxInvalidArgumentError: the port is not published.
            SandboxUnavailableError: the sandbox is closed or its container is gone.
        """
        self._check_open()
        info = await inspect_container(self._ref())
        where = engine_host(self.config.base_url)
        return published_address(info, port, protocol, self.describe(), where)

    async def _alive(self) -> bool:
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

    async def stop_processes(self) -> int:
        """Kill every process commands started that is still running; return how many.

        In a container this runtime created, that is every process outside the
        keep-alive's session, however it detached itself (``setsid``, ``env -i``). In an
        attached container, only processes carrying this runtime's environment mark are
        killed (the container's own processes are not ours). It works at the container's
        process limit (``pids_limit``) while the channel's root agent runs: the agent sweeps
        itself, forking nothing; without it the sweep is a script, which needs to fork.

        Raises:
            SandboxUnavailableError: the sandbox is closed, stopped or removed.
            SandboxError: the sweep failed (with the script: it could not fork at the
                process limit, say; its stderr attached).
        """
        if not self._owned:
            return await super().stop_processes()
        self._check_open()
        # Every exec is a session of its own (docker exec calls setsid); the keep-alive and
        # init are session 1. So in an owned container "every process not in session 1" is
        # exactly what commands started, including daemons that double-forked or scrubbed
        # their environment. The agent (a session leader, by docker exec) is spared.
        mark = f"{MARK_VAR}={self._mark}"
        with self._guard("stop_processes"):
            killed = await self._sweep_by_agent(SweepHeader("all", mark))
            if killed is not None:
                return killed
            agent = self._channel_agent_pid()
            request, sink = own_request(sweep_argv("all", mark, keep=agent), user="0")
            code = await self._run(request, sink)
        return self._swept(code, sink)

    async def _sweep_by_agent(self, header: SweepHeader) -> int | None:
        """The channel agent's sweep (see :func:`.agent.sweep_by_agent`)."""
        return await sweep_by_agent(self._supervisor, header)

    # ------------------------------------------------------------------ exec

    def _check_request(self, request: ExecRequest) -> None:
        """The sandbox's user is the ceiling (see :func:`.process.check_user_ceiling`)."""
        check_user_ceiling(request, self._default_user)

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        return await self._run(request, sink)

    async def _memory_kill(self, since: float) -> str | None:
        return await memory_kill_setting(self._ref(), since)

    async def _run(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run a command (the runtime's own ones too, which may use root)."""
        if self._orphans:
            await self._kill_orphans()
        return await run_exec(
            self._ref(),
            request,
            sink,
            kill_group=self._kill_group,
            died=self._died_with_container,
            lost=self._remember_orphan,
        )

    async def _kill_group(self, pid: int | None) -> None:
        """Kill a command's process group (see :func:`.process.kill_group`); a kill that
        could not be delivered is retried before the next command."""
        if pid is not None and not await kill_group(self._ref(), pid):
            self._remember_orphan(pid)

    async def _kill_orphan_groups(self, pgids: frozenset[int]) -> None:
        """Kill the process groups earlier kills missed, if their leader still carries this
        runtime's mark (a restarted container reuses pids).

        Raises:
            SandboxError: the kill could not be delivered.
        """
        await kill_orphan_groups(self._ref(), f"{MARK_VAR}={self._mark}", pgids)

    async def _open_agent_stream(self, interpreter: str | None = None) -> ChannelTransport:
        return await open_agent_stream(self._ref(), interpreter)

    async def _verify_agent_files(self, digests: Mapping[str, bytes]) -> str | None:
        """Before the channel agent restarts: the engine's own diff of the container against
        its image (no sandbox code runs) shows no change to the files the first agent ran
        from, to the dynamic loader's configuration, or to a shared library. The image is
        trusted; whatever a command changed in those places is not."""
        return untrusted_change(await changed_paths(self._ref()), digests)

    async def system_tampered(self) -> str | None:
        """The engine's diff against the image: a changed loader preload/configuration or
        judge shell (:func:`.agent.judge_untrusted`). Reads nothing in the sandbox."""
        return judge_untrusted(await changed_paths(self._ref()))

    async def _verify_attached_python(self) -> str | None:
        """Before the first agent starts in a container this runtime did not create
        (commands may have run there: a rollout's): no ``python*`` anywhere and no system
        library changed since the image (the engine's diff). A container of our own is new;
        a fork's image is a snapshot, checked when it was taken (:mod:`.snapshots`)."""
        if self._owned:
            return self._untrusted_image
        return untrusted_python(await changed_paths(self._ref()))

    async def _stopped(self) -> bool:
        return await is_stopped(self._ref())

    async def _died_with_container(self) -> bool:
        """After a command died of SIGKILL: was that the container going down? (See
        :func:`.process.died_with_container`.)"""
        return await died_with_container(self._run, self._alive, self.describe())

    # ------------------------------------------------------------------ files

    def _archive(self) -> ContainerArchive:
        return ContainerArchive(self._ref())

    async def _read(self, path: str, limit: int) -> bytes:
        if not self._files_as_root:
            return await read_by_exec(self._run, path, limit)
        archive = self._archive()
        return await engine_call(
            lambda: archive.read_blocking(path, limit), self.config, idempotent=True
        )

    async def _write(self, path: str, data: bytes) -> None:
        if not self._files_as_root:
            await write_by_exec(self._run, path, data)
            return
        archive = self._archive()
        temp, target = await engine_call(
            lambda: archive.write_temp_blocking(path, data), self.config
        )
        await replace_by_exec(self._run, temp, target, path)

    async def _exists(self, path: str) -> bool:
        if not self._files_as_root:
            return await super()._exists(path)
        archive = self._archive()
        return await engine_call(
            lambda: archive.exists_blocking(path), self.config, idempotent=True
        )

    async def _upload(self, source: Path, remote: str) -> None:
        if not self._files_as_root or await anyio.Path(source).is_file():
            await super()._upload(source, remote)
            return
        tree = await anyio.to_thread.run_sync(
            functools.partial(tar_directory, source, root_owned=True)
        )
        archive = self._archive()
        await engine_call(lambda: archive.upload_tree_blocking(tree, remote), self.config)

    async def _download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        if not self._files_as_root:
            await super()._download(remote, local, skip_unsafe=skip_unsafe, links=links)
            return
        archive, limit = self._archive(), self.config.read_limit
        await engine_call(
            lambda: archive.download_blocking(remote, local, limit, skip_unsafe, links),
            self.config,
            idempotent=True,
        )

    # ------------------------------------------------------------------ files as a non-root user

    # ------------------------------------------------------------------ snapshots

    def _check_fork_config(self) -> None:
        """A fork is a container of our own, from the snapshot's image.

        Raises:
            SandboxInvalidArgumentError: the config attaches to a ``container``.
        """
        if not self._owned:
            raise SandboxInvalidArgumentError(
                f"a docker sandbox opened from a snapshot is a new container: drop "
                f"container={self.config.container!r} from its config"
            )

    async def _snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
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
        if inherited is None and self._snapshot_source is not None:
            inherited = self._snapshot_source.untrusted
        # With a policy account of its own for its whole life, nothing but the host's own
        # (root) commands could change the system files: no diff to read.
        check = not (self._owned and self.policy_user is not None)
        async with self._snapshot_lock:
            return await commit_snapshot(self._ref(), labels, inherited, check=check)

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """Every image carrying the ``vf-sandbox.snapshot`` label on the engine (see
        :func:`.snapshots.list_snapshots`)."""
        return await list_snapshots(as_docker_config(config))

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Remove a snapshot's image, gone already is fine (see
        :func:`.snapshots.destroy_snapshot`)."""
        await destroy_snapshot(snapshot, as_docker_config(config))

    @classmethod
    def _destroy_snapshot_at_exit(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None
    ) -> None:
        destroy_snapshot_at_exit(snapshot, as_docker_config(config))

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Every container carrying the ``vf-sandbox.session`` label on the engine (see
        :func:`.container.list_sandboxes`)."""
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
        (see :func:`.container.destroy_sandbox`)."""
        await destroy_sandbox(info, as_docker_config(config))
