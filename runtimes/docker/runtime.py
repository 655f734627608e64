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

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from .._extract import Links
from .._local_files import shell_error
from ..base import Runtime
from ..channel import ChannelHooks, ChannelTransport
from ..channel.agent.wire import SweepHeader
from ..config import RuntimeConfig
from ..errors import (
    HostRouteError,
    OutputLimitExceededError,
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxTransportError,
    SandboxUnavailableError,
    cannot_run_as,
)
from ..limits import creation_rate
from ..machinery import run_machinery
from ..models import ExecRequest, OutputSink, SandboxInfo
from ..reaper import remove_in_background, wait_for_removals, wait_for_removals_blocking
from ..routes import HostRoute, RouteKind
from ..scripts import load
from ..snapshot import UNTRUSTED, SandboxSnapshot, SnapshotUnsupportedError
from ..sweep import MARK_VAR, ORPHAN_KILL_SCRIPT, sweep_argv
from ..wrapper import ReportReader, new_nonce
from .agent import _untrusted_change, _untrusted_python, judge_untrusted, open_agent_stream
from .build import ensure_built
from .client import (
    KILL_WAIT,
    _api_message,
    _blocking,
    _client_for,
    _ContainerRef,
    _engine_has_init,
    _engine_name,
    changed_paths,
    check_running,
    inspect_container,
    is_running,
    kill_as_root,
    list_labelled_blocking,
    remove_container_blocking,
    retried_in_this_thread,
)
from .config import DEFAULT_WORKDIR, DockerConfig
from .container import (
    check_image,
    confirm_running_blocking,
    container_options,
    create_and_start_blocking,
    inspect_attached,
)
from .files import _ContainerArchive, _tree_tar
from .network import _is_local_address, gateway_from_route_table
from .oom import memory_kill_setting
from .ports import engine_host, published_address
from .process import (
    _engine_exec_error,
    _ExecOutput,
    await_announcement,
    start_exec,
    wait_for_exit,
    watch_exit,
)
from .snapshots import (
    commit_snapshot,
    list_snapshot_images_blocking,
    remove_snapshot_image_blocking,
    snapshot_image_config,
)
from .stream import _close_exec_stream, _open_exec_stream, _pump, _start_stdin

if TYPE_CHECKING:
    import docker
    import docker.errors

    from ..channel.core import Channel

log = logging.getLogger("runtimes.docker")

_SCRIPTS = "runtimes.docker.scripts"
_KILL_GROUP = load("kill_group", _SCRIPTS)
_READ_SCRIPT = load("read", _SCRIPTS)
_WRITE_SCRIPT = load("write", _SCRIPTS)
_REPLACE_SCRIPT = load("replace", _SCRIPTS)
_MKDIRS_SCRIPT = load("mkdirs", _SCRIPTS)

_SIGKILLED = 128 + 9
_DEATH_WATCH = 3.0
"""Seconds to wait for the engine to report a container stop after a failed probe."""


