"""Conformance checks of incremental stdin (``exec(stdin=<async iterable of bytes>)``):
chunks written as they are yielded, the command ending first, a failing iterable, a large
stream byte-exact, timeouts while the iterable waits (registered in
:data:`runtimes.testing.checks.CHECKS`)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator

import anyio

from ..base import Runtime
from ..errors import ExecTimeoutError, SandboxInvalidArgumentError
from ..models import KiB, MiB, Stream
from .checks import assert_no_process, check, expect_raises, unique_token


class _SourceFailed(Exception):
    """Raised by a check's stdin iterable."""


@check(shares_sandbox=True)
async def check_stdin_iterable_answers_line_by_line(rt: Runtime) -> None:
    """An interactive program is answered line by line: the second line is yielded only
    after the answer to the first came back."""
    answers, answered = anyio.create_memory_object_stream[bytes](16)
    seen = bytearray()

    def on_output(stream: Stream, data: bytes) -> None:
        seen.extend(data)
        if stream == "stdout" and b"\n" in data:
            answers.send_nowait(bytes(seen))

    async def lines() -> AsyncIterator[bytes]:
        yield b"one\n"
        while b"got one\n" not in await answered.receive():
            pass
        yield b"two\n"

    script = 'read a; echo "got $a"; read b; echo "got $b"'
    with answers, answered:
        result = await rt.exec(["sh", "-c", script], stdin=lines(), on_output=on_output, timeout=30)
    assert result.exit_code == 0, result
    assert result.stdout_bytes == b"got one\ngot two\n", result


@check(shares_sandbox=True)
async def check_stdin_iterable_command_exits_first(rt: Runtime) -> None:
    """A command that exits while an endless iterable would still yield returns at once,
    and the iterable is pulled no further."""
    pulled = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal pulled
        while True:
            pulled += 1
            yield b"y\n"
            await anyio.sleep(0.01)

    # Bounds are half the timeout a wait for the iterable would run into: a loaded machine
    # (a CI worker beside others) can stall one exec for seconds, never for that long.
    started = anyio.current_time()
    result = await rt.exec(["sh", "-c", "read a; echo got $a"], stdin=endless(), timeout=60)
    elapsed = anyio.current_time() - started
    assert result.exit_code == 0 and result.stdout_bytes == b"got y\n", result
    assert elapsed < 30, f"exec took {elapsed:.1f}s after the command exited"
    after = pulled
    await anyio.sleep(0.2)
    assert pulled == after, "the iterable was still pulled after exec returned"

    async def silent() -> AsyncIterator[bytes]:
        await anyio.sleep(3600)
        yield b""

    started = anyio.current_time()
    result = await rt.exec(["echo", "done"], stdin=silent(), timeout=60)
    assert result.stdout_bytes == b"done\n", result
    assert anyio.current_time() - started < 30, "exec waited for a silent iterable"


@check(shares_sandbox=True)
async def check_stdin_iterable_closed_early(rt: Runtime) -> None:
    """A command that closes its stdin and runs on is no error: exec returns its result
    while the endless iterable still yields."""

    async def endless() -> AsyncIterator[bytes]:
        while True:
            yield b"x" * (16 * KiB)
            await anyio.sleep(0.005)

    result = await rt.exec(
        ["sh", "-c", "head -c 5 >/dev/null; exec 0<&-; sleep 0.3; echo done"],
        stdin=endless(),
        timeout=30,
    )
    assert result.exit_code == 0 and result.stdout_bytes == b"done\n", result


@check(shares_sandbox=True)
async def check_stdin_iterable_not_read_ahead(rt: Runtime) -> None:
    """An iterable is pulled only as fast as the command reads (host memory stays bounded):
    a command that never reads leaves an endless iterable pulled by a few MiB at most."""
    pulled = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal pulled
        while True:
            pulled += 64 * KiB
            yield bytes(64 * KiB)

    result = await rt.exec(["sleep", "0.5"], stdin=endless(), timeout=30)
    assert result.exit_code == 0, result
    assert pulled <= 16 * MiB, f"{pulled / MiB:.1f} MiB pulled for a command that read nothing"


@check(shares_sandbox=True)
async def check_stdin_iterable_error_kills_tree(rt: Runtime) -> None:
    """An exception raised by the stdin iterable kills the process tree and propagates as
    is; a chunk that is not bytes is a SandboxInvalidArgumentError."""
    token = unique_token()

    async def failing() -> AsyncIterator[bytes]:
        yield b"first\n"
        await anyio.sleep(0.3)
        raise _SourceFailed("the source broke")

    exc = await expect_raises(
        _SourceFailed,
        rt.exec(
            ["sh", "-c", f"sleep {token} & sleep {token}; cat >/dev/null; wait"],
            stdin=failing(),
            timeout=60,
        ),
    )
    assert str(exc) == "the source broke", exc
    await assert_no_process(rt, token)

    async def not_bytes() -> AsyncIterator[object]:
        yield "text, not bytes"

    await expect_raises(
        SandboxInvalidArgumentError,
        rt.exec(["cat"], stdin=not_bytes(), timeout=60),  # type: ignore[arg-type]
    )
    result = await rt.exec(["echo", "still usable"])
    assert result.stdout == "still usable\n", result


@check(shares_sandbox=True)
async def check_stdin_iterable_large_exact(rt: Runtime) -> None:
    """20 MiB yielded in 64 KiB chunks arrive byte-exact (sha256 inside the sandbox)."""
    digest = hashlib.sha256()

    async def chunks() -> AsyncIterator[bytes]:
        for index in range(20 * MiB // (64 * KiB)):
            chunk = (index % 251).to_bytes(1, "big") * (64 * KiB - 1) + b"\n"
            digest.update(chunk)
            yield chunk

    result = await rt.exec(["sha256sum"], stdin=chunks(), timeout=120)
    assert result.exit_code == 0, result
    assert result.stdout.split()[0] == digest.hexdigest(), result


@check(shares_sandbox=True)
async def check_stdin_iterable_timeout_while_waiting(rt: Runtime) -> None:
    """A timeout that falls while the iterable waits kills the tree: ExecTimeoutError."""
    token = unique_token()

    async def stalled() -> AsyncIterator[bytes]:
        yield b"start\n"
        await anyio.sleep(3600)
        yield b"never\n"

    started = anyio.current_time()
    await expect_raises(
        ExecTimeoutError,
        rt.exec(
            ["sh", "-c", f"sleep {token} & cat; wait"],
            stdin=stalled(),
            timeout=1.0,
        ),
    )
    assert anyio.current_time() - started < 15, "the timeout was late"
    await assert_no_process(rt, token)
