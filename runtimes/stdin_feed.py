"""Feeding a command's stdin from an async iterable (``exec(stdin=<async iterable>)``), the
same way on every backend and through the channel.

A chunk is pulled only once the previous one was written (or handed to a bounded window),
so host memory holds one chunk whatever the iterable yields. The feeder runs beside the
command and never raises: a failing iterable (or a chunk that is not bytes) stops the call
through :meth:`~runtimes.models.OutputSink.fail` (the runtime kills the tree, then re-raises
it); a command that exits or closes its stdin ends the feeding without an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio

from .errors import SandboxInvalidArgumentError
from .models import OutputSink

T = TypeVar("T")

__all__ = ["StdinTap", "feed_stdin", "run_beside"]


class StdinTap:
    """An async iterable of bytes that remembers whether anything was pulled from it: a
    partly consumed stdin cannot be replayed on another path."""

    def __init__(self, source: AsyncIterable[bytes]) -> None:
        self._source = source
        self._iterator: AsyncIterator[bytes] | None = None
        self.pulled = False

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._iterator is None:
            self._iterator = aiter(self._source)
        self.pulled = True
        return await anext(self._iterator)


async def feed_stdin(
    source: bytes | AsyncIterable[object] | None,
    sink: OutputSink,
    write: Callable[[bytes], Awaitable[bool]],
    close: Callable[[], Awaitable[None]],
    *,
    size: int,
) -> None:
    """Write what ``source`` yields (an ``ExecRequest.stdin``: ``None``, bytes, or an async
    iterable), in chunks of at most ``size`` bytes, each awaited by ``write`` (``False``: the
    command no longer reads its stdin) before the next is pulled; then ``close()`` (EOF).
    Never raises but for cancellation: a failure of the source or of ``write`` goes to
    ``sink.fail`` (a non-bytes chunk as :class:`SandboxInvalidArgumentError`), which stops
    the call. A plugin's ``_exec`` runs it beside the process with :func:`run_beside`."""
    iterator = aiter(_as_iterable(source))
    while True:
        try:
            chunk = await anext(iterator)
        except StopAsyncIteration:
            break
        except Exception as exc:  # noqa: BLE001 -- the caller's error, re-raised after the kill
            sink.fail(exc)
            return
        if not isinstance(chunk, bytes | bytearray | memoryview):
            sink.fail(
                SandboxInvalidArgumentError(
                    f"stdin chunks must be bytes, got {type(chunk).__name__}"
                )
            )
            return
        if not await _write_all(chunk, sink, write, size):
            break
    try:
        await close()
    except Exception as exc:  # noqa: BLE001 -- a transport failure, raised by the runtime
        sink.fail(exc)


async def _as_iterable(source: bytes | AsyncIterable[object] | None) -> AsyncIterator[object]:
    if source is None or isinstance(source, bytes):
        if source:
            yield source
        return
    async for chunk in source:
        yield chunk


async def _write_all(
    chunk: bytes | bytearray | memoryview,
    sink: OutputSink,
    write: Callable[[bytes], Awaitable[bool]],
    size: int,
) -> bool:
    view = memoryview(chunk)
    try:
        for offset in range(0, len(view), size):
            if not await write(bytes(view[offset : offset + size])):
                return False
    except Exception as exc:  # noqa: BLE001 -- a transport failure, raised by the runtime
        sink.fail(exc)
        return False
    return True


async def run_beside(
    main: Callable[[], Awaitable[T]], feeder: Callable[[], Coroutine[Any, Any, None]]
) -> T:
    """``await main()`` with ``feeder()`` (which must not raise) running beside it; the
    feeder is cancelled as soon as ``main`` returns or raises, and an exception of
    ``main`` propagates as itself (not in an exception group)."""
    result: list[T] = []
    error: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(feeder)
        try:
            result.append(await main())
        except Exception as exc:  # noqa: BLE001 -- re-raised below, outside the task group
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
    return result[0]
