"""Conformance checks of ``exec``: output, timeouts, env and cwd, stdin and argv, limits
and typed errors (registered in :data:`runtimes.testing.checks.CHECKS`)."""

from __future__ import annotations

import hashlib
import random

import anyio

from ..base import Runtime
from ..errors import (
    ExecTimeoutError,
    OutputLimitExceededError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxPermissionError,
    SandboxUserNotFoundError,
    SandboxUserRefusedError,
)
from ..models import MiB
from .checks import (
    assert_names,
    assert_no_process,
    check,
    expect_raises,
    is_root,
    processes_matching,
    scratch_dir,
    unique_token,
    wait_for_processes,
)

# ---------------------------------------------------------------------- exec: output


@check(shares_sandbox=True)
async def check_stdout_exact(rt: Runtime) -> None:
    """stdout is returned byte-exact, with no stripping of whitespace or blank lines."""
    result = await rt.exec(["printf", "  lead\\n\\n trail  \\n\\n"])
    assert result.exit_code == 0, result
    assert result.stdout_bytes == b"  lead\n\n trail  \n\n", result
    assert result.stderr_bytes == b"", result


@check(shares_sandbox=True)
async def check_stderr_separate(rt: Runtime) -> None:
    """stdout and stderr are kept apart."""
    result = await rt.exec(
        ["sh", "-c", "printf out1; printf err1 >&2; printf out2; printf err2 >&2"]
    )
    assert result.stdout_bytes == b"out1out2", result
    assert result.stderr_bytes == b"err1err2", result


@check(shares_sandbox=True)
async def check_large_output_both_streams(rt: Runtime) -> None:
    """2 MiB on each stream at once arrives whole (no pipe deadlock)."""
    script = (
        "head -c 2097152 /dev/zero | tr '\\0' o & head -c 2097152 /dev/zero | tr '\\0' e >&2; wait"
    )
    result = await rt.exec(["sh", "-c", script], timeout=60)
    assert result.stdout_bytes == b"o" * 2 * MiB, len(result.stdout_bytes)
    assert result.stderr_bytes == b"e" * 2 * MiB, len(result.stderr_bytes)


@check(shares_sandbox=True)
async def check_invalid_utf8_output(rt: Runtime) -> None:
    """Invalid UTF-8 output: bytes exact, text with replacement characters."""
    result = await rt.exec(["printf", "a\\377\\376b"])
    assert result.stdout_bytes == b"a\xff\xfeb", result
    assert result.stdout == "a\ufffd\ufffdb", result


@check(shares_sandbox=True)
async def check_exit_codes(rt: Runtime) -> None:
    """Exit codes are returned as is: 0, 1, 42, 255."""
    for code in (0, 1, 42, 255):
        result = await rt.exec(["sh", "-c", f"exit {code}"])
        assert result.exit_code == code, (code, result)


@check(shares_sandbox=True)
async def check_signal_death(rt: Runtime) -> None:
    """A death by signal N is exit code 128 + N."""
    term = await rt.exec(["sh", "-c", "kill -TERM $$"])
    assert term.exit_code == 128 + 15, term
    kill = await rt.exec(["sh", "-c", "kill -KILL $$"])
    assert kill.exit_code == 128 + 9, kill


# ---------------------------------------------------------------------- exec: timeouts


@check(shares_sandbox=True)
async def check_timeout_raises_with_partial_output(rt: Runtime) -> None:
    """timeout= raises ExecTimeoutError carrying the output produced before it."""
    started = anyio.current_time()
    exc = await expect_raises(
        ExecTimeoutError,
        rt.exec(["sh", "-c", "echo started; echo oops >&2; sleep 60"], timeout=1.5),
    )
    elapsed = anyio.current_time() - started
    assert isinstance(exc, ExecTimeoutError) and isinstance(exc, TimeoutError)
    assert exc.stdout_bytes == b"started\n", exc.stdout_bytes
    assert exc.stderr_bytes == b"oops\n", exc.stderr_bytes
    assert elapsed < 15, f"timeout of 1.5s took {elapsed:.1f}s"


@check(shares_sandbox=True)
async def check_timeout_kills_tree(rt: Runtime) -> None:
    """After a timeout no process of the command is left, a sleeping grandchild included."""
    token = unique_token()
    await expect_raises(
        ExecTimeoutError,
        rt.exec(
            ["sh", "-c", f"sleep {token} & sh -c 'sleep {token}' & sleep {token}; wait"],
            timeout=1.5,
        ),
    )
    await assert_no_process(rt, token)


