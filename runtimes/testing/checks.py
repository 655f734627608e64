"""The conformance checks every backend must pass.

Each check is an async function taking a freshly started :class:`~runtimes.Runtime`.
It raises ``AssertionError`` (or any other exception) on failure and
:class:`CheckSkipped` when it does not apply to this sandbox (for example permission
checks inside a sandbox that runs as root, where nothing is unreadable).

The same list drives the pytest suite (:mod:`runtimes.testing.pytest_suite`) and
``vf-sandbox check``.
"""

from __future__ import annotations

import errno
import hashlib
import random
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio

from ..base import Runtime
from ..errors import (
    ExecTimeoutError,
    OutputLimitExceededError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    SandboxUnavailableError,
)
from ..models import MiB

CheckFn = Callable[[Runtime], Awaitable[None]]


class CheckSkipped(Exception):
    """The check does not apply to this sandbox; the message says why."""


@dataclass(frozen=True)
class Check:
    name: str
    fn: CheckFn
    doc: str


CHECKS: list[Check] = []


def check(fn: CheckFn) -> CheckFn:
    name = fn.__name__.removeprefix("check_")
    CHECKS.append(Check(name, fn, (fn.__doc__ or "").strip().splitlines()[0]))
    return fn


# ---------------------------------------------------------------------- helpers


def _token() -> str:
    """A unique sleep duration, so the check can find its own processes with ps."""
    return f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"


async def _processes_matching(rt: Runtime, token: str) -> list[str]:
    result = await rt.exec(["ps", "-eo", "pid,args"], timeout=30)
    return [line for line in result.stdout.splitlines() if token in line and "ps -eo" not in line]


async def _assert_no_process(rt: Runtime, token: str) -> None:
    """Poll briefly: the kill is sent before the error is raised, reaping may lag."""
    left: list[str] = []
    for _ in range(40):
        left = await _processes_matching(rt, token)
        if not left:
            return
        await anyio.sleep(0.05)
    raise AssertionError(f"processes left running in the sandbox: {left}")


async def _is_root(rt: Runtime) -> bool:
    return (await rt.exec(["id", "-u"])).stdout.strip() == "0"


def _assert_names(exc: BaseException, path: str) -> None:
    assert path in str(exc), f"error message does not name {path!r}: {exc}"


async def _scratch(rt: Runtime) -> str:
    path = f"{rt.workdir}/conformance-{random.randrange(1 << 30)}"
    result = await rt.exec(["mkdir", "-p", path])
    assert result.exit_code == 0, result
    return path


async def _raises(
    expected: type[BaseException] | tuple[type[BaseException], ...], awaitable: Awaitable[object]
) -> BaseException:
    try:
        await awaitable
    except expected as exc:
        return exc
    except BaseException as exc:
        raise AssertionError(f"expected {expected}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {expected}, nothing was raised")


# ---------------------------------------------------------------------- exec: output


@check
async def check_stdout_exact(rt: Runtime) -> None:
    """stdout is returned byte-exact, with no stripping of whitespace or blank lines."""
    result = await rt.exec(["printf", "  lead\\n\\n trail  \\n\\n"])
    assert result.exit_code == 0, result
    assert result.stdout_bytes == b"  lead\n\n trail  \n\n", result
    assert result.stderr_bytes == b"", result


@check
async def check_stderr_separate(rt: Runtime) -> None:
    """stdout and stderr are kept apart."""
    result = await rt.exec(
        ["sh", "-c", "printf out1; printf err1 >&2; printf out2; printf err2 >&2"]
    )
    assert result.stdout_bytes == b"out1out2", result
    assert result.stderr_bytes == b"err1err2", result


@check
async def check_large_output_both_streams(rt: Runtime) -> None:
    """2 MiB on each stream at once arrives whole (no pipe deadlock)."""
    script = (
        "head -c 2097152 /dev/zero | tr '\\0' o & head -c 2097152 /dev/zero | tr '\\0' e >&2; wait"
    )
    result = await rt.exec(["sh", "-c", script], timeout=60)
    assert result.stdout_bytes == b"o" * 2 * MiB, len(result.stdout_bytes)
    assert result.stderr_bytes == b"e" * 2 * MiB, len(result.stderr_bytes)


