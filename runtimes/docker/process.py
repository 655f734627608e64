"""One command in a Docker container: the wrapper's report read off the engine's framed
output, and the typed errors for a command that could not start.

Each command runs through the one exec wrapper (``runtimes/scripts/exec.sh``,
:mod:`runtimes.wrapper`) in ``exec`` mode: it changes to ``cwd``, checks the program (so a
missing or non-executable program is a typed error, never a guessed exit code), applies the
caller's environment, reports on stderr and ``exec``\\ s the program. Docker makes every exec a
session and process-group leader, so the reported group is the command's own pid.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import (
    SandboxError,
    SandboxTransportError,
    SandboxUnavailableError,
    argument_list_too_long,
    cannot_run_as,
    no_such_user,
)
from ..models import ExecRequest, OutputSink
from ..sweep import kill_argv
from ..wrapper import ReportReader, WrapperReport, argv_size, new_nonce, wrapper_argv
from .client import (
    KILL_WAIT,
    ContainerRef,
    check_running,
    engine_call,
    engine_name,
    kill_as_root,
)
from .config import is_root_user
from .sdk_errors import Refusal, api_message, not_engine_text
from .stream import (
    ExecStream,
    Hijacked,
    close_exec_stream,
    hijack,
    open_exec_stream,
    pump_frames,
    start_stdin,
    take_frames,
)

log = logging.getLogger("runtimes.docker")

_ENGINE_TEXT_MAX = 2000  # an error message, not the output of a shell that never reported


@dataclass
class ExecOutput:
    """Demultiplexes the engine's framed stream (:func:`.stream.take_frames`) and reads the
    wrapper's report. The wrapper reports on stderr before the command runs; stdout is held
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
        keep_going = True
        for kind, payload in take_frames(self._frames):
            if payload and not self._route(kind, payload):
                keep_going = False
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


def engine_exec_error(text: str, request: ExecRequest, where: str) -> SandboxError:
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


async def start_exec(ref: ContainerRef, request: ExecRequest, nonce: str) -> Hijacked:
    """Create the command's exec (through the wrapper, which reports under ``nonce``) and
    start it on a hijacked connection.

    Raises:
        SandboxUnavailableError: the container is gone.
        SandboxInvalidArgumentError: text the engine cannot carry, or an argv too long.
        SandboxError: the engine refused to start the command.
    """
    api = ref.api
    user = request.user if request.user is not None else ref.user
    # The caller's environment travels in the wrapper's arguments, never to the engine.
    command = wrapper_argv(request, nonce, mode="exec")
    for text in command:
        try:
            text.encode("utf-8")  # the engine would turn a lone surrogate into U+FFFD
        except UnicodeEncodeError as exc:
            raise not_engine_text(exc, engine_name(ref.config)) from None

    def create_and_start() -> Hijacked:
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
        return hijack(api, str(created["Id"]))

    refusal = Refusal(lambda text: engine_exec_error(text, request, ref.describe), ref.describe)
    return await engine_call(create_and_start, ref.config, refusal=refusal)


async def await_announcement(stream: ExecStream, output: ExecOutput) -> None:
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


async def watch_exit(ref: ContainerRef, exec_id: str, output: ExecOutput) -> None:
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
            info = await engine_call(  # abandoned when the output ends first
                lambda: ref.api.exec_inspect(exec_id), ref.config, abandon_on_cancel=True
            )
        except (docker.errors.APIError, SandboxError):
            return
        code = info.get("ExitCode")
        if not info.get("Running") and isinstance(code, int):
            output.sink.exited(code)
            return


