"""Conformance checks of shell sessions (:meth:`runtimes.Runtime.shell`): state that persists,
interrupts that leave the session usable, capped output, byte-exact output, sessions side by
side, a dead session, pty mode and a clean close (registered in
:data:`runtimes.testing.checks.CHECKS`)."""

from __future__ import annotations

import anyio

from ..base import Runtime
from ..errors import ExecTimeoutError, OutputLimitExceededError, ShellSessionError
from ..models import ExecResult, MiB
from ..shell import ShellSession
from .checks import (
    assert_no_process,
    check,
    expect_raises,
    scratch_dir,
    unique_token,
    wait_for_processes,
)

# Seconds a command interrupted by its timeout may take beyond that timeout: SIGINT ends
# `sleep` at once, so this only absorbs a loaded machine, never the SIGKILL grace.
_INTERRUPT_SLACK = 5.0

_UNICODE_TEXT = "héllo wörld ✓ 日本語 🎉\n"
# printf's format: every byte value 0..255 as an octal escape (a NUL and a `%` included).
_ALL_BYTES_FORMAT = "".join(f"\\{b:03o}" for b in range(256))


async def _cwd(sh: ShellSession) -> str:
    result = await sh.run("pwd", timeout=30)
    assert result.exit_code == 0, result
    return result.stdout.strip()


@check(shares_sandbox=True)
async def check_shell_state_persists(rt: Runtime) -> None:
    """A shell session keeps cd, export, functions, aliases, globals and a sourced PATH."""
    scratch = await scratch_dir(rt)
    venv = f"{scratch}/venv"
    activate = (
        f"mkdir -p {venv}/bin && printf '#!/bin/sh\\necho from-venv\\n' > {venv}/bin/vf-tool"
        f" && chmod +x {venv}/bin/vf-tool"
        f" && printf 'export PATH={venv}/bin:$PATH\\nVIRTUAL_ENV={venv}\\n' > {venv}/activate"
    )
    async with rt.shell() as sh:
        setup = [
            f"cd {scratch}",
            "export VF_EXPORTED=exported-value",
            'vf_greet() { echo "hello $1"; }',
            "shopt -s expand_aliases; alias vf_alias='echo aliased'",
            "declare vf_global=1",
            activate,
            f". {venv}/activate",
        ]
        for command in setup:
            result = await sh.run(command, timeout=30)
            assert result.exit_code == 0, (command, result)
        assert await _cwd(sh) == scratch
        probes = {
            "printenv VF_EXPORTED": "exported-value\n",
            "vf_greet world": "hello world\n",
            "vf_alias": "aliased\n",
            "echo $vf_global": "1\n",
            "vf-tool": "from-venv\n",
            'echo "$VIRTUAL_ENV"': f"{venv}\n",
        }
        for command, expected in probes.items():
            result = await sh.run(command, timeout=30)
            assert (result.exit_code, result.stdout) == (0, expected), (command, result)
        for code in (0, 1, 42, 255):
            result = await sh.run(f"(exit {code})", timeout=30)
            assert result.exit_code == code, (code, result)
        failed = await sh.run("echo out; echo err >&2; false", timeout=30)
        assert (failed.exit_code, failed.stdout, failed.stderr) == (1, "out\n", "err\n"), failed


@check(shares_sandbox=True)
async def check_shell_timeout_interrupts_and_continues(rt: Runtime) -> None:
    """A timed-out session command (a sleep, a busy loop) is interrupted; the session lives on."""
    scratch = await scratch_dir(rt)
    token = unique_token()
    async with rt.shell() as sh:
        await sh.run(f"cd {scratch}", timeout=30)
        started = anyio.current_time()
        exc = await expect_raises(
            ExecTimeoutError, sh.run(f"echo started; sleep {token}", timeout=1)
        )
        elapsed = anyio.current_time() - started
        assert isinstance(exc, ExecTimeoutError)
        assert exc.stdout_bytes == b"started\n", exc.stdout_bytes
        assert elapsed < 1 + _INTERRUPT_SLACK, f"a 1 s timeout took {elapsed:.1f}s"
        await assert_no_process(rt, token)
        assert await _cwd(sh) == scratch
        await expect_raises(ExecTimeoutError, sh.run("while true; do sleep 0.1; done", timeout=0.5))
        after = await sh.run("echo still here; pwd", timeout=30)
        assert (after.exit_code, after.stdout) == (0, f"still here\n{scratch}\n"), after


@check(shares_sandbox=True)
async def check_shell_cancellation_interrupts(rt: Runtime) -> None:
    """Cancelling the task awaiting a session command interrupts it; the session lives on."""
    scratch = await scratch_dir(rt)
    token = unique_token()
    async with rt.shell() as sh:
        await sh.run(f"cd {scratch}", timeout=30)
        with anyio.move_on_after(0.5) as scope:
            await sh.run(f"sleep {token}")
        assert scope.cancelled_caught, "the run should have been cancelled"
        await assert_no_process(rt, token)
        assert await _cwd(sh) == scratch


@check(shares_sandbox=True)
async def check_shell_output_capped(rt: Runtime) -> None:
    """Endless output of a session command stops at output_limit; the session lives on."""
    token = unique_token()
    async with rt.shell() as sh:
        exc = await expect_raises(
            OutputLimitExceededError, sh.run(f"yes {token}", output_limit=MiB, timeout=60)
        )
        assert isinstance(exc, OutputLimitExceededError)
        kept = exc.stdout_bytes + exc.stderr_bytes
        assert 0 < len(kept) <= MiB, len(kept)
        line = f"{token}\n".encode()
        assert kept[: len(line) * 10] == line * 10, kept[:100]
        await assert_no_process(rt, token)
        result = await sh.run("echo after", timeout=30)
        assert (result.exit_code, result.stdout) == (0, "after\n"), result