@check
async def check_invalid_utf8_output(rt: Runtime) -> None:
    """Invalid UTF-8 output: bytes exact, text with replacement characters."""
    result = await rt.exec(["printf", "a\\377\\376b"])
    assert result.stdout_bytes == b"a\xff\xfeb", result
    assert result.stdout == "a\ufffd\ufffdb", result


@check
async def check_exit_codes(rt: Runtime) -> None:
    """Exit codes are returned as is: 0, 1, 42, 255."""
    for code in (0, 1, 42, 255):
        result = await rt.exec(["sh", "-c", f"exit {code}"])
        assert result.exit_code == code, (code, result)


@check
async def check_signal_death(rt: Runtime) -> None:
    """A death by signal N is exit code 128 + N."""
    term = await rt.exec(["sh", "-c", "kill -TERM $$"])
    assert term.exit_code == 128 + 15, term
    kill = await rt.exec(["sh", "-c", "kill -KILL $$"])
    assert kill.exit_code == 128 + 9, kill


# ---------------------------------------------------------------------- exec: timeouts


@check
async def check_timeout_raises_with_partial_output(rt: Runtime) -> None:
    """timeout= raises ExecTimeoutError carrying the output produced before it."""
    started = anyio.current_time()
    exc = await _raises(
        ExecTimeoutError,
        rt.exec(["sh", "-c", "echo started; echo oops >&2; sleep 60"], timeout=1.5),
    )
    elapsed = anyio.current_time() - started
    assert isinstance(exc, ExecTimeoutError) and isinstance(exc, TimeoutError)
    assert exc.stdout_bytes == b"started\n", exc.stdout_bytes
    assert exc.stderr_bytes == b"oops\n", exc.stderr_bytes
    assert elapsed < 15, f"timeout of 1.5s took {elapsed:.1f}s"


@check
async def check_timeout_kills_tree(rt: Runtime) -> None:
    """After a timeout no process of the command is left, a sleeping grandchild included."""
    token = _token()
    await _raises(
        ExecTimeoutError,
        rt.exec(
            ["sh", "-c", f"sleep {token} & sh -c 'sleep {token}' & sleep {token}; wait"],
            timeout=1.5,
        ),
    )
    await _assert_no_process(rt, token)


@check
async def check_cancellation_kills_tree(rt: Runtime) -> None:
    """Cancelling the awaiting task kills the process tree too."""
    token = _token()
    with anyio.move_on_after(1.5) as scope:
        await rt.exec(["sh", "-c", f"sleep {token} & sleep {token}; wait"])
    assert scope.cancelled_caught, "the exec should have been cancelled"
    await _assert_no_process(rt, token)
    result = await rt.exec(["echo", "still usable"])
    assert result.stdout == "still usable\n", result


@check
async def check_fast_command_not_timed_out(rt: Runtime) -> None:
    """A command that finishes inside its timeout returns normally."""
    result = await rt.exec(["sh", "-c", "sleep 0.2; echo done"], timeout=20)
    assert result.stdout == "done\n", result


@check
async def check_background_process_keeps_running(rt: Runtime) -> None:
    """A daemon a command starts with its output redirected survives that command."""
    token = _token()
    result = await rt.exec(
        ["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 </dev/null & echo ok"], timeout=20
    )
    assert result.stdout == "ok\n", result
    assert await _processes_matching(rt, token), "the background process should still run"
    await rt.exec(["pkill", "-f", f"sleep {token}"])


@check
async def check_stop_processes(rt: Runtime) -> None:
    """stop_processes() kills what commands left running in the background, nothing else."""
    token = _token()
    await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 </dev/null &"], timeout=20)
    await rt.exec(["sh", "-c", f"(setsid sleep {token} >/dev/null 2>&1 </dev/null &)"], timeout=20)
    assert len(await _processes_matching(rt, token)) == 2
    assert await rt.stop_processes() >= 2
    await _assert_no_process(rt, token)
    assert (await rt.exec(["echo", "usable"])).stdout == "usable\n"
    assert await rt.stop_processes() == 0


# ---------------------------------------------------------------------- exec: env, cwd


@check
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


@check
async def check_default_cwd_is_workdir(rt: Runtime) -> None:
    """Without cwd=, commands run in the workdir."""
    assert rt.workdir.startswith("/"), rt.workdir
    result = await rt.exec(["pwd", "-P"])
    real = await rt.exec(["sh", "-c", 'cd "$1" && pwd -P', "sh", rt.workdir])
    assert result.stdout == real.stdout, (result, real)


