"""The driver's side of a ray sandbox: :class:`RayRuntime`, the whole Runtime API forwarded to
the sandbox's actor (:class:`~runtimes.ray.host.SandboxHost`) on its node.

The driver keeps what the caller sees: argument checks, paths, timeouts, the output cap, the
``on_output`` order, the lifecycle. Everything that touches the sandbox runs on the node, in
the sandbox's own runtime: each call is one Ray actor call (:mod:`runtimes.ray.calls`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import posixpath
import sys
from collections.abc import AsyncIterable, Awaitable, Callable
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import anyio

from .. import ownership
from .._extract import Links
from .._local_files import tar_directory, untar_into, write_local_file
from ..base import Runtime
from ..channel.agent.wire import PathInfo
from ..cleanup import Sweep, SweepResult
from ..config import RuntimeConfig
from ..errors import (
    ChannelTamperedError,
    ProvisioningError,
    SandboxError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from ..models import ExecRequest, OutputSink, SandboxInfo
from ..registry import load_runtime_class, resolve_runtime_config
from ..routes import HostRoute, RouteKind
from ..snapshot import SandboxSnapshot
from ..stdin_feed import feed_stdin
from ..sweep import MARK_VAR
from . import calls
from .cluster import (
    RAY_KEEP,
    destroy_cluster_sandbox,
    list_cluster_sandboxes,
    list_cluster_snapshots,
    sweep_cluster,
)
from .config import RayConfig
from .host import Batch, CommandSpec, SandboxHost, Started
from .placement import (
    DRIVER,
    JOB,
    NODE,
    actor_options,
    destroy_snapshot_on_node,
    inner_snapshot,
    ray_snapshot,
)
from .routes import close_ticket, open_ticket
from .watch import NODES

__all__ = ["RayRuntime"]

log = logging.getLogger("runtimes.ray")

FEED_PIECE = 1 << 20
"""The largest piece of an incremental stdin one call hands the node."""

_CANCEL_WAIT = 15.0
"""Seconds a cancelled command waits for its node to confirm the kill."""


class RayRuntime(Runtime):
    """A sandbox on a Ray node (``{"type": "ray", "runtime": {...}}``; ``docs/ray.md``)."""

    name: ClassVar[str] = "ray"
    config_model: ClassVar[type[RuntimeConfig]] = RayConfig
    forwards_host_side: ClassVar[bool] = True
    config: RayConfig

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        inner = resolve_runtime_config(self.config.inner())
        self._inner_config = inner.model_dump(mode="json")
        self._inner_class = load_runtime_class(inner.type)
        self.snapshot_holds = self._inner_class.snapshot_holds  # type: ignore[misc]
        self._actor: Any = None
        self._started: Started | None = None
        self._watched = False
        self._calls = itertools.count()

    # ------------------------------------------------------------------ where it is

    @property
    def sandbox_id(self) -> str | None:
        return self._started.sandbox_id if self._started is not None else None

    @property
    def node_id(self) -> str | None:
        """The Ray node id of the node the sandbox lives on (``None`` before start)."""
        return self._started.node_id if self._started is not None else None

    @property
    def node_address(self) -> str | None:
        """That node's IP address."""
        return self._started.node_address if self._started is not None else None

    def lost(self) -> str | None:
        """Why the sandbox is known to be gone: the cluster listed its node dead
        (:mod:`runtimes.ray.watch`)."""
        if self._started is not None and NODES.dead(self._started.node_id):
            return f"its node {self._started.node_address} left the cluster"
        return None

    def describe(self) -> str:
        inner = self._inner_config["type"]
        if self._started is None:
            return f"ray sandbox ({inner}, not started)"
        return f"ray sandbox {self._started.sandbox_id} ({inner} on node {self.node_address})"

    # ------------------------------------------------------------------ calls

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One call to the actor, watched for a node that dies while it waits.

        Raises:
            SandboxUnavailableError: the node or the actor is gone, or stayed silent for
                ``dead_after`` seconds.
            SandboxTransportError: the call failed on the way, and the sandbox still answers.
        """
        actor = self._actor
        if actor is None:
            raise SandboxUnavailableError(f"{self.describe()} has no actor")
        what = f"{self.describe()}: {method}"
        if (lost := self.lost()) is not None:
            raise SandboxUnavailableError(f"{what}: {lost}")

        async def call() -> Any:
            return await calls.settle(getattr(actor, method).remote(*args, **kwargs), what)

        async def probe() -> object:
            if (lost := self.lost()) is not None:
                raise SandboxUnavailableError(f"{what}: {lost}")
            return await calls.settle(actor.ping.remote(), what)

        try:
            return await calls.watched(call, probe, what=what, dead_after=self.config.dead_after)
        except SandboxTransportError as exc:
            # Lost on the way: a node that died says so first as a broken connection.
            if not isinstance(exc, ChannelTamperedError):
                await self._confirm_alive(probe, what, exc)
            raise

    async def _confirm_alive(
        self, probe: Callable[[], Awaitable[object]], what: str, failure: SandboxTransportError
    ) -> None:
        """After a call failed on the way: return if the sandbox answers within
        ``dead_after`` seconds, else raise :class:`SandboxUnavailableError`."""
        deadline = anyio.current_time() + self.config.dead_after
        while anyio.current_time() < deadline:
            if self.node_id is not None and not await calls.node_alive(self.node_id):
                raise SandboxUnavailableError(f"{what}: the sandbox's node is gone") from failure
            try:
                with anyio.fail_after(max(0.1, deadline - anyio.current_time())):
                    await probe()
                return
            except TimeoutError:
                break
            except SandboxUnavailableError as exc:
                raise exc from failure
            except SandboxTransportError:
                await anyio.sleep(0.5)
        raise SandboxUnavailableError(
            f"{what}: the sandbox's node did not answer for {self.config.dead_after:g} s"
        ) from failure

    async def _idempotent(self, method: str, *args: Any) -> Any:
        return await calls.retried(lambda: self._call(method, *args), self.config.retries)

    # ------------------------------------------------------------------ lifecycle

    async def _before_start(self) -> None:
        await anyio.to_thread.run_sync(calls.connect, self.config.address, self.config.namespace)

    async def _start(self) -> str:
        ray = calls.connect(self.config.address, self.config.namespace)
        source = self._snapshot_source
        options = actor_options(ray, self.config, source)
        inner = {**self._inner_config}
        inner["labels"] = {**inner.get("labels", {}), **_driver_labels(ray)}
        self._actor = (
            _host_class(ray)
            .options(**options)
            .remote(inner, inner_snapshot(source) if source is not None else None)
        )
        try:
            with anyio.fail_after(self.config.start_timeout):
                started: Started = await calls.settle(self._actor.start.remote(), "start")
        except TimeoutError:
            raise ProvisioningError(
                f"no Ray node took the sandbox within {self.config.start_timeout:g} s "
                f"(resources {self.config.resources}, node {self.config.node or 'any'}): "
                "is there a node with a free slot? (docs/ray.md)"
            ) from None
        self._started = started
        NODES.hold()
        self._watched = True
        return started.workdir

    async def _close(self) -> None:
        self._unwatch()
        actor, self._actor = self._actor, None
        if actor is None:
            return
        if self._started is None:  # never started: whatever it made has a dead creator
            calls.ray_module().kill(actor, no_restart=True)
            return
        if (lost := self.lost()) is not None:  # no node to close it on
            log.warning("%s: not closed on its node: %s", self.describe(), lost)
            calls.ray_module().kill(actor, no_restart=True)
            return
        try:
            with anyio.fail_after(60):
                await calls.settle(actor.close.remote(), "close")
        except (SandboxError, TimeoutError) as exc:
            log.warning("%s: closing on its node failed: %s", self.describe(), exc)
        finally:
            calls.ray_module().kill(actor, no_restart=True)

    def close_at_exit(self) -> None:
        """At interpreter exit, close on the node before Ray ends the actor with the driver."""
        self._unwatch()
        actor = self._actor
        if actor is not None:
            ray = calls.ray_module()
            try:
                ray.get(actor.close.remote(), timeout=60)
            except Exception as exc:  # noqa: BLE001 -- exit backstop: logged, the sweep remains
                log.warning("%s: closing at exit failed: %s", self.describe(), exc)
        self._actor = None
        self._mark_closed()

    def _unwatch(self) -> None:
        if self._watched:
            self._watched = False
            NODES.release()

    async def _alive(self) -> bool:
        if self._actor is None:
            return False
        try:
            return bool(await self._call("alive"))
        except SandboxUnavailableError:
            return False

    # ------------------------------------------------------------------ commands

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        call = f"c{next(self._calls)}"
        incremental = request.stdin is not None and not isinstance(request.stdin, bytes)
        spec = CommandSpec(
            argv=request.argv,
            cwd=request.cwd,
            env={k: v for k, v in request.env.items() if k != MARK_VAR},
            stdin=request.stdin if isinstance(request.stdin, bytes) else None,
            incremental=incremental,
            user=request.user,
        )
        try:
            batch: Batch = await self._call("start_command", call, spec)
            async with anyio.create_task_group() as tg:
                if incremental:
                    assert isinstance(request.stdin, AsyncIterable)
                    tg.start_soon(self._feed, call, request.stdin, sink)
                while True:
                    if batch.pid is not None:
                        sink.pid = batch.pid
                    for stream, chunk in batch.chunks:
                        sink.feed(stream, chunk)
                    if batch.done:
                        tg.cancel_scope.cancel()
                        break
                    batch = await self._call("poll", call)
        except BaseException:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_WAIT):
                try:
                    await self._call("cancel", call, kill=not sink.detached)
                except SandboxError as exc:
                    log.warning("%s: cancelling %s failed: %s", self.describe(), call, exc)
            raise
        if batch.error is not None:
            raise batch.error
        assert batch.exit_code is not None
        sink.exited(batch.exit_code)
        return batch.exit_code

    async def _feed(self, call: str, source: AsyncIterable[bytes], sink: OutputSink) -> None:
        """Hand the node an incremental stdin piece by piece, each once it asked for it (the
        one feeder every backend uses: a failing source or a chunk that is not bytes stops
        the call)."""

        async def write(piece: bytes) -> bool:
            return bool(await self._call("feed", call, bytes(piece)))

        async def close() -> None:
            await self._call("feed", call, None)

        await feed_stdin(source, sink, write, close, size=FEED_PIECE)

    async def stop_processes(self) -> int:
        self._check_open()
        with self._guard("stop_processes"):
            return int(await self._call("stop_processes"))

    # ------------------------------------------------------------------ files

    async def _routed_read(self, path: str, limit: int) -> bytes:
        return bytes(await self._idempotent("read", path, limit))

    async def _routed_write(self, path: str, data: bytes) -> None:
        await self._call("write", path, data)

    async def _routed_exists(self, path: str) -> bool:
        return bool(await self._idempotent("exists", path))

    async def _routed_lstat(self, path: str, limit: int) -> PathInfo:
        info: PathInfo = await self._idempotent("lstat", path, limit)
        return info

    async def _routed_mkdir(self, path: str, mode: int, uid: int, gid: int) -> None:
        await self._call("mkdir", path, mode, uid, gid)

    async def _routed_remove(self, path: str) -> None:
        await self._call("remove", path)

    async def _upload(self, source: Path, remote: str) -> None:
        if await anyio.Path(source).is_dir():
            archive = await anyio.to_thread.run_sync(tar_directory, source)
            await self._call("upload", archive, remote, None)
            return
        staged = await anyio.to_thread.run_sync(_one_file_archive, source)
        await self._call("upload", staged, remote, source.name)

    async def _download(
        self, remote: str, local: Path, *, skip_unsafe: bool = False, links: Links = "contained"
    ) -> None:
        kind, data = await self._call("download", remote, skip_unsafe=skip_unsafe, links=links)
        if kind == "file":
            await anyio.to_thread.run_sync(write_local_file, local, data)
            return
        await anyio.to_thread.run_sync(
            lambda: untar_into(data, local, skip_unsafe=skip_unsafe, links=links)
        )

    # ------------------------------------------------------------------ accounts

    @property
    def policy_user(self) -> str | None:
        return self._started.policy_user if self._started is not None else None

    @property
    def judge_user(self) -> str | None:
        return self._started.judge_user if self._started is not None else None

    async def prepare_policy_user(self) -> str | None:
        self._check_open()
        with self._guard("prepare_policy_user"):
            return await self._call("prepare_policy_user")  # type: ignore[no-any-return]

    async def prepare_judge_user(self) -> str | None:
        self._check_open()
        with self._guard("prepare_judge_user"):
            return await self._call("prepare_judge_user")  # type: ignore[no-any-return]

    async def _ensure_account(self, request: ExecRequest) -> None:
        """The node's runtime makes an account at its first use."""
        return None

    async def system_tampered(self) -> str | None:
        self._check_open()
        with self._guard("system_tampered"):
            return await self._call("system_tampered")  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ routes to the host

    def _host_routes(self) -> tuple[RouteKind, ...]:
        return ("forward",)

    def _route_hint(self) -> str:
        return "the nodes must reach the driver's cluster address (docs/ray.md)"

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        """The driver's relay (:mod:`runtimes.ray.routes`) to ``127.0.0.1:port`` here, and the
        node's route from the sandbox to it."""
        address = str(calls.ray_module().util.get_node_ip_address())
        ticket = await anyio.to_thread.run_sync(open_ticket, address, port)
        try:
            host, sandbox_port = await self._call("open_route", ticket)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(close_ticket, ticket)
            raise

        async def close() -> None:
            try:
                await self._call("close_route", ticket)
            except SandboxUnavailableError:
                pass  # the sandbox is gone, and its route with it
            finally:
                await anyio.to_thread.run_sync(close_ticket, ticket)

        return HostRoute(via, host, sandbox_port, _close=close)

    # ------------------------------------------------------------------ snapshots

    async def _snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        assert self._started is not None
        # The node keeps its own snapshot (keep=True) for the ray snapshot's life; the ray
        # snapshot's keep and its node go with it, for ls and cleanup (runtimes.ray.cluster).
        extra = {RAY_KEEP: labels.get(ownership.KEEP, "false"), NODE: self._started.node_id}
        taken: SandboxSnapshot = await self._call("snapshot", {**labels, **extra})
        return ray_snapshot(taken, self._started.node_id, labels)

    # ------------------------------------------------------------- the cluster: ls, cleanup, rm

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Every sandbox a ray actor made on any alive node, listed there (:mod:`.cluster`).

        Raises:
            SandboxTransportError: the cluster cannot be reached.
            SandboxUnavailableError: no config, no ``RAY_ADDRESS``, and no cluster joined.
        """
        return await list_cluster_sandboxes(config)

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Remove one listed ray sandbox on its node (:func:`.cluster.destroy_cluster_sandbox`)."""
        await destroy_cluster_sandbox(info, config)

    @classmethod
    async def sweep_sandboxes(cls, config: RuntimeConfig | None, sweep: Sweep) -> list[SweepResult]:
        """``cleanup``'s sweep, judged and done on each node (:func:`.cluster.sweep_cluster`)."""
        return await sweep_cluster(config, sweep)

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """Every snapshot a ray actor took on any alive node
        (:func:`.cluster.list_cluster_snapshots`)."""
        return await list_cluster_snapshots(config)

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        await destroy_snapshot_on_node(snapshot, config)

    @classmethod
    def _destroy_snapshot_at_exit(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None
    ) -> None:
        """At exit, only while this process is still connected to the cluster (never a new
        connection then): otherwise the snapshot is left to ``vf-sandbox cleanup``."""
        ray = sys.modules.get("ray")
        if ray is None or not ray.is_initialized():
            log.warning("%s left for vf-sandbox cleanup: Ray is gone at exit", snapshot.describe())
            return
        anyio.run(destroy_snapshot_on_node, snapshot, config)


@functools.cache
def _host_class(ray: ModuleType) -> Any:
    """The actor class, made once per process (Ray exports a class's definition to the
    cluster each time one is made)."""
    return ray.remote(SandboxHost)


def _driver_labels(ray: ModuleType) -> dict[str, str]:
    """The labels a ray sandbox's own sandbox carries besides its node-side creator's: the
    driver that asked for it (its session) and its Ray job."""
    return {DRIVER: ownership.CREATOR_ID, JOB: str(ray.get_runtime_context().get_job_id())}


def _one_file_archive(source: Path) -> bytes:
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(source, arcname=posixpath.basename(str(source)))
    return buf.getvalue()
