"""Conformance checks of background processes: ``exec`` returns when the command exits
(whatever its background processes do with the pipes they inherited), and
:meth:`Runtime.spawn`'s handles (registered in :data:`runtimes.testing.checks.CHECKS`;
``docs/processes.md``)."""

from __future__ import annotations

import time

import anyio

from ..base import Runtime
from ..errors import ExecTimeoutError
from .checks import (
    assert_no_process,
    check,
    expect_raises,
    processes_matching,
    scratch_dir,
    unique_token,
    wait_for_processes,
)

_PROMPT = 10.0
"""Seconds within which a call that must not wait for a sleeper returns (the sleepers sleep
for minutes; the grace is a fraction of a second: the margin is for slow machines)."""


async def _kill_matching(rt: Runtime, token: str) -> None:
    """Kill the processes of this check (found by ``token``) so the shared sandbox stays clean."""
    for line in await processes_matching(rt, token):
        await rt.exec(["kill", "-9", line.split()[0]])
    await assert_no_process(rt, token)


@check(shares_sandbox=True)
async def check_exec_returns_when_command_exits(rt: Runtime) -> None:
    """``exec`` returns when the command exits, not when the background processes holding
    its stdout/stderr do (``sleep & echo``, and a double fork); they keep running."""
    token = unique_token()
    for script in (f"sleep {token} & echo ok", f"(sleep {token} &); echo ok"):
        started = time.monotonic()
        result = await rt.exec(["sh", "-c", script], timeout=_PROMPT)
        took = time.monotonic() - started
        assert result.exit_code == 0 and result.stdout == "ok\n", (script, result)
        assert took < _PROMPT, f"{script!r} took {took:.1f}s: exec waited for the sleeper"
    await wait_for_processes(rt, token, 2)  # both sleepers still run
    await _kill_matching(rt, token)


@check(shares_sandbox=True)
async def check_exec_keeps_output_within_grace(rt: Runtime) -> None:
    """Output a background process writes just after the command exited (within the grace)
    is in the result; one that writes later is not killed for it (no SIGPIPE, no block)."""
    result = await rt.exec(["sh", "-c", "(sleep 0.05; echo late) & echo ok"], timeout=60)
    assert result.stdout == "ok\nlate\n", result
    mark = f"{await scratch_dir(rt)}/wrote"
    script = f"(sleep 0.5; head -c 300000 /dev/zero; echo; touch {mark}) & echo ok"
    result = await rt.exec(["sh", "-c", script], timeout=60)
    assert result.stdout == "ok\n", result
    for _ in range(100):
        if await rt.exists(mark):
            break
        await anyio.sleep(0.05)
    assert await rt.exists(mark), "the background writer died or blocked once exec returned"
    await rt.exec(["rm", "-rf", mark.rsplit("/", 1)[0]])


@check(shares_sandbox=True)
async def check_spawn_handle(rt: Runtime) -> None:
    """``spawn`` returns at once; the handle streams its output, is listed, times out a
    ``wait`` without killing, and ``kill`` ends its tree (exit 137)."""
    token = unique_token()
    proc = await rt.spawn(["sh", "-c", f"echo started; sleep {token}"])
    assert proc in rt.processes(), rt.processes()
    async for stream, chunk in proc:
        assert (stream, chunk) == ("stdout", b"started\n"), (stream, chunk)
        break
    await wait_for_processes(rt, token, 1)
    exc = await expect_raises(ExecTimeoutError, proc.wait(timeout=0.2))
    assert exc.stdout_bytes == b"started\n", exc  # type: ignore[attr-defined]
    assert proc.running, proc
    assert proc.pid is None or proc.pid > 0, proc
    await proc.kill()
    result = await proc.wait(timeout=_PROMPT)
    assert result.exit_code == 137, result
    assert proc not in rt.processes()
    await assert_no_process(rt, token)
    done = await rt.spawn(["sh", "-c", "echo out; echo err >&2; exit 3"])
    result = await done.wait(timeout=60)
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n"), result


@check(shares_sandbox=True)
async def check_spawn_output_bounded(rt: Runtime) -> None:
    """A chatty background process costs bounded host memory: ``wait`` keeps the last
    ``buffer`` bytes, the unread queue drops its oldest chunks."""
    proc = await rt.spawn(["sh", "-c", "head -c 2000000 /dev/zero; echo end"], buffer=65536)
    result = await proc.wait(timeout=60)
    assert result.exit_code == 0, result
    assert len(result.stdout_bytes) == 65536, len(result.stdout_bytes)
    assert result.stdout_bytes.endswith(b"\0end\n"), result
    assert proc.dropped == 2000004 - 65536, proc.dropped
    kept = b"".join([chunk async for _, chunk in proc])
    assert kept == result.stdout_bytes, len(kept)  # the queue's newest 64 KiB


@check(shares_sandbox=False)
async def check_spawn_ended_by_stop_processes(rt: Runtime) -> None:
    """``stop_processes()`` ends background processes started with ``spawn``, and those an
    ``exec`` left behind."""
    token = unique_token()
    proc = await rt.spawn(["sleep", token])
    await rt.exec(["sh", "-c", f"sleep {token} & echo ok"], timeout=60)
    await wait_for_processes(rt, token, 2)
    await rt.stop_processes()
    result = await proc.wait(timeout=_PROMPT)
    assert result.exit_code == 137, result
    await assert_no_process(rt, token)
