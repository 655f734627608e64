"""A minimal third-party backend, written only against the public plugin contract.

It runs commands as local processes (like the built-in subprocess runtime) and implements
only the methods of :class:`runtimes.Backend`, declaring no file capability: every file
operation (``read``, ``write``, ``exists``, ``remove``, ``upload``, ``download``) goes
through the runtime's generic plain path over ``spawn``, and the runtime sweeps what its
commands leave running. With ``channel: true`` it also declares
:class:`runtimes.StreamSpawner` (a local process whose pipes are one stream), and the
runtime runs the channel's agent over it. That makes it the proof that a backend built this
way passes the conformance suite, with and without the channel.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
from typing import Literal

import anyio
import anyio.abc

from runtimes import (
    Backend,
    CreateRequest,
    ExecRequest,
    OutputSink,
    RuntimeConfig,
    SandboxError,
    StreamSpawner,
)
from runtimes.channel import ChannelTransport
from runtimes.errors import (
    SandboxInvalidArgumentError,
    cannot_run_as,
    error_for_errno,
    no_such_user,
)
from runtimes.models import StdinSource
from runtimes.stdin_feed import feed_stdin, run_beside


class EchoConfig(RuntimeConfig):
    type: Literal["echo"] = "echo"
    channel: bool = False
    """Run the channel's agent over a local process's pipes."""


class EchoBackend(Backend, StreamSpawner):
    name = "echo"
    config_model = EchoConfig

    _dir: str | None = None

    @property
    def sandbox_id(self) -> str | None:
        return os.path.basename(self._dir) if self._dir else None

    async def create(self, request: CreateRequest) -> str:
        self._dir = tempfile.mkdtemp(prefix="vf-echo-")
        return self._dir

    async def destroy(self, *, keep: bool) -> None:
        if self._dir:
            await anyio.to_thread.run_sync(shutil.rmtree, self._dir, True)

    async def alive(self) -> bool:
        return self._dir is not None and await anyio.Path(self._dir).is_dir()

    async def open_stream(self, argv: list[str]) -> ChannelTransport:
        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=self._dir,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                start_new_session=True,
            )

        try:
            return _Pipes(await anyio.to_thread.run_sync(start))
        except OSError as exc:
            raise SandboxError(f"echo backend: cannot start {argv[0]!r}: {exc}") from exc

    async def spawn(self, request: ExecRequest, sink: OutputSink) -> int:
        if request.user is not None and os.geteuid() != 0:
            raise cannot_run_as(request.argv[0], request.user, "the host process is not root")
        if request.user is not None:
            try:
                pwd.getpwnam(request.user)
            except KeyError:
                raise no_such_user(request.user) from None
        try:
            proc = await anyio.open_process(
                list(request.argv),
                cwd=request.cwd,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **request.env},
                start_new_session=True,
                user=request.user,
            )
        except OSError as exc:
            if exc.errno == 7:
                raise SandboxInvalidArgumentError("argument list too long") from None
            name = exc.filename if isinstance(exc.filename, str) else request.argv[0]
            raise error_for_errno(exc.errno, name) from None
        sink.pid = proc.pid
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_pump, proc.stdout, sink, "stdout")
                tg.start_soon(_pump, proc.stderr, sink, "stderr")
                code = await run_beside(proc.wait, lambda: _send(proc, request.stdin, sink))
                sink.exited(128 - code if code < 0 else code)  # its output may go on
        except BaseException:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await proc.aclose()
        return 128 - code if code < 0 else code


class _Pipes(ChannelTransport):
    """A local process's stdin and stdout as the channel's stream."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self._proc = proc
        self._stdin = proc.stdin
        self._stdout = proc.stdout.fileno()
        self._closed = False

    def recv(self) -> bytes:
        try:
            return os.read(self._stdout, 65536)
        except OSError:
            return b""

    def send(self, data: bytes) -> None:
        self._stdin.write(data)
        self._stdin.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._stdin.close()  # EOF: the agent kills what it runs and exits
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


async def _send(proc: anyio.abc.Process, stdin: StdinSource | None, sink: OutputSink) -> None:
    pipe = proc.stdin
    assert pipe is not None

    async def write(chunk: bytes) -> bool:
        try:
            await pipe.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return False  # the command closed its stdin or exited
        return True

    async def close() -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            await pipe.aclose()

    await feed_stdin(stdin, sink, write, close, size=65536)


async def _pump(
    stream: anyio.abc.ByteReceiveStream | None, sink: OutputSink, name: Literal["stdout", "stderr"]
) -> None:
    assert stream is not None
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        async for chunk in stream:
            if not sink.feed(name, chunk):
                return
