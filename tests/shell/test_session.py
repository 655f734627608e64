"""Shell sessions through the public API (``rt.shell()``) on the subprocess runtime, under
asyncio and trio: results, persistence, interrupts, caps, death, cancellation, closing, the
terminal, and argument checking."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from runtimes import (
    ExecTimeoutError,
    OutputLimitExceededError,
    Runtime,
    SandboxInvalidArgumentError,
    ShellSessionError,
    open_runtime,
)
from runtimes.shell import ShellSession

BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])


def play(backend: str, body: Callable[[Runtime], Awaitable[None]]) -> None:
    async def main() -> None:
        async with open_runtime("subprocess") as rt:
            await body(rt)

    anyio.run(main, backend=backend)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@BACKENDS
def test_results_and_state_persist(backend: str) -> None:
    async def body(rt: Runtime) -> None:
        async with rt.shell() as sh:
            assert sh.alive
            first = await sh.run("cd /tmp && export GREETING=hi && f() { echo f:$1; }")
            assert first.exit_code == 0
            second = await sh.run("pwd; f 2; echo $GREETING >&2; (exit 5)")
            assert (second.exit_code, second.stdout, second.stderr) == (5, "/tmp\nf:2\n", "hi\n")
            raw = await sh.run("printf 'caf\\xc3\\xa9 \\xff\\x00'")
            assert raw.stdout_bytes == b"caf\xc3\xa9 \xff\x00"

    play(backend, body)


def test_a_long_script_and_a_large_output_pass_whole() -> None:
    async def body(rt: Runtime) -> None:
        text = "".join(f"line {n} $HOME `x` 'q'\n" for n in range(100_000))  # ~2.7 MB
        async with rt.shell() as sh:
            result = await sh.run(f"cat <<'EOF'\n{text}EOF", output_limit=10_000_000)
            assert result.stdout == text

    play("asyncio", body)


@BACKENDS
def test_timeout_interrupts_and_the_session_lives(backend: str) -> None:
    async def body(rt: Runtime) -> None:
        async with rt.shell() as sh:
            started = time.monotonic()
            with pytest.raises(ExecTimeoutError) as caught:
                await sh.run("echo partial; sleep 30", timeout=0.5)
            assert time.monotonic() - started < 3
            assert caught.value.stdout_bytes == b"partial\n"
            assert (await sh.run("echo next")).stdout == "next\n"

    play(backend, body)


@BACKENDS
def test_endless_output_is_capped_and_the_session_lives(backend: str) -> None:
    async def body(rt: Runtime) -> None:
        async with rt.shell() as sh:
            with pytest.raises(OutputLimitExceededError) as caught:
                await sh.run("yes", output_limit=200_000, timeout=30)
            kept = caught.value.stdout_bytes
            assert len(kept) == 200_000 and set(kept) == {ord("y"), ord("\n")}
            assert (await sh.run("echo next")).stdout == "next\n"

    play(backend, body)


@BACKENDS
def test_cancelling_the_caller_interrupts_the_command(backend: str) -> None:
    async def body(rt: Runtime) -> None:
        async with rt.shell() as sh:
            with anyio.move_on_after(0.4) as scope:
                await sh.run("sleep 30")
            assert scope.cancelled_caught
            assert (await sh.run("echo after")).stdout == "after\n"

    play(backend, body)


@BACKENDS
def test_a_block_cancelled_mid_command_still_cleans_up(backend: str) -> None:
    """Cancelling the task around the whole block must not kill the driver before it cleans
    up (its exec runs shielded): the command, the jobs and the control dir are gone."""

    async def body(rt: Runtime) -> None:
        found: list[str] = []
        with anyio.CancelScope() as scope:
            async with rt.shell() as sh:
                found += (await sh.run("sleep 300 >/dev/null & echo $! $__vf_dir")).stdout.split()
                # The deadline starts now: a busy machine may take a second to get here.
                scope.deadline = anyio.current_time() + 1.0
                await sh.run("sleep 30")
        assert scope.cancelled_caught
        job, control = found
        assert not _alive(int(job))
        assert not Path(control).exists()

    play(backend, body)


@BACKENDS
def test_exit_kills_the_session_for_good(backend: str) -> None:
    async def body(rt: Runtime) -> None:
        async with rt.shell() as sh:
            with pytest.raises(ShellSessionError, match="status 3"):
                await sh.run("echo bye; exit 3")
            assert not sh.alive
            with pytest.raises(ShellSessionError, match="status 3"):
                await sh.run("true")

    play(backend, body)


@BACKENDS
def test_errors_leave_the_block_unwrapped(backend: str) -> None:
    """The session's task group must not wrap the block's exception in an ExceptionGroup:
    ``except ShellSessionError`` around the block has to match."""

    async def body(rt: Runtime) -> None:
        with pytest.raises(ShellSessionError):
            async with rt.shell() as sh:
                await sh.run("exit 3")
        with pytest.raises(KeyError):
            async with rt.shell():
                raise KeyError("mine")

    play(backend, body)


@BACKENDS
def test_two_sessions_side_by_side(backend: str) -> None:
    async def body(rt: Runtime) -> None:
        async with rt.shell() as one, rt.shell() as two:
            await one.run("cd /tmp; X=one")
            await two.run("X=two")
            results: dict[str, str] = {}

            async def slow(name: str, sh: ShellSession) -> None:
                results[name] = (await sh.run("sleep 0.5; echo $X")).stdout

            started = time.monotonic()
            async with anyio.create_task_group() as group:
                group.start_soon(slow, "one", one)
                group.start_soon(slow, "two", two)
            assert time.monotonic() - started < 0.95  # side by side, not one after the other
            assert results == {"one": "one\n", "two": "two\n"}
            assert (await two.run("pwd")).stdout != "/tmp\n"

    play(backend, body)


@BACKENDS
def test_closing_ends_the_shell_and_its_jobs(backend: str) -> None:
    async def body(rt: Runtime) -> None:
        async with rt.shell() as sh:
            job = int((await sh.run("sleep 300 >/dev/null & echo $!")).stdout)
            shell_pid = sh.pid
        assert shell_pid is not None
        assert not _alive(job) and not _alive(shell_pid)
        with pytest.raises(ShellSessionError, match="closed"):
            await sh.run("true")

    play(backend, body)


@BACKENDS
def test_closing_the_runtime_closes_open_sessions(backend: str) -> None:
    async def main() -> None:
        rt = open_runtime("subprocess")
        await rt.start()
        sh = rt.shell()
        async with sh:
            job = int((await sh.run("sleep 300 >/dev/null & echo $!")).stdout)
            await rt.close()
            assert not sh.alive
            assert not _alive(job)
            with pytest.raises(ShellSessionError):
                await sh.run("true")

    anyio.run(main, backend=backend)


@BACKENDS
def test_pty_mode(backend: str) -> None:
    async def body(rt: Runtime) -> None:
        async with rt.shell(pty=True, size=(30, 100)) as sh:
            result = await sh.run("tty; stty size; echo err >&2")
            lines = result.stdout_bytes.split(b"\r\n")
            assert lines[0].startswith(b"/dev/pts/") and lines[1:3] == [b"30 100", b"err"]
            await sh.resize(40, 132)
            assert (await sh.run("stty size")).stdout == "40 132\r\n"
            answered = await sh.run("read -r -p 'name? ' n; echo hi $n", input="bob\n")
            assert answered.stdout_bytes.endswith(b"hi bob\r\n")

    play(backend, body)


def test_missing_bash_or_python_is_a_session_error(tmp_path: Path) -> None:
    (tmp_path / "python3").symlink_to("/usr/bin/python3")  # a PATH with python3, no bash

    async def body(rt: Runtime) -> None:
        with pytest.raises(ShellSessionError, match="no bash"):
            async with rt.shell(env={"PATH": str(tmp_path)}):
                pass
        with pytest.raises(ShellSessionError, match="python3"):
            async with rt.shell(env={"PATH": "/nonexistent"}):
                pass

    play("asyncio", body)


def test_bad_arguments_are_refused() -> None:
    async def body(rt: Runtime) -> None:
        for size in ((0, 80), (24, 70000), (24,), "big"):
            with pytest.raises(SandboxInvalidArgumentError):
                rt.shell(size=size)  # type: ignore[arg-type]
        with pytest.raises(SandboxInvalidArgumentError):
            rt.shell(interrupt_grace=-1)
        with pytest.raises(SandboxInvalidArgumentError):
            async with rt.shell(env={"A=B": "x"}):
                pass
        async with rt.shell() as sh:
            for bad in ("echo \0", "echo \udc80\ud800"):
                with pytest.raises(SandboxInvalidArgumentError):
                    await sh.run(bad)
            with pytest.raises(SandboxInvalidArgumentError):
                await sh.run("true", timeout=0)
            with pytest.raises(SandboxInvalidArgumentError):
                await sh.run("true", output_limit=0)
            with pytest.raises(SandboxInvalidArgumentError, match="pty"):
                await sh.run("cat", input="x")
            with pytest.raises(SandboxInvalidArgumentError, match="pty"):
                await sh.resize(10, 10)
            assert (await sh.run("echo still")).stdout == "still\n"

    play("asyncio", body)
