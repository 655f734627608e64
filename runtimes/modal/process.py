"""Commands in a Modal sandbox: ``Sandbox.exec`` under the exec wrapper, stdin in drained
chunks, both output streams pumped into the sink, the process tree killed on timeout, output
cap or cancellation; and the channel agent's process (:class:`_AgentProcess`)."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import AsyncIterable, Awaitable, Callable, Iterator
from typing import Any

import anyio

from ..channel import ChannelTransport
from ..errors import ExecTimeoutError, argument_list_too_long
from ..models import ExecRequest, MiB, OutputSink
from ..scripts import load
from ..stdin_feed import feed_stdin
from ..wrapper import CONTROL_DIR, ReportReader, argv_size, new_nonce, spool_argv, wrapper_argv
from .client import KILL_TIMEOUT, SdkBackend, pump_output, sdk_call

log = logging.getLogger("runtimes.modal")

ARGV_INLINE_LIMIT = 60_000
"""Largest wrapped argv (UTF-8 bytes) sent inline; the SDK's own cap is 65,536 characters."""

STDIN_CHUNK = 1 * MiB
"""Stdin is written and drained in pieces of this size (the SDK buffers at most 16 MiB)."""

DRAIN_AFTER_KILL = 10.0
"""How long output may keep arriving after the process tree was killed."""

_KILL_SCRIPT = load("kill_group", "runtimes.modal.scripts")
"""Kills the process group of one exec nonce (``scripts/kill_group.sh``)."""