@check(shares_sandbox=True)
async def check_cancellation_kills_tree(rt: Runtime) -> None:
    """Cancelling the awaiting task kills the process tree too."""
    token = unique_token()
    with anyio.move_on_after(1.5) as scope:
        await rt.exec(["sh", "-c", f"sleep {token} & sleep {token}; wait"])
    assert scope.cancelled_caught, "the exec should have been cancelled"
    await assert_no_process(rt, token)
    result = await rt.exec(["echo", "still usable"])
    assert result.stdout == "still usable\n", result


@check(shares_sandbox=True)
async def check_on_output_streams(rt: Runtime) -> None:
    """``on_output`` sees each chunk while the command still runs; the chunks are the result."""
    seen: list[tuple[float, str, bytes]] = []
    result = await rt.exec(
        ["sh", "-c", "printf 'first\\n'; sleep 1.5; printf 'err\\n' >&2; printf 'last\\n'"],
        timeout=60,
        on_output=lambda stream, data: seen.append((anyio.current_time(), stream, data)),
    )
    ended = anyio.current_time()
    assert result.stdout_bytes == b"first\nlast\n" and result.stderr_bytes == b"err\n", result
    assert b"".join(d for _, s, d in seen if s == "stdout") == result.stdout_bytes, seen
    assert b"".join(d for _, s, d in seen if s == "stderr") == result.stderr_bytes, seen
    first_at = next(t for t, s, d in seen if s == "stdout")
    assert ended - first_at > 0.75, f"the first chunk came {ended - first_at:.2f}s before the end"


class _CallbackFailed(Exception):
    pass


@check(shares_sandbox=True)
async def check_on_output_error_kills_tree(rt: Runtime) -> None:
    """An exception raised by ``on_output`` kills the process tree and propagates as is."""
    token = unique_token()

    def refuse(stream: str, data: bytes) -> None:
        raise _CallbackFailed(stream)

    await expect_raises(
        _CallbackFailed,
        rt.exec(
            ["sh", "-c", f"echo go; sleep {token} & sleep {token}; wait"],
            timeout=60,
            on_output=refuse,
        ),
    )
    await assert_no_process(rt, token)
    result = await rt.exec(["echo", "still usable"])
    assert result.stdout == "still usable\n", result


@check(shares_sandbox=True)
async def check_fast_command_not_timed_out(rt: Runtime) -> None:
    """A command that finishes inside its timeout returns normally."""
    result = await rt.exec(["sh", "-c", "sleep 0.2; echo done"], timeout=20)
    assert result.stdout == "done\n", result


@check(shares_sandbox=False)  # leaves a daemon running while it looks
async def check_background_process_keeps_running(rt: Runtime) -> None:
    """A daemon a command starts with its output redirected survives that command."""
    token = unique_token()
    result = await rt.exec(
        ["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 </dev/null & echo ok"], timeout=20
    )
    assert result.stdout == "ok\n", result
    await wait_for_processes(rt, token, 1)
    await anyio.sleep(0.2)
    assert await processes_matching(rt, token), "the background process should still run"
    await rt.exec(["pkill", "-f", f"sleep {token}"])


@check(shares_sandbox=False)  # counts and kills every process the runtime's commands left
async def check_stop_processes(rt: Runtime) -> None:
    """stop_processes() kills what commands left running in the background, nothing else."""
    token = unique_token()
    await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 </dev/null &"], timeout=20)
    await rt.exec(["sh", "-c", f"(setsid sleep {token} >/dev/null 2>&1 </dev/null &)"], timeout=20)
    assert len(await wait_for_processes(rt, token, 2)) == 2
    assert await rt.stop_processes() >= 2
    await assert_no_process(rt, token)
    assert (await rt.exec(["echo", "usable"])).stdout == "usable\n"
    assert await rt.stop_processes() == 0


# ---------------------------------------------------------------------- exec: env, cwd


@check(shares_sandbox=True)
async def check_env(rt: Runtime) -> None:
    """env= adds variables for that call only; values are exact (spaces, empty, unicode)."""
    env = {"VF_A": "x y  z", "VF_EMPTY": "", "VF_U": "ünï\tcode"}
    result = await rt.exec(
        ["sh", "-c", 'printf "%s|%s|%s|%s" "$VF_A" "${VF_EMPTY-unset}" "$VF_U" "$HOME"'], env=env
    )
    out = result.stdout.split("|")
    assert out[:3] == ["x y  z", "", "ünï\tcode"], result
    again = await rt.exec(["sh", "-c", 'printf "%s" "${VF_A-unset}"'])
    assert again.stdout == "unset", again


