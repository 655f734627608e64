"""Bad input, on every backend: each gets a clear typed error (or works exactly), within a
bound, and loses nothing.

Paths with ``..``, NUL bytes, newlines, 4 KiB names; argv of 10 MiB; invalid UTF-8 in
argv, env values, paths, stdin, output and file content; FIFOs where a file is expected;
failed writes that must leave the old file intact. Configs, verdicts, plugins and tampered
judge inputs are in ``test_bad_config.py`` and ``test_bad_verdicts.py``.

Backends: subprocess; docker and ssh with the persistent channel (the default) and without
it (the plain path, which images without python3 fall back to); modal against the fake SDK.
"""

from __future__ import annotations

import posixpath
from collections.abc import AsyncIterator
from typing import Any

import pytest

from runtimes import (
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    open_runtime,
)
from runtimes.base import Runtime
from runtimes.models import MiB
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures
from tests.ssh.sshd import SSHServer

from .conftest import TALLY, settle

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.ssh]

LIMIT = 30.0
"""No bad input may take longer than this to be answered."""

BACKENDS = ["subprocess", "docker", "docker-plain", "ssh", "ssh-plain", "modal-fake"]


@pytest.fixture(params=BACKENDS)
async def rt(request: pytest.FixtureRequest, shared_sshd: SSHServer) -> AsyncIterator[Runtime]:
    name = request.param
    config: Any
    if name == "subprocess":
        config = {"type": "subprocess"}
    elif name.startswith("docker"):
        config = {"type": "docker", "channel": name == "docker"}
    elif name.startswith("ssh"):
        config = shared_sshd.config(channel=name == "ssh", io_timeout=10)
    else:
        request.getfixturevalue("fake_modal")
        config = fake_config()
    async with open_runtime(config) as runtime:
        yield runtime


class Tried:
    """Counts the bad inputs a test tried (for the report), and checks each one."""

    def __init__(self, rt: Runtime, category: str) -> None:
        self.rt = rt
        self.category = category
        self.count = 0

    async def raises(self, kind: type[BaseException], call: Any) -> BaseException:
        self.count += 1
        return (await settle(call, LIMIT)).raised(kind)

    async def returns(self, call: Any) -> Any:
        self.count += 1
        outcome = await settle(call, LIMIT)
        assert outcome.error is None, f"{type(outcome.error).__name__}: {outcome.error}"
        return outcome.value

    async def exact_or_refused(self, call: Any, expected: Any) -> str:
        """Invalid text either round-trips exactly or is refused as invalid, never mangled."""
        self.count += 1
        outcome = await settle(call, LIMIT)
        if outcome.error is not None:
            outcome.raised(SandboxInvalidArgumentError)
            return "refused"
        assert outcome.value == expected, f"mangled: {outcome.value!r} != {expected!r}"
        return "exact"

    def done(self) -> None:
        TALLY.add(f"bad input: {self.category} ({self.rt.name})", self.count)


# ---------------------------------------------------------------------- paths