@check
async def check_cwd_absolute_and_relative(rt: Runtime) -> None:
    """cwd= may be absolute, or relative to the workdir."""
    base = await _scratch(rt)
    await rt.exec(["mkdir", "-p", f"{base}/sub dir"])
    absolute = await rt.exec(["pwd"], cwd=f"{base}/sub dir")
    assert absolute.stdout == f"{base}/sub dir\n", absolute
    relative_name = base.rsplit("/", 1)[1] + "/sub dir"
    relative = await rt.exec(["pwd"], cwd=relative_name)
    assert relative.stdout == f"{base}/sub dir\n", relative


@check
async def check_cwd_missing(rt: Runtime) -> None:
    """A missing cwd is SandboxFileNotFoundError naming it."""
    missing = f"{rt.workdir}/no-such-dir-{_token()}"
    exc = await _raises(SandboxFileNotFoundError, rt.exec(["true"], cwd=missing))
    _assert_names(exc, missing)


# ---------------------------------------------------------------------- exec: stdin, argv


@check
async def check_stdin_text(rt: Runtime) -> None:
    """stdin as text is fed and closed."""
    result = await rt.exec(["cat"], stdin="hello\nwörld\n")
    assert result.stdout == "hello\nwörld\n", result


@check
async def check_stdin_empty_and_none(rt: Runtime) -> None:
    """Empty or absent stdin reaches EOF at once (cat does not hang)."""
    for stdin in (b"", None):
        result = await rt.exec(["cat"], stdin=stdin, timeout=20)
        assert result.stdout_bytes == b"" and result.exit_code == 0, (stdin, result)


@check
async def check_stdin_binary(rt: Runtime) -> None:
    """Binary stdin with NUL bytes and every byte value round-trips."""
    data = bytes(range(256)) * 64 + b"\x00\x00end"
    result = await rt.exec(["cat"], stdin=data, timeout=30)
    assert result.stdout_bytes == data


@check
async def check_stdin_50mib(rt: Runtime) -> None:
    """50 MiB of stdin arrives whole."""
    data = random.randbytes(50 * MiB)
    result = await rt.exec(["sha256sum"], stdin=data, timeout=120)
    assert result.stdout.split()[0] == hashlib.sha256(data).hexdigest(), result


@check
async def check_stdin_unread(rt: Runtime) -> None:
    """A command that ignores a large stdin still finishes normally."""
    result = await rt.exec(["true"], stdin=b"x" * (4 * MiB), timeout=30)
    assert result.exit_code == 0, result


@check
async def check_large_argv(rt: Runtime) -> None:
    """argv totalling more than 1 MiB reaches the program intact."""
    chunks = [random.randbytes(48 * 1024).hex() for _ in range(12)]  # 12 x 96 KiB = 1.1 MiB
    argv = ["sh", "-c", 'for a in "$@"; do printf %s "$a"; done | sha256sum', "sh", *chunks]
    result = await rt.exec(argv, timeout=60)
    expected = hashlib.sha256("".join(chunks).encode()).hexdigest()
    assert result.stdout.split()[0] == expected, result


@check
async def check_argv_special_characters(rt: Runtime) -> None:
    """argv items are passed verbatim: quotes, $, backslashes, newlines, unicode, empty."""
    items = ["it's", 'say "hi"', "$HOME", "back\\slash", "new\nline", "tab\there", "ünï", "", "*"]
    result = await rt.exec(["sh", "-c", 'for a in "$@"; do printf "[%s]" "$a"; done', "sh", *items])
    assert result.stdout == "".join(f"[{i}]" for i in items), result


@check
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


@check
async def check_output_limit(rt: Runtime) -> None:
    """Output over the per-call cap raises OutputLimitExceededError with the truncated output."""
    exc = await _raises(
        OutputLimitExceededError,
        rt.exec(["head", "-c", "300000", "/dev/zero"], output_limit=100_000, timeout=60),
    )
    assert isinstance(exc, OutputLimitExceededError)
    assert exc.limit == 100_000
    assert len(exc.stdout_bytes) + len(exc.stderr_bytes) == 100_000, len(exc.stdout_bytes)
    assert set(exc.stdout_bytes) <= {0}


