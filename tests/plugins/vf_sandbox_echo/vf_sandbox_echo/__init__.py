"""A minimal third-party backend, written only against the public plugin contract.

It runs commands as local processes (like the built-in subprocess runtime) but moves
every file through ``exec`` (``cat``, ``mkdir``), implementing only the abstract
primitives of :class:`runtimes.Runtime` and relying on the base class's exec-based
defaults for ``exists``, ``remove``, ``upload`` and ``download``. That makes it the
proof that a plugin built this way passes the conformance suite.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import tempfile
from typing import Literal

import anyio
import anyio.abc

from runtimes import ExecRequest, OutputSink, Runtime, RuntimeConfig
from runtimes.errors import (
    SandboxError,
    SandboxInvalidArgumentError,
    cannot_run_as,
    error_for_errno,
    no_such_user,
)
from runtimes.models import StdinSource
from runtimes.stdin_feed import feed_stdin, run_beside

_SHELL_ERRORS = {
    "No such file or directory": 2,
    "Permission denied": 13,
    "Not a directory": 20,
    "Is a directory": 21,
}


class EchoConfig(RuntimeConfig):
    type: Literal["echo"] = "echo"


class EchoRuntime(Runtime):
    name = "echo"
    config_model = EchoConfig

    _dir: str | None = None

    async def _start(self) -> str:
        self._dir = tempfile.mkdtemp(prefix="vf-echo-")
        return self._dir

    async def _close(self) -> None:
        if self._dir:
            await anyio.to_thread.run_sync(shutil.rmtree, self._dir, True)

    async def _alive(self) -> bool:
        return self._dir is not None and await anyio.Path(self._dir).is_dir()

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
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

    async def _read(self, path: str, limit: int) -> bytes:
        request, sink = self._internal(["cat", "--", path], limit=limit + 1)
        code = await self._exec(request, sink)
        if code != 0:
            raise _error_from_shell(path, bytes(sink.stderr))
        return bytes(sink.stdout)

    async def _write(self, path: str, data: bytes) -> None:
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"'
        request, sink = self._internal(["sh", "-c", script, "sh", path], stdin=data)
        if await self._exec(request, sink) != 0:
            raise _error_from_shell(path, bytes(sink.stderr))


def _error_from_shell(path: str, stderr: bytes) -> SandboxError:
    text = stderr.decode("utf-8", "replace")
    for needle, num in _SHELL_ERRORS.items():
        if needle in text:
            return error_for_errno(num, path)
    if "File exists" in text:  # mkdir -p over a file
        return error_for_errno(20, path)
    return SandboxError(f"echo backend: operation on {path!r} failed: {text.strip()}")


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
