"""One command in a Docker container: the wrapper's report read off the engine's framed
output, and the typed errors for a command that could not start.

Each command runs through the one exec wrapper (``runtimes/scripts/exec.sh``,
:mod:`runtimes.wrapper`) in ``exec`` mode: it changes to ``cwd``, checks the program (so a
missing or non-executable program is a typed error, never a guessed exit code), applies the
caller's environment, reports on stderr and ``exec``\\ s the program. Docker makes every exec a
session and process-group leader, so the reported group is the command's own pid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import SandboxError, SandboxUnavailableError, argument_list_too_long, no_such_user
from ..models import ExecRequest, OutputSink
from ..wrapper import ReportReader, WrapperReport, argv_size, wrapper_argv
from .client import (
    KILL_WAIT,
    _api_message,
    _blocking,
    _container_is_gone,
    _ContainerRef,
    _engine_name,
    _not_engine_text,
    gone_error,
)
from .stream import _ExecStream, _hijack, _Hijacked

_ENGINE_TEXT_MAX = 2000  # an error message, not the output of a shell that never reported


@dataclass
class _ExecOutput:
    """Demultiplexes the engine's framed stream and reads the wrapper's report.

    Frames are ``[stream, 0, 0, 0, size (4 bytes, big-endian)] + payload``; stream 1 is
    stdout, 2 stderr. The wrapper reports on stderr before the command runs; stdout is held
    back until the report is in (the engine does not order stdout frames against stderr
    frames), up to the output cap. A stream that ends without a report carries the
    engine's error message.
    """

    sink: OutputSink
    reader: ReportReader
    _frames: bytearray = field(default_factory=bytearray)
    _held_stdout: bytearray = field(default_factory=bytearray)

    @property
    def report(self) -> WrapperReport | None:
        return self.reader.report

    @property
    def pgid(self) -> int | None:
        """The command's process group (its pid), once the wrapper reported it running."""
        return None if self.reader.report is None else self.reader.report.pgid

    @property
    def announced(self) -> bool:
        return self.reader.done or self.reader.gave_up

    @property
    def engine_text(self) -> str:
        """What the stream held instead of a report: the engine's error message."""
        held = self.reader.held + bytes(self._held_stdout[:_ENGINE_TEXT_MAX])
        text = held.decode("utf-8", "replace").strip()
        return text if len(text) <= _ENGINE_TEXT_MAX else text[:_ENGINE_TEXT_MAX] + " [...]"

    def feed(self, chunk: bytes) -> bool:
        """Take raw stream bytes; ``False`` once the sink refuses more output."""
        self._frames += chunk
        view = self._frames
        offset = 0
        keep_going = True
        while len(view) - offset >= 8:
            size = int.from_bytes(view[offset + 4 : offset + 8], "big")
            if len(view) - offset - 8 < size:
                break
            kind = view[offset]
            payload = bytes(view[offset + 8 : offset + 8 + size])
            offset += 8 + size
            if payload and not self._route(kind, payload):
                keep_going = False
        del self._frames[:offset]
        return keep_going

    def _route(self, kind: int, payload: bytes) -> bool:
        if kind != 2:
            if self.reader.done or self.reader.gave_up:
                return self.sink.feed("stdout", payload)
            self._held_stdout += payload
            if len(self._held_stdout) <= self.sink.limit - self.sink.size:
                return True
            # A shell that never reports (a hostile /bin/sh) may not grow host memory: what
            # is held counts against the cap, and the sink refuses it like any output.
            held = bytes(self._held_stdout)
            self._held_stdout.clear()
            return self.sink.feed("stdout", held)
        was_done = self.reader.done
        stderr = self.reader.feed(payload)
        ok = True
        report = self.reader.report
        if not was_done and report is not None and report.ok:
            self.sink.pid = report.pgid
        if not was_done and self.reader.done and self._held_stdout:
            ok = self.sink.feed("stdout", bytes(self._held_stdout))
            self._held_stdout.clear()
        if stderr and ok:
            ok = self.sink.feed("stderr", stderr)
        return ok


