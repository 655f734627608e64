"""The node's side of a ray sandbox: :class:`SandboxHost`, the Ray actor that owns the sandbox.

The actor opens the sandbox's own runtime (any other runtime type) on its node and serves the
calls of the driver's :class:`~runtimes.ray.RayRuntime`: the channel, sweeps and caps of that
runtime stay on the node, so a call crosses the network once. Each method is one call from
the driver; a typed :class:`~runtimes.errors.SandboxError` raised here reaches the driver as
itself (:mod:`runtimes.ray.calls`).

The actor is a threaded one: Ray runs each call on a thread of its pool, and the sandbox's
runtime runs on an event loop of its own (:class:`~runtimes.portal.PortalThread`) that the
calls enter. A command is a *call* of its own (:class:`Command`):
:meth:`SandboxHost.start_command` starts it, :meth:`SandboxHost.poll` returns what it wrote
since the last poll (waiting until there is something), :meth:`SandboxHost.feed` hands it the
next piece of an incremental stdin and returns once the command asked for the one after,
:meth:`SandboxHost.cancel` kills its tree. Output the driver has not taken yet is held here up
to :data:`BACKLOG` bytes; past it the sandbox's loop waits for the next poll, so a slow driver
slows the command (as the channel's reader does), and the node's memory stays bounded.

This module imports Ray only inside the actor: the driver makes the actor class
(``ray.remote(SandboxHost)``).
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio

from .._extract import Links
from .._local_files import tar_directory, untar_into
from ..base import Runtime
from ..channel.agent.wire import PathInfo
from ..errors import SandboxError, SandboxUnavailableError
from ..models import Stream
from ..portal import PortalThread, call_through
from ..processes import BackgroundProcess
from ..registry import open_runtime
from ..snapshot import SandboxSnapshot
from .routes import NodeRoutes, RelayTicket

__all__ = ["BACKLOG", "LINGER", "Batch", "CommandSpec", "SandboxHost", "Started"]

T = TypeVar("T")

BACKLOG = 16 << 20
"""Bytes of a command's output the node holds for the driver's next poll."""
LINGER = 0.005
"""Seconds a poll that has output waits on for the command's end before it answers."""


@dataclass(frozen=True)
class CommandSpec:
    """One command, as the driver resolved it (the fields of an ``ExecRequest``)."""

    argv: tuple[str, ...]
    cwd: str
    env: dict[str, str]
    stdin: bytes | None
    incremental: bool
    """Whether stdin comes piece by piece (:meth:`SandboxHost.feed`) instead of ``stdin``."""
    user: str | None


@dataclass
class Batch:
    """What a command did since the last poll."""

    chunks: list[tuple[Stream, bytes]]
    pid: int | None
    exit_code: int | None
    done: bool
    error: SandboxError | None = None


@dataclass(frozen=True)
class Started:
    """What the driver learns of a sandbox its actor started."""

    workdir: str
    sandbox_id: str | None
    node_id: str
    node_address: str
    name: str
    policy_user: str | None
    judge_user: str | None
    snapshot_holds: str | None


class Command:
    """A command the node runs for the driver: its output waiting for the next poll, under a
    lock (written on the sandbox's loop, taken on a Ray thread)."""

    def __init__(self) -> None:
        self.process: BackgroundProcess | None = None
        self.chunks: list[tuple[Stream, bytes]] = []
        self.held = 0
        self.done = False
        self.code: int | None = None
        self.error: SandboxError | None = None
        self.cancelled = False
        self.stdin: Pipe | None = None
        self.ended: anyio.Event | None = None
        """Set on the sandbox's loop when it ended (made there)."""
        self.changed = threading.Condition()

    def take(self, stream: Stream, data: bytes) -> None:
        """``on_output``, on the sandbox's loop: past :data:`BACKLOG` it waits for a poll."""
        with self.changed:
            self.chunks.append((stream, data))
            self.held += len(data)
            self.changed.notify_all()
            while self.held > BACKLOG and not self.cancelled:
                self.changed.wait(0.5)

    def batch(self, wait: float | None) -> Batch:
        """What it wrote since the last batch, waiting up to ``wait`` seconds for something,
        then up to :data:`LINGER` more for its end (a short command's output and exit in one
        answer: one round trip, not two)."""
        with self.changed:
            if wait is not None:
                self.changed.wait_for(lambda: self.chunks or self.done, wait)
                if not self.done and self.held < BACKLOG // 2:
                    self.changed.wait_for(lambda: self.done, LINGER)
            chunks, self.chunks, self.held = self.chunks, [], 0
            self.changed.notify_all()
            pid = self.process.pid if self.process is not None else None
            return Batch(chunks, pid, self.code, self.done, self.error)

    async def wait(self) -> None:
        """Until the command exited and its output ended (or the grace after its exit
        passed); its outcome kept for the driver's next poll."""
        assert self.process is not None
        code: int | None = None
        error: SandboxError | None = None
        try:
            code = (await self.process.wait()).exit_code
        except SandboxError as exc:
            error = exc
        finally:
            with self.changed:
                self.code, self.error, self.done = code, error, True
                self.changed.notify_all()
            if self.ended is not None:
                self.ended.set()

    def release(self) -> None:
        with self.changed:
            self.cancelled = True
            self.changed.notify_all()