def _is_root_user(user: str | None) -> bool:
    if not user:
        return True
    name = user.split(":", 1)[0]
    return name in ("root", "0")


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
        return self.config.policy_user if _is_root_user(self._default_user) else None

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

    def _keeps_sandbox(self) -> bool:
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
            self._client = await _blocking(
                lambda: _client_for(self.config), self.config, idempotent=True
            )
        except SandboxTransportError as exc:
            raise ProvisioningError(f"cannot reach {_engine_name(self.config)}: {exc}") from exc
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
                await _blocking(
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
        """Create and start the container; return the workdir and the SDK's container (not
        yet confirmed running: see ``confirm_running_blocking``)."""
        client = self._require_client()
        cfg, image_user = await self._creation_config()
        try:
            init = cfg.init
            if init is None:
                init = await _blocking(lambda: _engine_has_init(client), cfg, idempotent=True)
            options = container_options(
                cfg, self.name, init, fork=self._snapshot_source is not None
            )
            if not _is_root_user(image_user):
                # Under no-new-privileges a root exec gains no capability from a container
                # started as another user (root could not even chown the workdir): the
                # keep-alive runs as root, commands as the image's user (``_ContainerRef.user``).
                options["user"] = "0"
            self._init_is_pid1 = bool(init)
            container = await _blocking(
                lambda: create_and_start_blocking(client, cfg, options, self._record_container),
                cfg,
            )
        except SandboxTransportError as exc:
            raise ProvisioningError(f"cannot create a container from {cfg.image!r}: {exc}") from exc
        self._default_user = cfg.user or image_user or None
        self._files_as_root = _is_root_user(self._default_user)
        return cfg.workdir or DEFAULT_WORKDIR, container

    async def _creation_config(self) -> tuple[DockerConfig, str]:
        """The config to create the container with (a fork's names its snapshot's image,
        never pulled) and the image's configured user ("" for root), once the engine showed
        the image is there (pulled as ``pull`` says).

        Raises:
            ProvisioningError: the image is missing (see ``check_image``), or building it
                from ``build`` failed (see ``ensure_built``).
            BuildContextError: ``build``'s context is refused.
            SnapshotNotFoundError: the snapshot's image is gone.
        """
        client, snap = self._require_client(), self._snapshot_source
        if snap is None and self.config.build is not None:
            built = await ensure_built(client, self.config)
            cfg = self.config.model_copy(update={"image": built})
            return cfg, await check_image(client, cfg)
        if snap is None:
            return self.config, await check_image(client, self.config)
        settings = await snapshot_image_config(client, snap, self.config)
        labels = settings.get("Labels") or {}
        self._untrusted_image = labels.get(UNTRUSTED) or None
        cfg = self.config.model_copy(update={"image": snap.id, "pull": "never"})
        return cfg, str(settings.get("User") or "")

    def _record_container(self, container_id: str | None) -> None:
        self._container_id = container_id

    async def _attach(self) -> str:
        cfg = self.config
        info = await inspect_attached(self._require_client(), cfg)
        self._container_id = str(info["Id"])
        settings = info.get("Config") or {}
        self._default_user = cfg.user or settings.get("User") or None
        self._files_as_root = _is_root_user(self._default_user)
        return cfg.workdir or settings.get("WorkingDir") or "/"

    async def _prepare(self, workdir: str) -> None:
        """Readiness. An owned container running as root is ready once it runs: the
        engine created the workdir (``working_dir``). Otherwise one exec creates the
        workdir, owned by the sandbox's default user, which also proves exec works."""
        owner = "" if _is_root_user(self._default_user) else self._default_user
        if self._owned and not owner:
            return
        need_dir = self._owned or self.config.workdir is not None
        argv = ["sh", "-c", _MKDIRS_SCRIPT, "sh", workdir, owner or ""] if need_dir else ["true"]
        request, sink = self._request(argv, user="0")
        code = await self._run(request, sink)
        if code != 0:
            raise ProvisioningError(
                f"{self.describe()}: preparing {workdir!r} failed ({code}): "
                f"{bytes(sink.stderr).decode('utf-8', 'replace').strip()}"
            )

    def _removes_container(self) -> bool:
        """Whether close() removes the container: one this runtime created and does not keep."""
        return self._owned and not self._keep and self._container_id is not None

    async def _close_channel(self) -> None:
        # Before the stream goes: the root agent kills everything but itself and
        # docker-init (whose child, the keep-alive, dies with the rest: the container stops).
        # Without docker-init, PID 1 is the keep-alive loop, which would start a new
        # `sleep` from the sandbox's files: then close() removes the container itself.
        if self._removes_container() and self._init_is_pid1 and self._channel is not None:
            self._halted = await self._channel.halt()
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
            await _blocking(self._remove_blocking, self.config, idempotent=True)

    def _remove_in_background(self) -> None:
        remove_in_background(
            self.describe(), lambda: retried_in_this_thread(self._remove_blocking, self.config)
        )

    def _remove_blocking(self) -> None:
        remove_container_blocking(self._require_client().api, self._require_id(), self.describe())

    def _close_at_exit(self) -> None:
        """atexit backstop: remove the container synchronously through the SDK."""
        self._close_channel_now()
        try:
            if self._removes_container() and self._client is not None:
                self._remove_blocking()
        finally:
            self._mark_closed()

    def _host_routes(self) -> tuple[RouteKind, ...]:
        if self.config.network == "host":
            return ("loopback",)  # the host's loopback as it is: no relay hop
        return () if self.config.network == "none" else ("gateway",)

    def _route_hint(self) -> str:
        if self.config.network == "none":
            return (
                "network='none' has only the channel route (python3 in the image, "
                "channel=True); the gateway route needs network='bridge' or a named network"
            )
        return "the channel route needs python3 in the image and channel=True"

    async def _host_bind_address(self, via: RouteKind) -> str:
        if via != "gateway":
            return "127.0.0.1"
        return await self._host_gateway()

    async def _host_gateway(self) -> str:
        """The container's IPv4 default gateway (``/proc/net/route``), if it is an address
        of this host (so a service can listen on it).

        Raises:
            HostRouteError: no default route, or the gateway is not this host's (a remote
                engine).
        """
        table = await run_machinery(self, ["cat", "/proc/net/route"], timeout=30)
        gateway = gateway_from_route_table(table.stdout) if table.exit_code == 0 else None
        if gateway is None:
            raise HostRouteError(
                f"{self.describe()} has no default gateway: no gateway route to the host",
                via="gateway",
            )
        if not _is_local_address(gateway):
            raise HostRouteError(
                f"{self.describe()} routes through {gateway}, which is not an address of this "
                "host (a remote engine?): use the channel route",
                via="gateway",
            )
        return gateway

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        if via == "loopback":
            return HostRoute("loopback", "127.0.0.1", port)
        return HostRoute("gateway", await self._host_gateway(), port)

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

    def _ref(self) -> _ContainerRef:
        return _ContainerRef(
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
            request, sink = self._request(sweep_argv("all", mark, keep=agent), user="0")
            code = await self._run(request, sink)
        return self._swept(code, sink)

    async def _sweep_by_agent(self, header: SweepHeader) -> int | None:
        """How many processes the channel's agent killed sweeping as ``header`` says;
        ``None`` when no trusted root agent runs (one of another user could not signal the
        others' processes) or the channel died meanwhile: the sweep script serves then.

        Raises:
            SandboxError: the agent's sweep failed.
        """
        channel = self._supervisor
        if channel is None:
            return None

        async def by_agent(chan: Channel) -> int | None:
            hello = chan.hello
            if hello is None or hello.uid != 0:
                return None
            return await chan.sweep(header)

        async def by_script() -> int | None:
            return None

        # The supervisor's routing of an idempotent call (restart, fallback, distrust);
        # a public ChannelSupervisor.sweep would wrap exactly this.
        return await channel._file_call(by_agent, by_script, "stop_processes", idempotent=True)

    # ------------------------------------------------------------------ exec

    def _request(
        self,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        limit: int = 1 << 20,
        user: str | None = None,
    ) -> tuple[ExecRequest, OutputSink]:
        """A request for the runtime's own commands (cwd ``/``, so a deleted workdir
        cannot break them)."""
        request = ExecRequest(
            argv=tuple(argv),
            cwd="/",
            env={},
            stdin=stdin,
            user=user,
            timeout=None,
            output_limit=limit,
        )
        return request, OutputSink(limit)

    def _check_request(self, request: ExecRequest) -> None:
        """docker exec could become root in any container; a sandbox configured to run as a
        non-root user keeps that as its ceiling, like any other backend (on both paths: the
        base checks before the channel, whose agent would only refuse).

        Raises:
            SandboxPermissionError: ``request.user`` is root and the sandbox's user is not.
        """
        if (
            request.user is not None
            and _is_root_user(request.user)
            and not _is_root_user(self._default_user)
        ):
            raise cannot_run_as(
                request.argv[0], request.user, f"the sandbox runs as {self._default_user!r}"
            )

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        return await self._run(request, sink)

    async def _memory_kill(self, since: float) -> str | None:
        return await memory_kill_setting(self._ref(), since)

    async def _run(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run a command (the runtime's own ones too, which may use root)."""
        if self._orphans:
            await self._kill_orphans()
        with anyio.CancelScope(shield=True):
            # Once the engine started the command, nothing may lose the handle on it.
            nonce = new_nonce()
            hijacked = await start_exec(self._ref(), request, nonce)
            stream = await _open_exec_stream(hijacked)
        output = _ExecOutput(sink, ReportReader(nonce))
        try:
            if hijacked.leftover:
                output.feed(hijacked.leftover)
            async with anyio.create_task_group() as tg:
                _start_stdin(tg, stream, request.stdin, sink)
                tg.start_soon(watch_exit, self._ref(), hijacked.exec_id, output)
                await _pump(stream, output)
                tg.cancel_scope.cancel()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await await_announcement(stream, output)
                await _close_exec_stream(stream, hijacked)
                if not sink.detached:  # else the command exited: what is left is the sweep's
                    await self._kill_group(output.pgid)
            raise
        with anyio.CancelScope(shield=True):
            await _close_exec_stream(stream, hijacked)
        try:
            return await self._exit_code(hijacked.exec_id, output, request)
        except SandboxTransportError:
            if output.pgid is not None:  # lost track of a command that may still run
                self._remember_orphan(output.pgid)
            raise

    async def _kill_group(self, pid: int | None) -> None:
        """Kill a command's process group inside the container, and wait for the kill; a
        kill that could not be delivered is retried before the next command.

        Runs after the command's stream was closed: the engine handles one container's
        exit events in order, and the exit of a command whose output nobody reads waits
        for its stream, so the kill's own exit could wait behind it.
        """
        if pid is None:
            return
        try:
            await kill_as_root(self._ref(), ["sh", "-c", _KILL_GROUP, "sh", str(pid)])
        except SandboxError as exc:
            log.warning(
                "could not kill process group %s in %s (retried before the next command): %s",
                pid,
                self.describe(),
                exc,
            )
            self._remember_orphan(pid)

    async def _kill_orphan_groups(self, pgids: frozenset[int]) -> None:
        """Kill the process groups earlier kills missed, if their leader still carries this
        runtime's mark (a restarted container reuses pids).

        Raises:
            SandboxError: the kill could not be delivered.
        """
        mark = f"{MARK_VAR}={self._mark}"
        await kill_as_root(
            self._ref(), ["sh", "-c", ORPHAN_KILL_SCRIPT, "sh", mark, *map(str, sorted(pgids))]
        )

    async def _exit_code(self, exec_id: str, output: _ExecOutput, request: ExecRequest) -> int:
        import docker.errors

        report = output.report
        if report is not None and not report.ok:
            raise report.error(request, where=self.describe())
        if report is None:
            await check_running(self._ref())
            raise _engine_exec_error(output.engine_text, request, self.describe())
        try:
            info = await wait_for_exit(self._ref(), exec_id)
        except docker.errors.APIError as exc:
            await check_running(self._ref())
            raise SandboxError(
                f"{self.describe()}: lost track of a command: {_api_message(exc)}"
            ) from exc
        code = info.get("ExitCode")
        if code is None or code >= 128:
            await check_running(self._ref())
        if code is None:
            raise SandboxError(f"{self.describe()}: the engine reported no exit code")
        if code == _SIGKILLED and await self._died_with_container():
            raise SandboxUnavailableError(
                f"{self.describe()} died while running {request.argv[0]!r}"
            )
        return int(code)

    async def _open_agent_stream(self, interpreter: str | None = None) -> ChannelTransport:
        return await open_agent_stream(self._ref(), interpreter)

    async def _verify_agent_files(self, digests: Mapping[str, bytes]) -> str | None:
        """Before the channel agent restarts: the engine's own diff of the container against
        its image (no sandbox code runs) shows no change to the files the first agent ran
        from, to the dynamic loader's configuration, or to a shared library. The image is
        trusted; whatever a command changed in those places is not."""
        return _untrusted_change(await changed_paths(self._ref()), digests)

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
        return _untrusted_python(await changed_paths(self._ref()))

    async def _stopped(self) -> bool:
        """The channel's probe during a silence: stopped, paused or removed."""
        import docker.errors

        try:
            return not await self._alive()
        except docker.errors.APIError as exc:
            log.debug("%s: inspect failed during a channel probe: %s", self.describe(), exc)
            return False

    async def _died_with_container(self) -> bool:
        """After a command died of SIGKILL: was that the container going down?

        A killed or stopped container takes its commands with it (SIGKILL), and the
        engine may still call it running for a moment. A probe exec settles it: it works
        in a live container and fails in a dying one; if it fails, the container's state
        is watched (bounded) for the stop the engine is about to report.
        """
        from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_fixed

        request, sink = self._request(["true"], user="0")
        try:
            with anyio.fail_after(KILL_WAIT):
                if await self._run(request, sink) == 0:
                    return False
        except SandboxUnavailableError:
            return True
        except (SandboxError, TimeoutError) as exc:
            log.debug("probe after SIGKILL failed in %s: %s", self.describe(), exc)
        watching = AsyncRetrying(
            retry=retry_if_result(lambda running: running),
            stop=stop_after_delay(_DEATH_WATCH),
            wait=wait_fixed(0.05),
            sleep=anyio.sleep,
            retry_error_callback=lambda state: True,
        )
        running: bool = await watching(self._alive)
        return not running

    # ------------------------------------------------------------------ files

    def _archive(self) -> _ContainerArchive:
        return _ContainerArchive(self._ref())

    async def _read(self, path: str, limit: int) -> bytes:
        if not self._files_as_root:
            return await self._read_by_exec(path, limit)
        archive = self._archive()
        return await _blocking(
            lambda: archive.read_blocking(path, limit), self.config, idempotent=True
        )

    async def _write(self, path: str, data: bytes) -> None:
        if not self._files_as_root:
            await self._write_by_exec(path, data)
            return
        archive = self._archive()
        temp, target = await _blocking(lambda: archive.write_temp_blocking(path, data), self.config)
        await self._replace(temp, target, path)

    async def _replace(self, temp: str, target: str, shown: str) -> None:
        """Rename the uploaded temporary file over the target (one exec)."""
        request, sink = self._request(["sh", "-c", _REPLACE_SCRIPT, "sh", temp, target])
        code = await self._run(request, sink)
        if code != 0:
            raise shell_error(shown, sink)

    async def _exists(self, path: str) -> bool:
        if not self._files_as_root:
            return await super()._exists(path)
        archive = self._archive()
        return await _blocking(lambda: archive.exists_blocking(path), self.config, idempotent=True)

    async def _upload(self, source: Path, remote: str) -> None:
        if not self._files_as_root or await anyio.Path(source).is_file():
            await super()._upload(source, remote)
            return
        tree = await anyio.to_thread.run_sync(_tree_tar, source)
        archive = self._archive()
        await _blocking(lambda: archive.upload_tree_blocking(tree, remote), self.config)

    async def _download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        if not self._files_as_root:
            await super()._download(remote, local, skip_unsafe=skip_unsafe, links=links)
            return
        archive, limit = self._archive(), self.config.read_limit
        await _blocking(
            lambda: archive.download_blocking(remote, local, limit, skip_unsafe, links),
            self.config,
            idempotent=True,
        )

    # ------------------------------------------------------------------ files as a non-root user

    async def _read_by_exec(self, path: str, limit: int) -> bytes:
        request, sink = self._request(
            ["sh", "-c", _READ_SCRIPT, "sh", path, str(limit)], limit=limit + 1
        )
        code = await self._run(request, sink)
        if code == 21:
            raise SandboxIsADirectoryError(path)
        if code == 27 or sink.overflowed:
            raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
        if code != 0:
            raise shell_error(path, sink)
        return bytes(sink.stdout)

    async def _write_by_exec(self, path: str, data: bytes) -> None:
        request, sink = self._request(["sh", "-c", _WRITE_SCRIPT, "sh", path], stdin=data)
        code = await self._run(request, sink)
        if code == 21:
            raise SandboxIsADirectoryError(path)
        if code == 20:
            raise SandboxNotADirectoryError(path, "a parent is not a directory")
        if code != 0:
            raise shell_error(path, sink)

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
        self._check_snapshot_holds_the_workdir()
        inherited = self._untrusted_image
        if inherited is None and self._snapshot_source is not None:
            inherited = self._snapshot_source.untrusted
        # With a policy account of its own for its whole life, nothing but the host's own
        # (root) commands could change the system files: no diff to read.
        check = not (self._owned and self.policy_user is not None)
        async with self._snapshot_lock:
            return await commit_snapshot(self._ref(), labels, inherited, check=check)

    def _check_snapshot_holds_the_workdir(self) -> None:
        """Refuse a snapshot that would silently lose the workdir and ``/tmp``: with
        ``disk`` or ``read_only`` they are anonymous volumes, and a commit holds only the
        container's own layer (a fork would start with both empty).

        Raises:
            SnapshotUnsupportedError: the config has ``disk`` or ``read_only``.
        """
        cfg = self.config
        why = [
            name
            for name, on in (("disk", cfg.disk is not None), ("read_only", cfg.read_only))
            if on
        ]
        if why:
            raise SnapshotUnsupportedError(
                f"{self.describe()} cannot be snapshotted: with {' and '.join(why)} its "
                "workdir and /tmp are volumes, which the engine's commit leaves out (a fork "
                "would start with both empty); copy what you need with rt.download(), or "
                "run without disk/read_only to snapshot"
            )

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """Every image carrying the ``vf-sandbox.snapshot`` label on the engine.

        Raises:
            SandboxTransportError: the engine did not answer (after retries).
        """
        cfg = config if isinstance(config, DockerConfig) else DockerConfig()
        return await _blocking(
            lambda: list_snapshot_images_blocking(_client_for(cfg).api), cfg, idempotent=True
        )

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Remove a snapshot's image (gone already is fine).

        Raises:
            SandboxInvalidArgumentError: the image is not a vf-sandbox snapshot.
            SandboxError: a container (a sandbox opened from it) still uses it.
            SandboxTransportError: the engine did not answer (after retries).
        """
        cfg = config if isinstance(config, DockerConfig) else DockerConfig()
        await wait_for_removals()  # forks closed just before may still hold the image
        await _blocking(
            lambda: remove_snapshot_image_blocking(_client_for(cfg).api, snapshot),
            cfg,
            idempotent=True,
        )

    @classmethod
    def _destroy_snapshot_at_exit(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None
    ) -> None:
        cfg = config if isinstance(config, DockerConfig) else DockerConfig()
        wait_for_removals_blocking()
        remove_snapshot_image_blocking(_client_for(cfg).api, snapshot)

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Every container carrying the ``vf-sandbox.session`` label on the engine.

        Raises:
            SandboxTransportError: the engine did not answer (after retries).
        """
        cfg = config if isinstance(config, DockerConfig) else DockerConfig()

        return await _blocking(
            lambda: list_labelled_blocking(_client_for(cfg).api, cls.name), cfg, idempotent=True
        )

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

        cfg = config if isinstance(config, DockerConfig) else DockerConfig()
        return await docker_shell_argv(info, cfg, tty=tty)

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Force-remove one container found by :meth:`list_sandboxes` (gone already is fine).

        Raises:
            SandboxTransportError: the engine did not answer (after retries).
            SandboxError: the engine refused to remove it.
        """
        cfg = config if isinstance(config, DockerConfig) else DockerConfig()
        await _blocking(
            lambda: remove_container_blocking(
                _client_for(cfg).api, info.id, f"docker container {info.id}"
            ),
            cfg,
            idempotent=True,
        )