@check
async def check_output_limit_stops_endless_output(rt: Runtime) -> None:
    """An endless writer is killed at the cap instead of filling memory."""
    token = _token()
    exc = await _raises(
        OutputLimitExceededError,
        rt.exec(["sh", "-c", f"sleep {token} & yes"], output_limit=1_000_000, timeout=60),
    )
    assert isinstance(exc, OutputLimitExceededError)
    assert exc.stdout_bytes.startswith(b"y\ny\n")
    await _assert_no_process(rt, token)


@check
async def check_output_at_limit_ok(rt: Runtime) -> None:
    """Output exactly at the cap is returned normally."""
    result = await rt.exec(["head", "-c", "65536", "/dev/zero"], output_limit=65536)
    assert len(result.stdout_bytes) == 65536


@check
async def check_missing_program(rt: Runtime) -> None:
    """A program that does not exist is SandboxFileNotFoundError naming it."""
    name = f"vf-no-such-program-{random.randrange(1 << 30)}"
    exc = await _raises(SandboxFileNotFoundError, rt.exec([name]))
    _assert_names(exc, name)


@check
async def check_non_executable_program(rt: Runtime) -> None:
    """A file without the execute bit is SandboxPermissionError naming it."""
    path = f"{await _scratch(rt)}/not-exec.sh"
    await rt.write(path, b"#!/bin/sh\necho hi\n")
    await rt.exec(["chmod", "644", path])
    exc = await _raises(SandboxPermissionError, rt.exec([path]))
    _assert_names(exc, path)


@check
async def check_invalid_argv(rt: Runtime) -> None:
    """Empty argv, a shell string, and NUL bytes are SandboxInvalidArgumentError."""
    await _raises(SandboxInvalidArgumentError, rt.exec([]))
    await _raises(SandboxInvalidArgumentError, rt.exec("echo hi"))
    await _raises(SandboxInvalidArgumentError, rt.exec(["echo", "a\x00b"]))


@check
async def check_user(rt: Runtime) -> None:
    """user= runs as that user when the sandbox can switch, else a typed permission error."""
    if await _is_root(rt):
        result = await rt.exec(["id", "-un"], user="nobody")
        assert result.stdout.strip() == "nobody", result
    else:
        await _raises(SandboxPermissionError, rt.exec(["id", "-un"], user="root"))


# ---------------------------------------------------------------------- files: round trips


@check
async def check_file_round_trip(rt: Runtime) -> None:
    """write then read returns the same bytes, and exec sees the file."""
    path = f"{await _scratch(rt)}/hello.txt"
    await rt.write(path, b"hello\n")
    assert await rt.read(path) == b"hello\n"
    assert (await rt.exec(["cat", path])).stdout_bytes == b"hello\n"


@check
async def check_file_empty(rt: Runtime) -> None:
    """An empty file round-trips."""
    path = f"{await _scratch(rt)}/empty"
    await rt.write(path, b"")
    assert await rt.read(path) == b""
    assert (await rt.exec(["wc", "-c", path])).stdout.split()[0] == "0"


@check
async def check_file_binary(rt: Runtime) -> None:
    """Every byte value, NULs and invalid UTF-8 round-trip."""
    path = f"{await _scratch(rt)}/binary.bin"
    data = bytes(range(256)) * 17 + b"\xff\xfe\x00\xc3\x28"
    await rt.write(path, data)
    assert await rt.read(path) == data
    sha = (await rt.exec(["sha256sum", path])).stdout.split()[0]
    assert sha == hashlib.sha256(data).hexdigest()


@check
async def check_file_text(rt: Runtime) -> None:
    """write() accepts text and stores it as UTF-8."""
    path = f"{await _scratch(rt)}/text.txt"
    await rt.write(path, "ünïcødé ✓\n")
    assert await rt.read(path) == "ünïcødé ✓\n".encode()


@check
async def check_file_50mib(rt: Runtime) -> None:
    """A 50 MiB file round-trips both ways, verified by hash inside the sandbox."""
    path = f"{await _scratch(rt)}/big.bin"
    data = random.randbytes(50 * MiB)
    await rt.write(path, data)
    sha = (await rt.exec(["sha256sum", path], timeout=120)).stdout.split()[0]
    assert sha == hashlib.sha256(data).hexdigest()
    back = await rt.read(path)
    assert len(back) == len(data) and back == data