@check(shares_sandbox=True)
async def check_default_cwd_is_workdir(rt: Runtime) -> None:
    """Without cwd=, commands run in the workdir."""
    assert rt.workdir.startswith("/"), rt.workdir
    result = await rt.exec(["pwd", "-P"])
    real = await rt.exec(["sh", "-c", 'cd "$1" && pwd -P', "sh", rt.workdir])
    assert result.stdout == real.stdout, (result, real)


@check(shares_sandbox=True)
async def check_cwd_absolute_and_relative(rt: Runtime) -> None:
    """cwd= may be absolute, or relative to the workdir."""
    base = await scratch_dir(rt)
    await rt.exec(["mkdir", "-p", f"{base}/sub dir"])
    absolute = await rt.exec(["pwd"], cwd=f"{base}/sub dir")
    assert absolute.stdout == f"{base}/sub dir\n", absolute
    relative_name = base.rsplit("/", 1)[1] + "/sub dir"
    relative = await rt.exec(["pwd"], cwd=relative_name)
    assert relative.stdout == f"{base}/sub dir\n", relative


@check(shares_sandbox=True)
async def check_cwd_missing(rt: Runtime) -> None:
    """A missing cwd is SandboxFileNotFoundError naming it."""
    missing = f"{rt.workdir}/no-such-dir-{unique_token()}"
    exc = await expect_raises(SandboxFileNotFoundError, rt.exec(["true"], cwd=missing))
    assert_names(exc, missing)


# ---------------------------------------------------------------------- exec: stdin, argv


@check(shares_sandbox=True)
async def check_stdin_text(rt: Runtime) -> None:
    """stdin as text is fed and closed."""
    result = await rt.exec(["cat"], stdin="hello\nwörld\n")
    assert result.stdout == "hello\nwörld\n", result


@check(shares_sandbox=True)
async def check_stdin_empty_and_none(rt: Runtime) -> None:
    """Empty or absent stdin reaches EOF at once (cat does not hang)."""
    for stdin in (b"", None):
        result = await rt.exec(["cat"], stdin=stdin, timeout=20)
        assert result.stdout_bytes == b"" and result.exit_code == 0, (stdin, result)


@check(shares_sandbox=True)
async def check_stdin_binary(rt: Runtime) -> None:
    """Binary stdin with NUL bytes and every byte value round-trips."""
    data = bytes(range(256)) * 64 + b"\x00\x00end"
    result = await rt.exec(["cat"], stdin=data, timeout=30)
    assert result.stdout_bytes == data


@check(shares_sandbox=True)
async def check_stdin_50mib(rt: Runtime) -> None:
    """50 MiB of stdin arrives whole."""
    data = random.randbytes(50 * MiB)
    result = await rt.exec(["sha256sum"], stdin=data, timeout=120)
    assert result.stdout.split()[0] == hashlib.sha256(data).hexdigest(), result


@check(shares_sandbox=True)
async def check_stdin_unread(rt: Runtime) -> None:
    """A command that ignores a large stdin still finishes normally."""
    result = await rt.exec(["true"], stdin=b"x" * (4 * MiB), timeout=30)
    assert result.exit_code == 0, result


@check(shares_sandbox=True)
async def check_large_argv(rt: Runtime) -> None:
    """argv totalling more than 1 MiB reaches the program intact."""
    chunks = [random.randbytes(48 * 1024).hex() for _ in range(12)]  # 12 x 96 KiB = 1.1 MiB
    argv = ["sh", "-c", 'for a in "$@"; do printf %s "$a"; done | sha256sum', "sh", *chunks]
    result = await rt.exec(argv, timeout=60)
    expected = hashlib.sha256("".join(chunks).encode()).hexdigest()
    assert result.stdout.split()[0] == expected, result


@check(shares_sandbox=True)
async def check_argv_special_characters(rt: Runtime) -> None:
    """argv items are passed verbatim: quotes, $, backslashes, newlines, unicode, empty."""
    items = ["it's", 'say "hi"', "$HOME", "back\\slash", "new\nline", "tab\there", "ünï", "", "*"]
    result = await rt.exec(["sh", "-c", 'for a in "$@"; do printf "[%s]" "$a"; done', "sh", *items])
    assert result.stdout == "".join(f"[{i}]" for i in items), result


