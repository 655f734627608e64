"""Incremental stdin on Modal's plain path: each chunk the iterable yields is written and
drained through the SDK on its own (``process.stdin.write`` + ``drain``, then
``write_eof``), split at ``STDIN_CHUNK``, never batched with the next."""

from __future__ import annotations

import hashlib
import types
from collections.abc import AsyncIterator

import anyio
import pytest

import runtimes.modal as modal_runtime
from runtimes import open_runtime

from .fake_modal import FakeModalService
from .support import fake_config

pytestmark = pytest.mark.docker


def test_each_yielded_chunk_is_written_and_drained_on_its_own(
    fake_service: FakeModalService, fake_modal: types.ModuleType
) -> None:
    big = bytes(range(256)) * (modal_runtime.STDIN_CHUNK // 256) + b"tail"
    chunks = [b"one\n", b"two, longer\n", big]

    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk
            await anyio.sleep(0.05)

    async def body() -> str:
        async with open_runtime(fake_config(channel=False)) as rt:
            return (await rt.exec(["sha256sum"], stdin=source(), timeout=60)).stdout

    digest = anyio.run(body).split()[0]
    assert digest == hashlib.sha256(b"".join(chunks)).hexdigest()
    sizes = [size for size in fake_service.stdin_writes if size]
    assert sizes == [4, 12, modal_runtime.STDIN_CHUNK, 4], fake_service.stdin_writes