@check
async def check_file_special_names(rt: Runtime) -> None:
    """Names with spaces, quotes, newlines, unicode and leading dashes round-trip."""
    base = await _scratch(rt)
    names = [
        "with space",
        "it's",
        'say "hi"',
        "new\nline",
        "ünïcødé",
        "-dash",
        "$dollar",
        "back\\slash",
    ]
    for i, name in enumerate(names):
        await rt.write(f"{base}/{name}", f"content {i}".encode())
    for i, name in enumerate(names):
        assert await rt.read(f"{base}/{name}") == f"content {i}".encode(), name
        assert await rt.exists(f"{base}/{name}"), name
    listing = await rt.exec(
        ["sh", "-c", 'cd "$1" && for f in *; do printf "%s\\0" "$f"; done', "sh", base]
    )
    assert sorted(listing.stdout_bytes.decode().split("\0")[:-1]) == sorted(names), listing


@check
async def check_write_creates_parents(rt: Runtime) -> None:
    """write() creates missing parent directories."""
    path = f"{await _scratch(rt)}/a/b/c/d.json"
    await rt.write(path, b"{}")
    assert await rt.read(path) == b"{}"


@check
async def check_write_overwrites(rt: Runtime) -> None:
    """write() replaces old content entirely, a longer old file included."""
    path = f"{await _scratch(rt)}/over"
    await rt.write(path, b"a much longer original content")
    await rt.write(path, b"short")
    assert await rt.read(path) == b"short"


@check
async def check_write_keeps_file_and_leaves_nothing_beside(rt: Runtime) -> None:
    """Overwriting keeps the file's mode, writes through a symlink (the link stays a link)
    and leaves no temporary file next to the target."""
    base = await _scratch(rt)
    await rt.write(f"{base}/tool.sh", b"#!/bin/sh\necho old\n")
    await rt.exec(["chmod", "750", f"{base}/tool.sh"])
    await rt.exec(["ln", "-s", "tool.sh", f"{base}/link"])
    await rt.write(f"{base}/link", b"#!/bin/sh\necho new\n")
    await rt.write(f"{base}/fresh", b"fresh")
    assert (await rt.exec([f"{base}/tool.sh"])).stdout == "new\n"
    state = await rt.exec(
        ["sh", "-c", 'cd "$1" && stat -c "%a" tool.sh && readlink link && ls -A', "sh", base]
    )
    assert state.stdout.split("\n")[:-1] == ["750", "tool.sh", "fresh", "link", "tool.sh"], (
        state.stdout
    )


@check
async def check_relative_paths(rt: Runtime) -> None:
    """Relative file paths resolve against the workdir."""
    name = f"rel-{random.randrange(1 << 30)}/x.txt"
    await rt.write(name, b"rel")
    assert await rt.read(f"{rt.workdir}/{name}") == b"rel"
    assert (await rt.exec(["cat", name])).stdout == "rel"
    assert await rt.exists(name)


@check
async def check_read_follows_symlink(rt: Runtime) -> None:
    """read() follows a symlink to its target."""
    base = await _scratch(rt)
    await rt.write(f"{base}/target", b"through the link")
    await rt.exec(["ln", "-s", f"{base}/target", f"{base}/link"])
    assert await rt.read(f"{base}/link") == b"through the link"


# ---------------------------------------------------------------------- files: typed errors


@check
async def check_read_missing(rt: Runtime) -> None:
    """Reading a missing file is SandboxFileNotFoundError (a FileNotFoundError) naming it."""
    path = f"{rt.workdir}/missing-{random.randrange(1 << 30)}.txt"
    exc = await _raises(SandboxFileNotFoundError, rt.read(path))
    assert isinstance(exc, FileNotFoundError) and not isinstance(exc, SandboxUnavailableError)
    assert exc.errno == errno.ENOENT and exc.filename == path, (exc.errno, exc.filename)
    _assert_names(exc, path)


@check
async def check_read_directory(rt: Runtime) -> None:
    """Reading a directory is SandboxIsADirectoryError naming it."""
    base = await _scratch(rt)
    exc = await _raises(SandboxIsADirectoryError, rt.read(base))
    assert isinstance(exc, IsADirectoryError)
    _assert_names(exc, base)