def _engine_exec_error(text: str, request: ExecRequest, where: str) -> SandboxError:
    """The engine refused to start the command; ``text`` is its message."""
    lowered = text.lower()
    if any(gone in lowered for gone in ("is not running", "is paused", "no such container")):
        return SandboxUnavailableError(f"{where}: {text}")
    if "argument list too long" in lowered or "exceed maximum message" in lowered:
        return argument_list_too_long(argv_size(request.argv))
    if "unable to find user" in lowered or "no matching entries in passwd" in lowered:
        return no_such_user(request.user, text)
    if "executable file not found" in lowered or "no such file or directory" in lowered:
        return SandboxError(
            f"{where}: the image has no /bin/sh, which the docker runtime needs: {text}"
        )
    return SandboxError(
        f"{where}: the engine could not start {request.argv[0]!r}: {text or 'no message'}"
    )


async def start_exec(ref: _ContainerRef, request: ExecRequest, nonce: str) -> _Hijacked:
    """Create the command's exec (through the wrapper, which reports under ``nonce``) and
    start it on a hijacked connection.

    Raises:
        SandboxUnavailableError: the container is gone.
        SandboxInvalidArgumentError: text the engine cannot carry, or an argv too long.
        SandboxError: the engine refused to start the command.
    """
    import docker.errors

    api = ref.api
    user = request.user if request.user is not None else ref.user
    # The caller's environment travels in the wrapper's arguments, never to the engine.
    command = wrapper_argv(request, nonce, mode="exec")
    for text in command:
        try:
            text.encode("utf-8")  # the engine would turn a lone surrogate into U+FFFD
        except UnicodeEncodeError as exc:
            raise _not_engine_text(exc, _engine_name(ref.config)) from None

    def create_and_start() -> _Hijacked:
        created = api.exec_create(
            ref.id,
            command,
            stdout=True,
            stderr=True,
            stdin=bool(request.stdin),
            user=user or "",
            environment=None,
            workdir="/",
        )
        return _hijack(api, str(created["Id"]))

    try:
        return await _blocking(create_and_start, ref.config)
    except docker.errors.APIError as exc:
        if _container_is_gone(exc):
            raise gone_error(ref, exc) from None
        message = _api_message(exc)
        raise _engine_exec_error(message, request, ref.describe) from exc


async def await_announcement(stream: _ExecStream, output: _ExecOutput) -> None:
    """Read on (bounded) until the wrapper reported: it does so at once."""
    with anyio.move_on_after(KILL_WAIT):
        while not output.announced:
            chunk = await stream.receive()
            if not chunk:
                return
            output.feed(chunk)


EXIT_WATCH_FIRST = 0.05
"""Seconds into a command before the engine is first asked whether it exited (most commands
have closed their output by then, and are never asked about)."""
EXIT_WATCH_MAX = 1.0
"""The longest gap between two such questions for a long command."""


async def watch_exit(ref: _ContainerRef, exec_id: str, output: _ExecOutput) -> None:
    """Tell the sink when the command itself exited, while its output is still open
    (background processes inherited the pipes): the engine's exec inspection, asked with a
    growing gap (:data:`EXIT_WATCH_FIRST` to :data:`EXIT_WATCH_MAX`). Cancelled when the
    output ends; an engine that does not answer leaves the exit to the end of the output."""
    import docker.errors

    gap = EXIT_WATCH_FIRST
    while True:
        await anyio.sleep(gap)
        gap = min(gap * 2, EXIT_WATCH_MAX)
        if output.pgid is None:
            continue  # not running yet (or it never will: the stream tells)
        try:
            info = await _blocking(  # abandoned when the output ends first
                lambda: ref.api.exec_inspect(exec_id), ref.config, abandon_on_cancel=True
            )
        except (docker.errors.APIError, SandboxError):
            return
        code = info.get("ExitCode")
        if not info.get("Running") and isinstance(code, int):
            output.sink.exited(code)
            return


async def wait_for_exit(ref: _ContainerRef, exec_id: str) -> dict[str, Any]:
    """The engine's inspection of an exec once it stopped running.

    The output can end before the process does (it closed its stdout and stderr): wait for
    the exit like a local wait() would; timeout= bounds it.

    Raises:
        docker.errors.APIError: the engine lost the exec.
    """
    from tenacity import AsyncRetrying, retry_if_result, wait_exponential

    async def inspect() -> dict[str, Any]:
        info: dict[str, Any] = await _blocking(
            lambda: ref.api.exec_inspect(exec_id), ref.config, idempotent=True
        )
        return info

    polling = AsyncRetrying(
        retry=retry_if_result(lambda info: bool(info.get("Running"))),
        wait=wait_exponential(multiplier=0.005, max=0.25),
        sleep=anyio.sleep,
    )
    info: dict[str, Any] = await polling(inspect)
    return info