@check(shares_sandbox=True)
async def check_shell_output_byte_exact(rt: Runtime) -> None:
    """Session output is byte-exact: UTF-8 text, all 256 byte values, stderr kept apart."""
    async with rt.shell() as sh:
        text = await sh.run(
            f"printf '%s' '{_UNICODE_TEXT}'; printf 'w\\303\\266rd' >&2", timeout=30
        )
        assert text.stdout_bytes == _UNICODE_TEXT.encode(), text
        assert text.stderr_bytes == "wörd".encode(), text
        binary = await sh.run(f"printf '{_ALL_BYTES_FORMAT}'; printf 'e\\377' >&2", timeout=30)
        assert binary.exit_code == 0, binary
        assert binary.stdout_bytes == bytes(range(256)), binary.stdout_bytes
        assert binary.stderr_bytes == b"e\xff", binary.stderr_bytes
        unterminated = await sh.run("printf 'no newline'", timeout=30)
        assert unterminated.stdout_bytes == b"no newline", unterminated


@check(shares_sandbox=True)
async def check_shell_sessions_side_by_side(rt: Runtime) -> None:
    """Two sessions of one sandbox keep their own state and run at the same time."""
    scratch = await scratch_dir(rt)
    async with rt.shell() as one, rt.shell() as two:
        await one.run(f"cd {scratch}; export VF_ONE=1; vf_only_one() {{ :; }}", timeout=30)
        seen = await two.run(
            'echo "${VF_ONE-unset}"; type vf_only_one >/dev/null 2>&1 || echo no-function; pwd',
            timeout=30,
        )
        assert seen.stdout.splitlines()[:2] == ["unset", "no-function"], seen
        assert seen.stdout.splitlines()[2] != scratch, seen
        # A rendezvous, not a stopwatch: each command waits (30 s at most) for the other's
        # file, so both succeed only when they run at the same time; a stall of the
        # machine's (seen in CI: 20 s) delays them without failing the check.
        results: dict[str, ExecResult] = {}

        async def meet(name: str, session: ShellSession, mine: str, other: str) -> None:
            results[name] = await session.run(
                f"touch {scratch}/{mine}; i=0; while [ ! -e {scratch}/{other} ] && "
                f"[ $i -lt 300 ]; do sleep 0.1; i=$((i + 1)); done; [ -e {scratch}/{other} ]",
                timeout=60,
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(meet, "one", one, "met-one", "met-two")
            tg.start_soon(meet, "two", two, "met-two", "met-one")
        assert all(r.exit_code == 0 for r in results.values()), f"not side by side: {results}"
        assert await _cwd(one) == scratch


@check(shares_sandbox=True)
async def check_shell_dead_session(rt: Runtime) -> None:
    """A session whose shell exits raises ShellSessionError, then and on every later run."""
    async with rt.shell() as sh:
        await expect_raises(ShellSessionError, sh.run("exit 3", timeout=30))
        assert not sh.alive
        again = await expect_raises(ShellSessionError, sh.run("echo hello", timeout=30))
        assert isinstance(again, ShellSessionError) and again.reason, again
    result = await rt.exec(["echo", "runtime fine"])
    assert result.stdout == "runtime fine\n", result
    try:  # an error out of the session's block is the error itself, not a group
        async with rt.shell() as sh:
            await sh.run("exit 4", timeout=30)
    except ShellSessionError as exc:
        assert exc.reason, exc
    else:
        raise AssertionError("a run whose shell exits must raise ShellSessionError")
    async with rt.shell() as fresh:
        assert (await fresh.run("echo fresh", timeout=30)).stdout == "fresh\n"


@check(shares_sandbox=True)
async def check_shell_pty(rt: Runtime) -> None:
    """A pty session has a terminal of the configured size, resize changes it, input= is typed."""
    async with rt.shell(pty=True, size=(30, 100)) as sh:
        tty = await sh.run("tty", timeout=30)
        assert tty.exit_code == 0 and tty.stdout.startswith("/dev/pts/"), tty
        size = await sh.run("stty size", timeout=30)
        assert (size.exit_code, size.stdout.strip()) == (0, "30 100"), size
        await sh.resize(40, 120)
        resized = await sh.run("stty size", timeout=30)
        assert resized.stdout.strip() == "40 120", resized
        interactive = await sh.run("[ -t 0 ] && [ -t 1 ] && echo on-a-terminal", timeout=30)
        assert interactive.stdout.strip() == "on-a-terminal", interactive
        answered = await sh.run('read -r line; echo "got [$line]"', input="hi there\n", timeout=30)
        assert answered.stdout_bytes == b"got [hi there]\r\n", answered


@check(shares_sandbox=True)
async def check_shell_close_leaves_nothing(rt: Runtime) -> None:
    """Closing a session ends its shell, its driver and its background jobs (nohup'd ones too)."""
    token = unique_token()
    async with rt.shell() as sh:
        started = await sh.run(
            f"sleep {token} & nohup sleep {token} >/dev/null 2>&1 & sleep {token} & disown; "
            "echo $$ $PPID",
            timeout=30,
        )
        shell_pid, driver_pid = started.stdout.split()
        await wait_for_processes(rt, token, 3)
    await assert_no_process(rt, token)
    for pid in (shell_pid, driver_pid):
        gone = await rt.exec(["sh", "-c", f"kill -0 {pid} 2>/dev/null || echo gone"])
        assert gone.stdout == "gone\n", f"pid {pid} of the closed session is still running"