@check
async def check_write_to_directory(rt: Runtime) -> None:
    """Writing over a directory is SandboxIsADirectoryError naming it."""
    base = await _scratch(rt)
    exc = await _raises(SandboxIsADirectoryError, rt.write(base, b"x"))
    _assert_names(exc, base)


@check
async def check_read_under_file(rt: Runtime) -> None:
    """Reading file/child where file is a regular file is SandboxNotADirectoryError."""
    base = await _scratch(rt)
    await rt.write(f"{base}/file", b"x")
    exc = await _raises(SandboxNotADirectoryError, rt.read(f"{base}/file/child"))
    assert isinstance(exc, NotADirectoryError)
    _assert_names(exc, f"{base}/file/child")


@check
async def check_write_under_file(rt: Runtime) -> None:
    """Writing file/child where file is a regular file is SandboxNotADirectoryError."""
    base = await _scratch(rt)
    await rt.write(f"{base}/file", b"x")
    exc = await _raises(SandboxNotADirectoryError, rt.write(f"{base}/file/child", b"y"))
    _assert_names(exc, f"{base}/file/child")
    assert await rt.read(f"{base}/file") == b"x", "the existing file must be untouched"


@check
async def check_unreadable_file(rt: Runtime) -> None:
    """Reading a file without read permission is SandboxPermissionError (non-root sandboxes)."""
    if await _is_root(rt):
        raise CheckSkipped("the sandbox user is root: every file is readable")
    path = f"{await _scratch(rt)}/secret"
    await rt.write(path, b"x")
    await rt.exec(["chmod", "000", path])
    exc = await _raises(SandboxPermissionError, rt.read(path))
    assert isinstance(exc, PermissionError)
    _assert_names(exc, path)


@check
async def check_unwritable_directory(rt: Runtime) -> None:
    """Writing into a read-only directory is SandboxPermissionError (non-root sandboxes)."""
    if await _is_root(rt):
        raise CheckSkipped("the sandbox user is root: every directory is writable")
    base = await _scratch(rt)
    await rt.exec(["mkdir", f"{base}/ro"])
    await rt.exec(["chmod", "555", f"{base}/ro"])
    exc = await _raises(SandboxPermissionError, rt.write(f"{base}/ro/file", b"x"))
    _assert_names(exc, f"{base}/ro/file")


@check
async def check_read_limit(rt: Runtime) -> None:
    """read(max_bytes=) refuses a larger file with OutputLimitExceededError; equal size is fine."""
    path = f"{await _scratch(rt)}/sized"
    await rt.write(path, b"x" * 1000)
    assert await rt.read(path, max_bytes=1000) == b"x" * 1000
    exc = await _raises(OutputLimitExceededError, rt.read(path, max_bytes=999))
    assert isinstance(exc, OutputLimitExceededError) and exc.limit == 999


@check
async def check_invalid_paths(rt: Runtime) -> None:
    """A NUL byte or an empty path is SandboxInvalidArgumentError, for every file call."""
    for bad in ("a\x00b", ""):
        await _raises(SandboxInvalidArgumentError, rt.read(bad))
        await _raises(SandboxInvalidArgumentError, rt.write(bad, b""))
        await _raises(SandboxInvalidArgumentError, rt.exists(bad))


# ---------------------------------------------------------------------- files: exists, remove


@check
async def check_exists(rt: Runtime) -> None:
    """exists() is True for files, directories and dangling symlinks; False when missing."""
    base = await _scratch(rt)
    await rt.write(f"{base}/f", b"")
    await rt.exec(["ln", "-s", f"{base}/nowhere", f"{base}/dangling"])
    assert await rt.exists(f"{base}/f")
    assert await rt.exists(base)
    assert await rt.exists(f"{base}/dangling")
    assert not await rt.exists(f"{base}/missing")
    assert not await rt.exists(f"{base}/missing/deeper")
    assert not await rt.exists(f"{base}/f/under-a-file")


@check
async def check_remove(rt: Runtime) -> None:
    """remove() deletes files and whole trees; a missing path is SandboxFileNotFoundError."""
    base = await _scratch(rt)
    await rt.write(f"{base}/tree/a/b.txt", b"b")
    await rt.write(f"{base}/file", b"f")
    await rt.remove(f"{base}/file")
    assert not await rt.exists(f"{base}/file")
    await rt.remove(f"{base}/tree")
    assert not await rt.exists(f"{base}/tree")
    exc = await _raises(SandboxFileNotFoundError, rt.remove(f"{base}/tree"))
    _assert_names(exc, f"{base}/tree")
    await rt.remove(f"{base}/tree", missing_ok=True)


