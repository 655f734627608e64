"""Binary-safe framing: every byte value, at every frame boundary, in every direction.

The channel sends stdin and file content in frames (inline in the request up to
``INLINE``, then ``CHUNK``-sized ``DATA`` frames under a ``WINDOW`` of unacknowledged
bytes) and receives output and file content in frames. These tests push data whose sizes
straddle each of those boundaries, containing every byte value, through a real Docker
sandbox, and check that the channel (not the plain path) carried it.
"""

from __future__ import annotations

import hashlib
import random

import anyio
import pytest

from runtimes.channel import CHUNK, INLINE, WINDOW
from runtimes.docker import DockerRuntime
from runtimes.pytest_plugin import DockerRuntimeFactory

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

SIZES = [
    0,
    1,
    255,
    INLINE - 1,
    INLINE,
    INLINE + 1,
    CHUNK,
    CHUNK + 1,
    INLINE + CHUNK + 1,
    WINDOW + CHUNK + 7,
]


def every_byte(size: int, seed: int) -> bytes:
    """``size`` bytes in which every byte value occurs (from 256 bytes on), shuffled."""
    rng = random.Random(seed)
    block = bytearray(range(256))
    data = bytearray()
    while len(data) < size:
        rng.shuffle(block)
        data += block
    return bytes(data[:size])


def assert_channel_served(rt: DockerRuntime, at_least: int) -> None:
    info = rt.channel_info
    assert info.state == "running", info
    assert info.fallbacks == 0 and info.served >= at_least, info


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_stdin_to_stdout_carries_every_byte_value_across_frame_boundaries(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory() as rt:
        for size in SIZES:
            data = every_byte(size, size)
            result = await rt.exec(["cat"], stdin=data, timeout=60)
            assert result.exit_code == 0, (size, result)
            assert result.stdout_bytes == data, size
        assert_channel_served(rt, len(SIZES))


async def test_files_carry_every_byte_value_across_frame_boundaries(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    async with docker_runtime_factory() as rt:
        for size in SIZES:
            data = every_byte(size, size + 1)
            path = f"frames/{size}.bin"
            await rt.write(path, data)
            assert await rt.read(path) == data, size
            sha = (await rt.exec(["sha256sum", path])).stdout.split()[0]
            assert sha == hashlib.sha256(data).hexdigest(), size
        assert_channel_served(rt, 3 * len(SIZES))


async def test_stdout_and_stderr_stay_apart_byte_for_byte(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """A program alternating binary writes to both streams: each arrives whole, in order."""
    program = (
        "import os\n"
        "for i in range(200):\n"
        "    os.write(1, bytes(range(256)) * (i % 5 + 1))\n"
        "    os.write(2, bytes(range(255, -1, -1)) * (i % 3 + 1))\n"
    )
    async with docker_runtime_factory() as rt:
        result = await rt.exec(["python3", "-c", program], timeout=60)
    assert result.stdout_bytes == b"".join(bytes(range(256)) * (i % 5 + 1) for i in range(200))
    assert result.stderr_bytes == b"".join(
        bytes(range(255, -1, -1)) * (i % 3 + 1) for i in range(200)
    )


async def test_request_headers_carry_any_text(docker_runtime_factory: DockerRuntimeFactory) -> None:
    """argv, env, cwd and paths travel in JSON headers: quotes, newlines, NUL-free unicode."""
    odd = ['it\'s "q"', "new\nline", "tab\t", "ünï ✓ 🐍", "\\back", "{}[]:,", "$HOME"]
    async with docker_runtime_factory() as rt:
        directory = "dir with ünï ✓ 🐍 and\nnewline"
        await rt.write(f"{directory}/f {odd[0]}", b"content")
        script = 'for a in "$@"; do printf "[%s]" "$a"; done; printf "|%s|%s" "$VF_K" "$(pwd)"'
        result = await rt.exec(
            ["sh", "-c", script, "sh", *odd],
            env={"VF_K": odd[3] + odd[1]},
            cwd=directory,
        )
        assert result.stdout == "".join(f"[{a}]" for a in odd) + (
            f"|{odd[3]}{odd[1]}|{rt.workdir}/{directory}"
        ), result
        assert await rt.read(f"{directory}/f {odd[0]}") == b"content"
        assert_channel_served(rt, 3)


async def test_large_argv_travels_in_one_frame(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    chunks = [random.randbytes(48 * 1024).hex() for _ in range(12)]  # 1.1 MiB of argv
    argv = ["sh", "-c", 'for a in "$@"; do printf %s "$a"; done | sha256sum', "sh", *chunks]
    async with docker_runtime_factory() as rt:
        result = await rt.exec(argv, timeout=60)
        assert result.stdout.split()[0] == hashlib.sha256("".join(chunks).encode()).hexdigest()
        assert_channel_served(rt, 1)


async def test_a_slow_reader_of_stdin_is_fed_under_the_window(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """A command that reads its stdin slowly gets all of it; the event loop stays free."""
    data = every_byte(3 * WINDOW, 7)
    program = (
        "import sys, time, hashlib\n"
        "h = hashlib.sha256()\n"
        "while chunk := sys.stdin.buffer.read(1 << 20):\n"
        "    h.update(chunk); time.sleep(0.02)\n"
        "print(h.hexdigest())\n"
    )
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.01)
            ticks += 1

    async with docker_runtime_factory() as rt, anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        result = await rt.exec(["python3", "-c", program], stdin=data, timeout=60)
        tg.cancel_scope.cancel()
    assert result.stdout.strip() == hashlib.sha256(data).hexdigest(), result
    assert ticks > 10, "the event loop was blocked while stdin was streamed"