async def wait_for_exit(ref: ContainerRef, exec_id: str) -> dict[str, Any]:
    """The engine's inspection of an exec once it stopped running.

    The output can end before the process does (it closed its stdout and stderr): wait for
    the exit like a local wait() would; timeout= bounds it.

    Raises:
        docker.errors.APIError: the engine lost the exec.
    """
    from tenacity import AsyncRetrying, retry_if_result, wait_exponential

    async def inspect() -> dict[str, Any]:
        info: dict[str, Any] = await engine_call(
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


SIGKILLED = 128 + 9

RunOwn = Callable[[ExecRequest, OutputSink], Awaitable[int]]
"""Runs one of the runtime's own commands (:func:`own_request`) to its exit code."""


def own_request(
    argv: list[str],
    *,
    stdin: bytes | None = None,
    limit: int = 1 << 20,
    user: str | None = None,
    env: Mapping[str, str] | None = None,
) -> tuple[ExecRequest, OutputSink]:
    """A request for the runtime's own commands (cwd ``/``, so a deleted workdir cannot
    break them; ``env`` over the container's), with its sink."""
    request = ExecRequest(
        argv=tuple(argv),
        cwd="/",
        env=dict(env or {}),
        stdin=stdin,
        user=user,
        timeout=None,
        output_limit=limit,
    )
    return request, OutputSink(limit)


async def run_exec(
    ref: ContainerRef,
    request: ExecRequest,
    sink: OutputSink,
    *,
    kill_group: Callable[[int | None], Awaitable[None]],
    died: Callable[[], Awaitable[bool]],
    lost: Callable[[int], None],
) -> int:
    """Run one command in the container and return its exit code.

    ``kill_group`` kills the command's process group when the call ends early (cancelled,
    the output cap); ``died`` says whether a SIGKILL was the container going down; ``lost``
    is told the group of a command this call lost track of (it may still run).

    Raises:
        SandboxError: the command could not start, or the engine lost it (typed as
            :func:`engine_exec_error` and the wrapper's report say).
        SandboxUnavailableError: the container died meanwhile.
        SandboxTransportError: the engine did not answer.
    """
    with anyio.CancelScope(shield=True):
        # Once the engine started the command, nothing may lose the handle on it.
        nonce = new_nonce()
        hijacked = await start_exec(ref, request, nonce)
        stream = await open_exec_stream(hijacked)
    output = ExecOutput(sink, ReportReader(nonce))
    try:
        if hijacked.leftover:
            output.feed(hijacked.leftover)
        async with anyio.create_task_group() as tg:
            start_stdin(tg, stream, request.stdin, sink)
            tg.start_soon(watch_exit, ref, hijacked.exec_id, output)
            await pump_frames(stream, output)
            tg.cancel_scope.cancel()
    except BaseException:
        with anyio.CancelScope(shield=True):
            await await_announcement(stream, output)
            await close_exec_stream(stream, hijacked)
            if not sink.detached:  # else the command exited: what is left is the sweep's
                await kill_group(output.pgid)
        raise
    with anyio.CancelScope(shield=True):
        await close_exec_stream(stream, hijacked)
    try:
        return await _exit_code(ref, hijacked.exec_id, output, request, died)
    except SandboxTransportError:
        if output.pgid is not None:  # lost track of a command that may still run
            lost(output.pgid)
        raise


async def _exit_code(
    ref: ContainerRef,
    exec_id: str,
    output: ExecOutput,
    request: ExecRequest,
    died: Callable[[], Awaitable[bool]],
) -> int:
    import docker.errors

    report = output.report
    if report is not None and not report.ok:
        raise report.error(request, where=ref.describe)
    if report is None:
        await check_running(ref)
        raise engine_exec_error(output.engine_text, request, ref.describe)
    try:
        info = await wait_for_exit(ref, exec_id)
    except docker.errors.APIError as exc:
        await check_running(ref)
        raise SandboxError(f"{ref.describe}: lost track of a command: {api_message(exc)}") from exc
    code = info.get("ExitCode")
    if code is None or code >= 128:
        await check_running(ref)
    if code is None:
        raise SandboxError(f"{ref.describe}: the engine reported no exit code")
    if code == SIGKILLED and await died():
        raise SandboxUnavailableError(f"{ref.describe} died while running {request.argv[0]!r}")
    return int(code)


async def kill_group(ref: ContainerRef, pgid: int) -> bool:
    """Kill a command's process group inside the container and wait for the kill; whether
    it was delivered (a failure is logged: the caller retries it before the next command).

    Runs after the command's stream was closed: the engine handles one container's exit
    events in order, and the exit of a command whose output nobody reads waits for its
    stream, so the kill's own exit could wait behind it.
    """
    try:
        await kill_as_root(ref, kill_argv([pgid]))
    except SandboxError as exc:
        log.warning(
            "could not kill process group %s in %s (retried before the next command): %s",
            pgid,
            ref.describe,
            exc,
        )
        return False
    return True


async def kill_orphan_groups(ref: ContainerRef, mark: str | None, pgids: Collection[int]) -> None:
    """Kill these process groups as root; with ``mark``, only those whose leader still
    carries it (a kill paid late: a restarted container reuses pids).

    Raises:
        SandboxError: the kill could not be delivered.
    """
    await kill_as_root(ref, kill_argv(pgids, mark=mark))


DEATH_WATCH = 3.0
"""Seconds to wait for the engine to report a container stop after a failed probe."""


async def died_with_container(
    run: RunOwn, alive: Callable[[], Awaitable[bool]], where: str
) -> bool:
    """After a command died of SIGKILL: was that the container going down?

    A killed or stopped container takes its commands with it (SIGKILL), and the engine may
    still call it running for a moment. A probe exec (through ``run``) settles it: it works
    in a live container and fails in a dying one; if it fails, the container's state
    (``alive``) is watched (bounded) for the stop the engine is about to report.
    """
    from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_fixed

    request, sink = own_request(["true"], user="0")
    try:
        with anyio.fail_after(KILL_WAIT):
            if await run(request, sink) == 0:
                return False
    except SandboxUnavailableError:
        return True
    except (SandboxError, TimeoutError) as exc:
        log.debug("probe after SIGKILL failed in %s: %s", where, exc)
    watching = AsyncRetrying(
        retry=retry_if_result(lambda running: running),
        stop=stop_after_delay(DEATH_WATCH),
        wait=wait_fixed(0.05),
        sleep=anyio.sleep,
        retry_error_callback=lambda state: True,
    )
    running: bool = await watching(alive)
    return not running


def check_user_ceiling(request: ExecRequest, default_user: str | None) -> None:
    """docker exec could become root in any container; a sandbox configured to run as a
    non-root user keeps that as its ceiling, like any other backend (on both paths: the
    base checks before the channel, whose agent would only refuse).

    Raises:
        SandboxPermissionError: ``request.user`` is root and the sandbox's user is not.
    """
    if request.user is not None and is_root_user(request.user) and not is_root_user(default_user):
        raise cannot_run_as(request.argv[0], request.user, f"the sandbox runs as {default_user!r}")