@check
async def check_remove_symlink_not_target(rt: Runtime) -> None:
    """remove() of a symlink to a directory removes the link, not the target."""
    base = await _scratch(rt)
    await rt.write(f"{base}/real/keep.txt", b"keep")
    await rt.exec(["ln", "-s", f"{base}/real", f"{base}/link"])
    await rt.remove(f"{base}/link")
    assert await rt.read(f"{base}/real/keep.txt") == b"keep"


# ---------------------------------------------------------------------- files: trees


def _make_local_tree(root: Path) -> dict[str, bytes]:
    files = {
        "top.txt": b"top\n",
        "empty": b"",
        "nested/deeper/bin.dat": bytes(range(256)) * 8,
        "nested/with space.txt": b"spaced",
        "nested/ünï.txt": "ünï".encode(),
    }
    for rel, data in files.items():
        target = root / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    (root / "empty-dir").mkdir()
    return files


def _read_local_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@check
async def check_upload_download_tree(rt: Runtime) -> None:
    """upload() then download() of a tree keeps every file, byte for byte, and empty dirs."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "src")
        files = _make_local_tree(src)
        remote = f"{await _scratch(rt)}/uploaded"
        await rt.upload(src, remote)
        for rel, data in files.items():
            assert await rt.read(f"{remote}/{rel}") == data, rel
        assert (await rt.exec(["test", "-d", f"{remote}/empty-dir"])).exit_code == 0
        dst = Path(tmp, "dst")
        await rt.download(remote, dst)
        assert _read_local_tree(dst) == files
        assert (dst / "empty-dir").is_dir()


@check
async def check_upload_download_file(rt: Runtime) -> None:
    """upload()/download() of a single file."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "one.bin")
        src.write_bytes(b"\x00one\xff")
        remote = f"{await _scratch(rt)}/dir/one.bin"
        await rt.upload(src, remote)
        assert await rt.read(remote) == b"\x00one\xff"
        dst = Path(tmp, "out", "copy.bin")
        await rt.download(remote, dst)
        assert dst.read_bytes() == b"\x00one\xff"


@check
async def check_download_missing(rt: Runtime) -> None:
    """download() of a missing path is SandboxFileNotFoundError naming it."""
    missing = f"{rt.workdir}/missing-{random.randrange(1 << 30)}"
    with tempfile.TemporaryDirectory() as tmp:
        exc = await _raises(SandboxFileNotFoundError, rt.download(missing, Path(tmp, "x")))
    _assert_names(exc, missing)


@check
async def check_concurrent_files(rt: Runtime) -> None:
    """Concurrent writes and reads of different files do not mix."""
    base = await _scratch(rt)
    payloads = {i: random.randbytes(random.randint(0, 200_000)) for i in range(16)}

    async def one(i: int) -> None:
        await rt.write(f"{base}/f{i}", payloads[i])
        assert await rt.read(f"{base}/f{i}") == payloads[i], i

    async with anyio.create_task_group() as tg:
        for i in payloads:
            tg.start_soon(one, i)


# ---------------------------------------------------------------------- lifecycle


@check
async def check_workdir_exists(rt: Runtime) -> None:
    """The workdir is an absolute, existing, writable directory."""
    assert rt.workdir.startswith("/")
    result = await rt.exec(["sh", "-c", 'test -d "$1" && test -w "$1"', "sh", rt.workdir])
    assert result.exit_code == 0, result


@check
async def check_alive_and_closed(rt: Runtime) -> None:
    """alive() is True while open; after close() every call is SandboxUnavailableError."""
    assert await rt.alive()
    await rt.close()
    assert not await rt.alive()
    for call in (
        rt.exec(["true"]),
        rt.read("/etc/hostname"),
        rt.write("x", b""),
        rt.exists("x"),
        rt.remove("x"),
    ):
        exc = await _raises(SandboxUnavailableError, call)
        assert not isinstance(exc, FileNotFoundError)


@check
async def check_close_twice(rt: Runtime) -> None:
    """close() twice is harmless."""
    await rt.close()
    await rt.close()
    assert rt.closed


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    status: str  # "pass", "fail", "skip"
    detail: str
    seconds: float