async def test_malformed_paths(rt: Runtime) -> None:
    t = Tried(rt, "paths")
    await rt.write("keep.txt", b"kept")
    for bad in ("a\x00b", "dir/\x00", "\x00"):
        await t.raises(SandboxInvalidArgumentError, rt.read(bad))
        await t.raises(SandboxInvalidArgumentError, rt.write(bad, b"x"))
        await t.raises(SandboxInvalidArgumentError, rt.exists(bad))
        await t.raises(SandboxInvalidArgumentError, rt.remove(bad, missing_ok=True))
        await t.raises(SandboxInvalidArgumentError, rt.exec(["true"], cwd=bad))
    await t.raises(SandboxInvalidArgumentError, rt.read(""))

    long_name = "n" * 4096  # far over NAME_MAX (255)
    deep = "/".join(["d" * 200] * 25)  # every part fine, the whole over PATH_MAX (4095)
    for bad in (long_name, f"sub/{long_name}", deep, "x" * 256):
        await t.raises(SandboxInvalidArgumentError, rt.write(bad, b"x"))
        await t.raises(SandboxInvalidArgumentError, rt.read(bad))
        await t.raises(SandboxInvalidArgumentError, rt.exists(bad))
        await t.raises(SandboxInvalidArgumentError, rt.remove(bad, missing_ok=True))
        await t.raises(SandboxInvalidArgumentError, rt.exec(["true"], cwd=bad))
    at_limit = "m" * 255
    await t.returns(rt.write(at_limit, b"255 bytes is allowed"))
    assert await rt.read(at_limit) == b"255 bytes is allowed"

    # Newlines and ".." are ordinary path characters.
    await t.returns(rt.write("line\nbreak/file\nname", b"nl"))
    assert await rt.read("line\nbreak/file\nname") == b"nl"
    await t.returns(rt.write("a/../dotdot.txt", b"dd"))
    assert await rt.read("dotdot.txt") == b"dd"
    parent, base = posixpath.split(rt.workdir)
    assert await t.returns(rt.read(f"../{base}/dotdot.txt")) == b"dd"
    assert await t.returns(rt.read(f"{rt.workdir}/a/../keep.txt")) == b"kept"
    # POSIX resolves ".." after "missing": no such file. The Docker engine's archive API
    # (the plain path) cleans paths lexically first, so there it is "keep.txt".
    lexical = await settle(rt.read("missing/../keep.txt"), LIMIT)
    if lexical.error is not None:
        lexical.raised(SandboxFileNotFoundError)
    else:
        assert lexical.value == b"kept"

    # Never "/", the workdir or a parent of it, however spelled.
    for target in ("/", "/tmp/..", "/.", ".", "./", rt.workdir, f"{rt.workdir}/", "sub/..", parent):
        await t.raises(SandboxInvalidArgumentError, rt.remove(target))
    assert await rt.read("keep.txt") == b"kept", "the workdir survived"
    assert (await rt.exec(["pwd"])).stdout.strip() == rt.workdir
    t.done()


# ---------------------------------------------------------------------- argv and env


async def test_malformed_argv_and_env(rt: Runtime) -> None:
    t = Tried(rt, "argv and env")
    await t.raises(SandboxInvalidArgumentError, rt.exec([]))
    await t.raises(SandboxInvalidArgumentError, rt.exec("echo shell string"))  # type: ignore[arg-type]
    await t.raises(SandboxInvalidArgumentError, rt.exec(["echo", "a\x00b"]))
    await t.raises(SandboxInvalidArgumentError, rt.exec(["echo", 5]))  # type: ignore[list-item]
    for env in ({"": "v"}, {"A=B": "v"}, {"A\x00": "v"}, {"A": "v\x00"}):
        await t.raises(SandboxInvalidArgumentError, rt.exec(["true"], env=env))
    await t.raises(SandboxInvalidArgumentError, rt.exec(["true"], timeout=0))
    await t.raises(SandboxInvalidArgumentError, rt.exec(["true"], output_limit=0))

    # 10 MiB of argv: over every sandbox kernel's ARG_MAX here (2 MiB), and one string is
    # over MAX_ARG_STRLEN (128 KiB). A clear refusal, on every backend.
    arg_max = int((await rt.exec(["getconf", "ARG_MAX"])).stdout)
    assert arg_max < 10 * MiB, "this sandbox could take 10 MiB of argv: expect it to work"
    one = ["sh", "-c", 'echo "${#1}"', "sh", "x" * (10 * MiB)]
    many = ["sh", "-c", 'echo "$#"', "sh", *(["y" * 1000] * 10_240)]
    for argv in (one, many):
        error = await t.raises(SandboxInvalidArgumentError, rt.exec(argv, timeout=LIMIT))
        assert "limit" in str(error) or "too long" in str(error), error
    assert (await rt.exec(["echo", "usable"])).stdout == "usable\n"

    # Newlines and odd characters travel exactly.
    result = await t.returns(
        rt.exec(["printf", "%s|", "a\nb", " ", "'\"$x`", ""], env={"V": "1\n2"})
    )
    assert result.stdout == "a\nb| |'\"$x`||", result
    env_result = await t.returns(
        rt.exec(["sh", "-c", 'printf %s "$V"'], env={"V": "line1\nline2\n"})
    )
    assert env_result.stdout == "line1\nline2\n"
    t.done()


# ---------------------------------------------------------------------- invalid UTF-8