class _AgentProcess(ChannelTransport):
    """The channel agent's process (one ``Sandbox.exec`` with stdin), driven through the
    SDK's blocking interface from the channel's threads."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self._chunks: Iterator[Any] | None = None
        self._closed = False

    def recv(self) -> bytes:
        if self._chunks is None:
            self._chunks = iter(self._process.stdout)
        for chunk in self._chunks:
            if chunk:
                return bytes(chunk)
        return b""

    def send(self, data: bytes) -> None:
        self._process.stdin.write(data)
        self._process.stdin.drain()

    def close(self) -> None:
        """EOF to the agent (it then exits, ending the stream), from a thread of its own:
        a dead sandbox or a stopped SDK must not block the caller."""
        if self._closed:
            return
        self._closed = True
        threading.Thread(target=self._send_eof, name="vf-modal-agent-eof", daemon=True).start()

    def _send_eof(self) -> None:
        try:
            self._process.stdin.write_eof()
            self._process.stdin.drain()
        except Exception as exc:  # noqa: BLE001 - the process or the sandbox is gone already
            log.debug("modal: closing the channel agent's stdin failed: %r", exc)


class ModalExec(SdkBackend):
    """The part of :class:`~runtimes.modal.ModalBackend` that runs commands."""

    async def open_stream(self, argv: list[str]) -> ChannelTransport:
        """Start the channel agent: one exec with stdin, for the sandbox's lifetime."""
        sandbox = self._live_sandbox()
        async with self._modal_calls("exec", "the channel agent"):
            process = await sdk_call(sandbox.exec, *argv, text=False)
        return _AgentProcess(process)

    async def spawn(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run the command under the exec wrapper (``runtimes/scripts/exec.sh``, ``track``
        mode: its process group is recorded for :data:`_KILL_SCRIPT`).

        Raises:
            ExecTimeoutError: Modal's own exec timeout fired (the tree was killed).
            SandboxError: the wrapper's report of a command that did not start, typed
                (:func:`runtimes.wrapper.report_error`); an argv too long for the kernel.
        """
        sandbox = self._live_sandbox()
        nonce = new_nonce()
        argv, spooled = await self._command_line(request, nonce)
        async with self._modal_calls("exec", request.argv[0]):
            process = await self._start_process(sandbox, argv, request)
        reader = ReportReader(nonce)
        code = await self._run(sandbox, nonce, process, request, sink, reader)
        if reader.report is None:
            sink.feed("stderr", reader.held)  # no report: the wrapper never ran the command
        if code == -1:  # the SDK's own exec timeout fired: streams ended, wait() said -1
            with anyio.CancelScope(shield=True):
                await self._kill_tree(sandbox, nonce)
            raise ExecTimeoutError(
                list(request.argv), request.timeout, bytes(sink.stdout), bytes(sink.stderr)
            )
        if reader.report is not None and not reader.report.ok:
            raise reader.report.error(request, where=self.describe())
        if spooled and code in (2, 126, 127) and b"Argument list too long" in sink.stderr:
            raise argument_list_too_long(argv_size(request.argv))
        return code

    async def _command_line(self, request: ExecRequest, nonce: str) -> tuple[list[str], bool]:
        """The wrapped argv; when it is too large for the SDK, a short one that has the
        wrapper read its arguments from a file written first (its path last, so that the
        exec names it)."""
        argv = wrapper_argv(request, nonce, mode="track", user=request.user)
        if argv_size(argv) <= ARGV_INLINE_LIMIT:
            return argv, False
        spool = f"{CONTROL_DIR}/{nonce}.argv"
        short, content = spool_argv(argv, spool)
        await self._files("write_bytes", spool, content, spool)
        return [*short, spool], True

    async def _start_process(self, sandbox: Any, argv: list[str], request: ExecRequest) -> Any:
        """The caller's env travels in the wrapper's arguments, not in the SDK's ``env``."""
        timeout = None if request.timeout is None else max(1, math.ceil(request.timeout))
        return await sdk_call(sandbox.exec, *argv, timeout=timeout, text=False)

    async def _run(
        self,
        sandbox: Any,
        nonce: str,
        process: Any,
        request: ExecRequest,
        sink: OutputSink,
        reader: ReportReader,
    ) -> int:
        """Feed stdin, drain both streams (stderr through the wrapper's ``reader``) and wait
        for the exit code.

        When cancelled (timeout, output cap, caller) or when a step fails, the process tree
        is killed first; the output streams are never cancelled mid-read (the SDK's stream
        wrapper cannot close a generator that is still reading) but drained to their EOF,
        which the kill brings, within :data:`DRAIN_AFTER_KILL` seconds.
        """
        failures: list[Exception] = []
        code = -1
        drain_scope = anyio.CancelScope(shield=True)
        stdin_scope = anyio.CancelScope()
        watch_scope = anyio.CancelScope()
        drained = False

        def feed_stdout(chunk: bytes) -> bool:
            return sink.feed("stdout", chunk)

        def feed_stderr(chunk: bytes) -> bool:
            return sink.feed("stderr", reader.feed(chunk))

        async with anyio.create_task_group() as work:

            async def record(step: Callable[[], Awaitable[None]]) -> None:
                try:
                    await step()
                except Exception as exc:  # noqa: BLE001 - re-raised typed after the group
                    failures.append(exc)
                    work.cancel_scope.cancel()

            async def drain() -> None:
                nonlocal drained
                with drain_scope:
                    async with anyio.create_task_group() as pumps:
                        pumps.start_soon(record, lambda: pump_output(process.stdout, feed_stdout))
                        pumps.start_soon(record, lambda: pump_output(process.stderr, feed_stderr))
                drained = True
                watch_scope.cancel()  # ends wait()'s watch after the exit, if it is there

            async def wait() -> None:
                nonlocal code
                try:
                    code = await sdk_call(process.wait)
                    stdin_scope.cancel()
                    if code != -1:  # the exit, maybe before the output ends (docs/processes.md)
                        sink.exited(code)
                    # Background processes may hold the output open: a cancellation from
                    # here on still has to bound the drain (below).
                    with watch_scope:
                        if not drained:
                            await anyio.sleep_forever()
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        if not sink.detached:  # else it exited: what is left is the sweep's
                            await self._kill_tree(sandbox, nonce)
                        drain_scope.deadline = anyio.current_time() + DRAIN_AFTER_KILL
                    raise

            async def feed() -> None:
                stdin = request.stdin
                if stdin is None or isinstance(stdin, bytes):
                    await self._feed_stdin(process, stdin)
                    return
                with stdin_scope:  # the exit ends it: the iterable is not pulled on
                    await self._feed_stdin_source(process, stdin, sink, request.argv[0])

            work.start_soon(drain)
            work.start_soon(record, feed)
            work.start_soon(record, wait)
        if failures:
            raise await self._translate(failures[0], "exec", request.argv[0])
        return code

    async def _feed_stdin(self, process: Any, data: bytes | None) -> None:
        """Send stdin in drained chunks, then EOF. A process that exits first is fine."""
        try:
            view = memoryview(data or b"")
            for offset in range(0, len(view), STDIN_CHUNK):
                process.stdin.write(bytes(view[offset : offset + STDIN_CHUNK]))
                await sdk_call(process.stdin.drain)
            process.stdin.write_eof()
            await sdk_call(process.stdin.drain)
        except Exception as exc:
            # Modal rejects stdin for a process that already exited (the worker reports a
            # dropped write); unread stdin is not an error, anything else is.
            if await self._exited(process):
                log.debug("modal: stdin not fully delivered, the process exited: %r", exc)
                return
            raise

    async def _feed_stdin_source(
        self, process: Any, source: AsyncIterable[bytes], sink: OutputSink, program: str
    ) -> None:
        """Write and drain each chunk ``source`` yields as it yields, then EOF. A process
        that exited stops the writing; a failing source stops the call through ``sink``."""

        async def send(write: Callable[[], None]) -> bool:
            try:
                write()
                await sdk_call(process.stdin.drain)
            except Exception as exc:
                if await self._exited(process):
                    log.debug("modal: stdin not fully delivered, the process exited: %r", exc)
                    return False
                raise await self._translate(exc, "exec", program) from exc
            return True

        async def write(chunk: bytes) -> bool:
            return await send(lambda: process.stdin.write(chunk))

        async def close() -> None:
            await send(process.stdin.write_eof)

        await feed_stdin(source, sink, write, close, size=STDIN_CHUNK)

    async def _exited(self, process: Any) -> bool:
        try:
            return await sdk_call(process.poll) is not None
        except Exception as exc:  # noqa: BLE001 - a probe: the caller re-raises the original
            log.debug("modal: poll of a process failed: %r", exc)
            return False

    async def _kill_tree(self, sandbox: Any, nonce: str) -> None:
        """Kill the command's process group inside the sandbox (best effort, bounded)."""
        try:
            with anyio.fail_after(KILL_TIMEOUT):
                process = await sdk_call(
                    sandbox.exec, "sh", "-c", _KILL_SCRIPT, "sh", nonce, text=False
                )
                await sdk_call(process.wait)
        except Exception as exc:  # noqa: BLE001 - nothing to kill in a dead sandbox; else logged
            if await self._finished():
                log.debug("modal: sandbox %s is gone, nothing to kill", self._sandbox_id)
            else:
                log.warning(
                    "modal: could not kill process group %s in %s: %r",
                    nonce,
                    self._sandbox_id,
                    exc,
                )
