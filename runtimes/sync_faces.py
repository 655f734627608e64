"""The typed faces of the blocking runtime facades: what a type checker and an editor see
on a :class:`~runtimes.sync.SyncRuntime`, a :class:`~runtimes.sync.SyncShellSession` and a
:class:`~runtimes.sync.SyncHostRoute`.

At run time a facade restates nothing: :class:`~runtimes.blocking.Blocking` turns each
coroutine method of the async object into a blocking one as it is looked up. These
protocols give the same methods their blocking signatures (the async parameters; the
result the coroutine returns, or the facade that wraps it), and each facade class inherits
its protocol *only while type checking* (at run time the protocol's members would hide the
generic lookup). ``tests/test_sync_faces.py`` keeps each protocol in step with its async
class: every public coroutine method is here, with the same parameters.

The protocols are also the types to annotate with where a fake stands in for a facade
(``def run_tests(rt: RuntimeFace) -> None``). Their bodies are never run
(:func:`~runtimes.blocking.face_only`).
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, Self

from .blocking import face_only

if TYPE_CHECKING:
    from ._extract import Links
    from .arguments import PathLike
    from .channel import ChannelInfo
    from .channel.agent.wire import PathInfo
    from .config import RuntimeConfig
    from .lifecycle import State
    from .listing import FileInfo
    from .models import ExecResult, SandboxInfo, Stream
    from .processes import BackgroundProcess
    from .routes import RouteKind
    from .snapshot import SandboxSnapshot
    from .sync import SyncHostRoute, SyncShellSession

__all__ = ["HostRouteFace", "RuntimeFace", "ShellSessionFace", "SyncStdin"]

SyncStdin = bytes | str | Iterable[bytes] | AsyncIterable[bytes] | None
"""What :meth:`RuntimeFace.exec` takes as ``stdin``: the async API's, or a plain iterable
of bytes (each item pulled in a worker thread)."""


class RuntimeFace(Protocol):
    """The blocking :class:`~runtimes.base.Runtime` API: each method runs its async
    namesake on the facade's portal thread, returns what it returns and raises what it
    raises, plus BlockingCallInEventLoopError in async code and SandboxUnavailableError
    before ``start()`` or after ``close()``."""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> Self:
        face_only()

    def close(self) -> None:
        face_only()

    def alive(self) -> bool:
        face_only()

    # ------------------------------------------------------------------ commands

    def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        stdin: SyncStdin = None,
        user: str | None = None,
        output_limit: int | None = None,
        on_output: Callable[[Stream, bytes], object] | None = None,
        keep_output: bool = True,
        check: bool = False,
    ) -> ExecResult:
        face_only()

    def spawn(
        self,
        argv: Sequence[str],
        *,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | AsyncIterable[bytes] | None = None,
        user: str | None = None,
        on_output: Callable[[Stream, bytes], object] | None = None,
        buffer: int = 1048576,
    ) -> BackgroundProcess:
        """The async process handle: its coroutines run on the portal thread only."""
        face_only()

    def stop_processes(self) -> int:
        face_only()

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
    ) -> SyncShellSession:
        face_only()

    # ------------------------------------------------------------------ files

    def read(self, path: PathLike, *, max_bytes: int | None = None) -> bytes:
        face_only()

    def write(self, path: PathLike, data: bytes | str) -> None:
        face_only()

    def exists(self, path: PathLike) -> bool:
        face_only()

    def stat(self, path: PathLike) -> FileInfo:
        face_only()

    def lstat(self, path: PathLike, *, content_limit: int = 0) -> PathInfo:
        face_only()

    def list(self, path: PathLike = ".", *, max_entries: int = 10000) -> builtins.list[FileInfo]:
        face_only()

    def glob(self, pattern: str, *, max_entries: int = 10000) -> builtins.list[FileInfo]:
        face_only()

    def mkdir(self, path: PathLike, *, mode: int = 493, uid: int = -1, gid: int = -1) -> None:
        face_only()

    def remove(self, path: PathLike, *, missing_ok: bool = False) -> None:
        face_only()

    def upload(self, local: PathLike, remote: PathLike) -> None:
        face_only()

    def download(
        self,
        remote: PathLike,
        local: PathLike,
        *,
        skip_unsafe: bool = False,
        links: Links = "contained",
    ) -> None:
        face_only()

    # ------------------------------------------------------------------ accounts, routes

    def prepare_policy_user(self) -> str | None:
        face_only()

    def prepare_judge_user(self) -> str | None:
        face_only()

    def system_tampered(self) -> str | None:
        face_only()

    def plan_host_route(self, via: str | None = None) -> tuple[RouteKind, str]:
        face_only()

    def expose_host(self, port: int, *, via: str | None = None) -> SyncHostRoute:
        face_only()

    # ------------------------------------------------------------------ snapshots, listing

    def snapshot(
        self, *, keep: bool = False, labels: Mapping[str, str] | None = None
    ) -> SandboxSnapshot:
        face_only()

    def list_sandboxes(self, config: RuntimeConfig | None = None) -> builtins.list[SandboxInfo]:
        face_only()

    def destroy_sandbox(self, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        face_only()

    def list_snapshots(self, config: RuntimeConfig | None = None) -> builtins.list[SandboxSnapshot]:
        face_only()

    def destroy_snapshot(
        self, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        face_only()

    def shell_argv(
        self, info: SandboxInfo, config: RuntimeConfig | None = None, *, tty: bool
    ) -> builtins.list[str]:
        face_only()

    # ------------------------------------------------------------------ the runtime's own

    @property
    def name(self) -> str:
        face_only()

    @property
    def config(self) -> RuntimeConfig:
        face_only()

    @property
    def workdir(self) -> str:
        face_only()

    @property
    def sandbox_id(self) -> str | None:
        face_only()

    @property
    def state(self) -> State:
        face_only()

    @property
    def closed(self) -> bool:
        face_only()

    @property
    def policy_user(self) -> str | None:
        face_only()

    @property
    def judge_user(self) -> str | None:
        face_only()

    @property
    def channel_info(self) -> ChannelInfo:
        face_only()

    @property
    def snapshot_source(self) -> SandboxSnapshot | None:
        face_only()

    def describe(self) -> str:
        face_only()

    def lost(self) -> str | None:
        face_only()

    def resolve_path(self, path: PathLike) -> str:
        face_only()

    def host_routes(self) -> tuple[RouteKind, ...]:
        face_only()


class ShellSessionFace(Protocol):
    """The blocking :class:`~runtimes.shell.ShellSession` API."""

    @property
    def pid(self) -> int | None:
        face_only()

    def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        output_limit: int | None = None,
        input: bytes | str | None = None,
    ) -> ExecResult:
        face_only()

    def resize(self, rows: int, cols: int) -> None:
        face_only()

    def close(self) -> None:
        face_only()

    @property
    def alive(self) -> bool:
        face_only()


class HostRouteFace(Protocol):
    """The blocking :class:`~runtimes.routes.HostRoute` API."""

    @property
    def via(self) -> RouteKind:
        face_only()

    @property
    def host(self) -> str:
        face_only()

    @property
    def port(self) -> int:
        face_only()

    @property
    def closed(self) -> bool:
        face_only()

    def close(self) -> None:
        face_only()

    @property
    def address(self) -> str:
        face_only()

    def url(self, path: str = "") -> str:
        face_only()

    def lost(self) -> str | None:
        face_only()

    def check(self) -> None:
        face_only()