@check(shares_sandbox=True)
async def check_concurrent_execs(rt: Runtime) -> None:
    """Twenty concurrent execs each get their own output."""
    results: dict[int, str] = {}

    async def one(i: int) -> None:
        result = await rt.exec(
            ["sh", "-c", f"sleep 0.{i % 3}; echo {i}; echo e{i} >&2"], timeout=60
        )
        assert result.stderr == f"e{i}\n", result
        results[i] = result.stdout

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(one, i)
    assert results == {i: f"{i}\n" for i in range(20)}


# ---------------------------------------------------------------------- exec: limits and errors


@check(shares_sandbox=True)
async def check_output_limit(rt: Runtime) -> None:
    """Output over the per-call cap raises OutputLimitExceededError with the truncated output."""
    exc = await expect_raises(
        OutputLimitExceededError,
        rt.exec(["head", "-c", "300000", "/dev/zero"], output_limit=100_000, timeout=60),
    )
    assert isinstance(exc, OutputLimitExceededError)
    assert exc.limit == 100_000
    assert len(exc.stdout_bytes) + len(exc.stderr_bytes) == 100_000, len(exc.stdout_bytes)
    assert set(exc.stdout_bytes) <= {0}


@check(shares_sandbox=True)
async def check_output_limit_stops_endless_output(rt: Runtime) -> None:
    """An endless writer is killed at the cap instead of filling memory."""
    token = unique_token()
    exc = await expect_raises(
        OutputLimitExceededError,
        rt.exec(["sh", "-c", f"sleep {token} & yes"], output_limit=1_000_000, timeout=60),
    )
    assert isinstance(exc, OutputLimitExceededError)
    assert exc.stdout_bytes.startswith(b"y\ny\n")
    await assert_no_process(rt, token)


@check(shares_sandbox=True)
async def check_output_at_limit_ok(rt: Runtime) -> None:
    """Output exactly at the cap is returned normally."""
    result = await rt.exec(["head", "-c", "65536", "/dev/zero"], output_limit=65536)
    assert len(result.stdout_bytes) == 65536


@check(shares_sandbox=True)
async def check_missing_program(rt: Runtime) -> None:
    """A program that does not exist is SandboxFileNotFoundError naming it."""
    name = f"vf-no-such-program-{random.randrange(1 << 30)}"
    exc = await expect_raises(SandboxFileNotFoundError, rt.exec([name]))
    assert_names(exc, name)


@check(shares_sandbox=True)
async def check_non_executable_program(rt: Runtime) -> None:
    """A file without the execute bit is SandboxPermissionError naming it."""
    path = f"{await scratch_dir(rt)}/not-exec.sh"
    await rt.write(path, b"#!/bin/sh\necho hi\n")
    await rt.exec(["chmod", "644", path])
    exc = await expect_raises(SandboxPermissionError, rt.exec([path]))
    assert_names(exc, path)


@check(shares_sandbox=True)
async def check_invalid_argv(rt: Runtime) -> None:
    """Empty argv, a shell string, and NUL bytes are SandboxInvalidArgumentError."""
    await expect_raises(SandboxInvalidArgumentError, rt.exec([]))
    await expect_raises(SandboxInvalidArgumentError, rt.exec("echo hi"))
    await expect_raises(SandboxInvalidArgumentError, rt.exec(["echo", "a\x00b"]))


@check(shares_sandbox=True)
async def check_user(rt: Runtime) -> None:
    """user= runs as that user when the sandbox can switch, an unknown user is
    SandboxUserNotFoundError, and a switch the sandbox cannot make SandboxUserRefusedError (a
    SandboxPermissionError)."""
    if await is_root(rt):
        result = await rt.exec(["id", "-un"], user="nobody")
        got = result.stdout.strip()
        assert got == "nobody", (
            f"exec(['id', '-un'], user='nobody'): expected 'nobody' on stdout, got {got!r} "
            f"(exit {result.exit_code}, stderr {result.stderr.strip()[:200]!r})"
        )
        await expect_raises(SandboxUserNotFoundError, rt.exec(["id"], user="vf-no-such-user"))
    else:
        await expect_raises(SandboxUserRefusedError, rt.exec(["id", "-un"], user="root"))