async def test_invalid_utf8_everywhere(rt: Runtime) -> None:
    t = Tried(rt, "invalid UTF-8")
    raw = b"\xff\xfe\x80 ok \xc3\x28"
    text = raw.decode("utf-8", "surrogateescape")  # how Python spells undecodable bytes

    # Bytes stay bytes: stdin, output, file content.
    echoed = await t.returns(rt.exec(["cat"], stdin=raw))
    assert echoed.stdout_bytes == raw and echoed.stdout == raw.decode("utf-8", "replace")
    printed = await t.returns(rt.exec(["printf", "\\377\\376"]))
    assert printed.stdout_bytes == b"\xff\xfe" and printed.stdout == "\ufffd\ufffd"
    await t.returns(rt.write("bytes.bin", raw))
    assert await rt.read("bytes.bin") == raw

    # Text carrying undecodable bytes: exact bytes, or a clear refusal. Never U+FFFD.
    outcomes = [
        await t.exact_or_refused(_stdout(rt, ["printf", "%s", text]), raw),
        await t.exact_or_refused(_stdout(rt, ["printenv", "V"], env={"V": text}), raw + b"\n"),
        await t.exact_or_refused(_stdout(rt, ["cat"], stdin=text), raw),
        await t.exact_or_refused(_round_trip(rt, f"name-{text}.bin"), b"payload"),
        await t.exact_or_refused(_written_as_text(rt, text), raw),
    ]
    TALLY.add(f"invalid UTF-8 text: exact on {rt.name}", outcomes.count("exact"))
    # A lone surrogate that stands for no byte can never be sent anywhere.
    lone = "bad\ud800"
    await t.raises(SandboxInvalidArgumentError, rt.exec(["echo", lone]))
    await t.raises(SandboxInvalidArgumentError, rt.exec(["true"], env={"V": lone}))
    await t.raises(SandboxInvalidArgumentError, rt.exec(["cat"], stdin=lone))
    await t.raises(SandboxInvalidArgumentError, rt.write(lone, b"x"))
    await t.raises(SandboxInvalidArgumentError, rt.write("ok.txt", lone))
    await t.raises(SandboxInvalidArgumentError, rt.read(lone))
    t.done()


async def _stdout(rt: Runtime, argv: list[str], **kw: Any) -> bytes:
    return (await rt.exec(argv, **kw)).stdout_bytes


async def _round_trip(rt: Runtime, path: str) -> bytes:
    await rt.write(path, b"payload")
    return await rt.read(path)


async def _written_as_text(rt: Runtime, text: str) -> bytes:
    await rt.write("text.bin", text)
    return await rt.read("text.bin")


# ---------------------------------------------------------------------- failed writes


async def test_failed_writes_leave_the_old_file_intact(rt: Runtime) -> None:
    t = Tried(rt, "failed writes")
    await rt.write("old.txt", b"old content")
    await rt.write("dir/inside.txt", b"inside")
    await t.raises(SandboxNotADirectoryError, rt.write("old.txt/child", b"new"))
    await t.raises(SandboxIsADirectoryError, rt.write("dir", b"new"))
    await t.raises(SandboxInvalidArgumentError, rt.write("old.txt\x00", b"new"))
    await t.raises(SandboxInvalidArgumentError, rt.write("old.txt" + "x" * 300, b"new"))
    await t.raises(SandboxInvalidArgumentError, rt.write("old.txt", "text\ud800"))
    await t.raises(SandboxNotADirectoryError, rt.read("old.txt/child"))
    assert await rt.read("old.txt") == b"old content"
    assert await rt.read("dir/inside.txt") == b"inside"
    t.done()


# ---------------------------------------------------------------------- special files


async def test_fifo_is_refused_not_waited_on(rt: Runtime) -> None:
    """A FIFO has no end: reading one (or writing one nobody reads) would wait for ever."""
    t = Tried(rt, "special files")
    made = await rt.exec(["mkfifo", "pipe"])
    assert made.exit_code == 0, made
    (await settle(rt.read("pipe"), 5)).raised(SandboxInvalidArgumentError)  # at once
    written = await settle(rt.write("pipe", b"into the pipe"), 5)  # nobody reads it
    if written.error is not None:
        written.raised(SandboxInvalidArgumentError)
    else:  # replaced by a regular file: then it reads back
        assert await rt.read("pipe") == b"into the pipe"
    t.count += 2
    assert (await rt.exec(["echo", "usable"])).stdout == "usable\n"
    t.done()