class Pipe:
    """An incremental stdin: the driver's pieces one at a time (a zero-size stream), and the
    command's asking for the next one after each (so the driver never reads ahead)."""

    def __init__(self) -> None:
        self.send, self.receive = anyio.create_memory_object_stream[bytes | None](0)
        self.asked_send, self.asked = anyio.create_memory_object_stream[None](1)

    async def pieces(self) -> AsyncIterator[bytes]:
        async for piece in self.receive:
            if piece is None:
                return
            yield piece
            await self.asked_send.send(None)

    async def hand(self, piece: bytes | None, ended: anyio.Event) -> bool:
        """Hand over one piece; ``True`` once the command asked for the next one, ``False``
        if it ended first."""
        with anyio.move_on_after(None) as scope:
            async with anyio.create_task_group() as tg:

                async def until_ended() -> None:
                    await ended.wait()
                    scope.cancel()

                tg.start_soon(until_ended)
                await self.send.send(piece)
                if piece is not None:
                    await self.asked.receive()
                tg.cancel_scope.cancel()
        return not scope.cancel_called


class SandboxHost:
    """The actor that owns one sandbox on its node (see the module)."""

    def __init__(self, config: dict[str, Any], snapshot: SandboxSnapshot | None) -> None:
        self._config = config
        self._snapshot = snapshot
        self._runtime: Runtime | None = None
        self._commands: dict[str, Command] = {}
        self._lock = threading.Lock()
        self._routes = NodeRoutes()
        self._loop = PortalThread("asyncio", {}, "vf-sandbox-ray-host")
        self._on_loop(_unblock_signals)

    def _on_loop(self, func: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        """``await func(*args, **kwargs)`` on the sandbox's loop."""
        return call_through(self._loop.portal, func, args, kwargs, self._gone)

    def _gone(self) -> SandboxUnavailableError:
        return SandboxUnavailableError("the ray sandbox's actor was closed")

    @property
    def runtime(self) -> Runtime:
        if self._runtime is None:
            raise SandboxError("the ray sandbox's actor has no sandbox (not started)")
        return self._runtime

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Started:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        node_address = str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
        runtime = open_runtime(self._config, snapshot=self._snapshot)
        self._runtime = runtime
        self._on_loop(runtime.start)
        return Started(
            workdir=runtime.workdir,
            sandbox_id=runtime.sandbox_id,
            node_id=node_id,
            node_address=node_address,
            name=runtime.name,
            policy_user=runtime.policy_user,
            judge_user=runtime.judge_user,
            snapshot_holds=runtime.snapshot_holds,
        )

    def close(self) -> None:
        with self._lock:
            commands, self._commands = list(self._commands.values()), {}
        for command in commands:
            command.release()
        try:
            self._on_loop(self._routes.close_all)
            if self._runtime is not None:
                self._on_loop(self._runtime.close)
        finally:
            self._loop.stop(30)

    def alive(self) -> bool:
        return self._runtime is not None and self._on_loop(self._runtime.alive)

    def ping(self) -> int:
        return os.getpid()

    # ------------------------------------------------------------------ commands

    def start_command(self, call: str, spec: CommandSpec) -> Batch:
        """Start a command; its first batch (all of it, if it ends at once; nothing yet
        for one whose stdin the driver is to feed)."""
        command = Command()
        with self._lock:
            self._commands[call] = command  # before it starts: a cancel may come meanwhile
        try:
            self._on_loop(_spawn, self.runtime, command, spec)
            self._loop.portal.start_task_soon(command.wait)
        except BaseException:
            with self._lock:
                self._commands.pop(call, None)
            raise
        with self._lock:
            cancelled = call not in self._commands
        if cancelled:
            self._on_loop(_kill, command)
            raise SandboxError(f"command {call!r} was cancelled as it started")
        return self.poll(call, wait=None if spec.incremental else 30.0)

    def poll(self, call: str, wait: float | None = 30.0) -> Batch:
        """What the command wrote since the last poll, once there is something, it ended, or
        ``wait`` seconds passed (the driver polls again)."""
        with self._lock:
            command = self._commands.get(call)
        if command is None:
            raise SandboxError(f"no command {call!r} on this node (it ended or was cancelled)")
        batch = command.batch(wait)
        if batch.done:
            with self._lock:
                self._commands.pop(call, None)
        return batch

    def feed(self, call: str, piece: bytes | None) -> bool:
        """Hand the command the next piece of its stdin (``None``: the end); return once it
        asked for the piece after, ``False`` if it ended first."""
        with self._lock:
            command = self._commands.get(call)
        if command is None or command.stdin is None or command.ended is None:
            return False
        return self._on_loop(command.stdin.hand, piece, command.ended)

    def cancel(self, call: str, *, kill: bool) -> None:
        """Stop waiting for a command; with ``kill``, kill its tree (a command whose caller
        already returned keeps its background processes, as ``exec`` does)."""
        with self._lock:
            command = self._commands.pop(call, None)
        if command is None or command.process is None:
            return  # not started yet: start_command kills it
        command.release()
        if kill:
            self._on_loop(_kill, command)

    # ------------------------------------------------------------------ files

    def read(self, path: str, limit: int) -> bytes:
        """The file, once: one over ``limit`` raises the driver's own error here."""
        return self._on_loop(self.runtime.read, path, max_bytes=limit)

    def write(self, path: str, data: bytes) -> None:
        self._on_loop(self.runtime.write, path, data)

    def exists(self, path: str) -> bool:
        return self._on_loop(self.runtime.exists, path)

    def lstat(self, path: str, limit: int) -> PathInfo:
        return self._on_loop(self.runtime.lstat, path, content_limit=limit)

    def mkdir(self, path: str, mode: int, uid: int, gid: int) -> None:
        self._on_loop(self.runtime.mkdir, path, mode=mode, uid=uid, gid=gid)

    def remove(self, path: str) -> None:
        self._on_loop(self.runtime.remove, path, missing_ok=True)

    def upload(self, archive: bytes, remote: str, file_name: str | None) -> None:
        """Unpack the driver's archive here, then upload it into the sandbox (``file_name``:
        the archive holds that one file, which goes to ``remote`` itself)."""
        with tempfile.TemporaryDirectory(prefix="vf-ray-up-") as staged:
            root = Path(staged) / "tree"
            untar_into(archive, root, links="keep")
            source = root / file_name if file_name is not None else root
            self._on_loop(self.runtime.upload, source, remote)

    def download(self, remote: str, *, skip_unsafe: bool, links: Links) -> tuple[str, bytes]:
        """The sandbox's file (``("file", bytes)``) or tree (``("tree", tar)``) at ``remote``."""
        with tempfile.TemporaryDirectory(prefix="vf-ray-down-") as staged:
            local = Path(staged) / "got"
            self._on_loop(
                self.runtime.download, remote, local, skip_unsafe=skip_unsafe, links=links
            )
            if local.is_dir() and not local.is_symlink():
                return "tree", tar_directory(local)
            return "file", local.read_bytes()

    # ------------------------------------------------------------------ the rest of the API

    def open_route(self, ticket: RelayTicket) -> tuple[str, int]:
        """A route from the sandbox to the driver's relay (:mod:`runtimes.ray.routes`): the
        host and port a process in the sandbox connects to."""
        return self._on_loop(self._routes.open, self.runtime, ticket)

    def close_route(self, ticket: RelayTicket) -> None:
        self._on_loop(self._routes.close, ticket)

    def stop_processes(self) -> int:
        return self._on_loop(self.runtime.stop_processes)

    def snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        return self._on_loop(self.runtime.snapshot, keep=True, labels=labels)

    def prepare_policy_user(self) -> str | None:
        return self._on_loop(self.runtime.prepare_policy_user)

    def prepare_judge_user(self) -> str | None:
        return self._on_loop(self.runtime.prepare_judge_user)

    def system_tampered(self) -> str | None:
        return self._on_loop(self.runtime.system_tampered)


# The coroutines run on the sandbox's loop live outside SandboxHost: Ray takes a class with
# any coroutine method for an async actor, whose calls share one loop (a waiting poll would
# stall every other call).


async def _unblock_signals() -> None:
    """Unblock every signal on the sandbox's loop thread (and so in the threads it starts and
    the processes they spawn): a Ray worker blocks SIGINT in its threads, and a command
    started with it blocked could not be interrupted (a shell session's timeout)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


async def _spawn(runtime: Runtime, command: Command, spec: CommandSpec) -> None:
    """Start the command on the sandbox's loop."""
    stdin: bytes | AsyncIterator[bytes] | None = spec.stdin
    command.ended = anyio.Event()
    if spec.incremental:
        command.stdin = Pipe()
        stdin = command.stdin.pieces()
    command.process = await runtime.spawn(
        list(spec.argv),
        cwd=spec.cwd,
        env=spec.env,
        stdin=stdin,
        user=spec.user,
        on_output=command.take,
    )


async def _kill(command: Command) -> None:
    """Kill the command's tree and let its output go."""
    command.release()
    if command.process is not None:
        await command.process.kill()
