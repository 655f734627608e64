"""Conformance checks of streaming ``exec``: ``on_output`` chunks in order and byte-exact,
streams interleaved as written, caps and cancellation while streaming, and a long stream in
constant host memory (registered in :data:`runtimes.testing.checks.CHECKS`).

Two more streaming checks live in :mod:`runtimes.testing.exec_checks`
(``on_output_streams``, ``on_output_error_kills_tree``)."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from ..base import Runtime
from ..channel.protocol import MAX_BACKLOG
from ..errors import ExecTimeoutError, OutputLimitExceededError
from ..models import MiB, Stream
from .checks import assert_no_process, check, expect_raises, unique_token


class _Recorder:
    """An ``on_output`` that keeps what it saw: ``(arrival time, stream, chunk)``."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, Stream, bytes]] = []

    def __call__(self, stream: Stream, data: bytes) -> None:
        self.seen.append((anyio.current_time(), stream, data))

    def joined(self, stream: Stream) -> bytes:
        return b"".join(data for _, s, data in self.seen if s == stream)

    @property
    def total(self) -> int:
        return sum(len(data) for _, _, data in self.seen)


# ---------------------------------------------------------------------- order and bytes


_LINES = 30_000
_NUMBERED = b"".join(b"%d\n" % i for i in range(1, _LINES + 1))


@check(shares_sandbox=True)
async def check_stream_order_within_stream(rt: Runtime) -> None:
    """Many numbered lines arrive in order and byte-exact; the chunks are the result's stdout,
    and with ``keep_output=False`` the result is empty but the chunks are all there."""
    for keep in (True, False):
        recorder = _Recorder()
        result = await rt.exec(
            ["seq", "1", str(_LINES)], timeout=60, on_output=recorder, keep_output=keep
        )
        assert result.exit_code == 0, result
        streamed = recorder.joined("stdout")
        assert streamed == _NUMBERED, (keep, len(streamed), streamed[:80])
        assert recorder.joined("stderr") == b"", recorder.joined("stderr")[:200]
        if keep:
            assert result.stdout_bytes == streamed and result.stderr_bytes == b"", result
        else:
            assert result.stdout_bytes == b"" and result.stderr_bytes == b"", result


# ---------------------------------------------------------------------- interleaving


_MARKERS: tuple[tuple[Stream, bytes], ...] = (
    ("stdout", b"out-1;"),
    ("stderr", b"err-1;"),
    ("stdout", b"out-2;"),
    ("stderr", b"err-2;"),
)
_PAUSE = 0.4


def _arrival(recorder: _Recorder, stream: Stream, marker: bytes) -> float:
    """When the last byte of ``marker`` reached the callback on ``stream``."""
    so_far = b""
    for at, s, data in recorder.seen:
        if s == stream:
            so_far += data
            if marker in so_far:
                return at
    raise AssertionError(f"{marker!r} never arrived on {stream}: {recorder.seen}")


@check(shares_sandbox=True)
async def check_stream_interleaving_by_time(rt: Runtime) -> None:
    """stdout and stderr written in turns, with pauses, reach ``on_output`` in the same turns
    as they are written (not buffered to the end, not reordered across streams)."""
    script = f"; sleep {_PAUSE}; ".join(
        f"printf '{marker.decode()}'" + (" >&2" if stream == "stderr" else "")
        for stream, marker in _MARKERS
    )
    recorder = _Recorder()
    result = await rt.exec(["sh", "-c", script], timeout=60, on_output=recorder)
    ended = anyio.current_time()
    assert result.exit_code == 0, result
    arrivals = [_arrival(recorder, stream, marker) for stream, marker in _MARKERS]
    for index in range(1, len(arrivals)):
        # Written _PAUSE after the previous marker: well after it, even with jitter.
        gap = arrivals[index] - arrivals[index - 1]
        assert gap > _PAUSE / 4, (_MARKERS[index], arrivals)
    span = ended - arrivals[0]
    assert span > _PAUSE * 2, f"the first marker came only {span:.2f}s before the exit"


# ---------------------------------------------------------------------- caps, cancellation


@check(shares_sandbox=True)
async def check_stream_output_cap(rt: Runtime) -> None:
    """An endless writer streamed with a 1 MiB cap raises OutputLimitExceededError (kept or
    not): the chunks seen total exactly the cap, nothing arrives after, the tree is killed."""
    for keep in (True, False):
        token = unique_token()
        recorder = _Recorder()
        exc = await expect_raises(
            OutputLimitExceededError,
            rt.exec(
                ["sh", "-c", f"sleep {token} & yes"],
                output_limit=MiB,
                timeout=60,
                on_output=recorder,
                keep_output=keep,
            ),
        )
        assert isinstance(exc, OutputLimitExceededError) and exc.limit == MiB
        assert recorder.total == MiB, (keep, recorder.total)
        streamed = recorder.joined("stdout")
        assert streamed.startswith(b"y\ny\n") and set(streamed) <= set(b"y\n"), streamed[:40]
        kept = exc.stdout_bytes + exc.stderr_bytes
        assert kept == (streamed if keep else b""), (keep, len(kept))
        count = len(recorder.seen)
        await assert_no_process(rt, token)
        assert len(recorder.seen) == count, "output arrived after exec raised"


def _ticker(token: str) -> list[str]:
    """A command that prints a line every 20 ms forever, with a sleeping child to find."""
    return ["sh", "-c", f"sleep {token} & while :; do echo tick; sleep 0.02; done"]


@check(shares_sandbox=True)
async def check_stream_cancellation(rt: Runtime) -> None:
    """Cancelling a streaming exec after its first chunk kills the tree, and no chunk
    arrives once the exec has returned."""
    token = unique_token()
    recorder = _Recorder()
    with anyio.CancelScope() as scope:

        def cancel_on_first(stream: Stream, data: bytes) -> None:
            recorder(stream, data)
            scope.cancel()

        await rt.exec(_ticker(token), timeout=20, on_output=cancel_on_first)
    assert scope.cancelled_caught, "the exec should have been cancelled"
    assert recorder.joined("stdout").startswith(b"tick\n"), recorder.seen
    count = len(recorder.seen)
    await assert_no_process(rt, token)
    await anyio.sleep(0.2)
    assert len(recorder.seen) == count, f"chunks after the cancel: {recorder.seen[count:]}"
    assert (await rt.exec(["echo", "still usable"])).stdout == "still usable\n"


@check(shares_sandbox=True)
async def check_stream_timeout(rt: Runtime) -> None:
    """A streaming exec that times out with ``keep_output=False`` raises ExecTimeoutError
    (with no output kept) after streaming what came; the tree is killed, nothing more comes."""
    token = unique_token()
    recorder = _Recorder()
    exc = await expect_raises(
        ExecTimeoutError,
        rt.exec(_ticker(token), timeout=1.0, on_output=recorder, keep_output=False),
    )
    assert isinstance(exc, ExecTimeoutError)
    assert exc.stdout_bytes == b"" and exc.stderr_bytes == b"", exc
    streamed = recorder.joined("stdout")
    assert streamed.startswith(b"tick\n") and set(streamed.split(b"\n")) <= {b"tick", b""}
    count = len(recorder.seen)
    await assert_no_process(rt, token)
    await anyio.sleep(0.2)
    assert len(recorder.seen) == count, f"chunks after the timeout: {recorder.seen[count:]}"


# ---------------------------------------------------------------------- memory


_LONG_STREAM = 64 * MiB
_PAUSES = 3
_PAUSE_SECONDS = 0.2
# What host memory a stream may hold, whatever its length (measured peaks, 50 MiB stream with
# the stalls below: subprocess 0.1 MiB, Docker plain 0.6, Docker channel 17, SSH plain 20,
# SSH channel 36, fake Modal channel 34). Through a channel the reader thread reads ahead of a
# slow consumer up to MAX_BACKLOG (16 MiB), and the transport beneath it (or a plain path)
# holds its own flow-control window: a paramiko channel's is 16 MiB (runtimes/ssh/client.py),
# the fake Modal worker's pipe buffer (in this process) 8 MiB. 8 MiB more covers one read,
# a frame being parsed and the bookkeeping. A stream kept anywhere would cost all 64 MiB.
_MEMORY_BOUND = MAX_BACKLOG + 16 * MiB + 8 * MiB


@contextmanager
def _traced_peak() -> Iterator[list[int]]:
    """Python allocations (all threads) while the block runs: yields a list that gets the
    peak of traced memory above what was traced on entry."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    measured: list[int] = []
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        yield measured
        measured.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        if started:
            tracemalloc.stop()


@check(shares_sandbox=True)
async def check_stream_constant_memory(rt: Runtime) -> None:
    """64 MiB streamed with ``keep_output=False`` to a consumer that only counts (and stalls
    the event loop now and then) all arrive, and host memory stays bounded below it."""
    counted = 0
    chunks = 0

    def count(stream: Stream, data: bytes) -> None:
        nonlocal counted, chunks
        counted += len(data)
        chunks += 1
        if chunks in range(2, 2 + _PAUSES):
            # A slow consumer: the loop (and so the reader) stalls while the writer writes on.
            time.sleep(_PAUSE_SECONDS)

    with _traced_peak() as peak:
        result = await rt.exec(
            ["head", "-c", str(_LONG_STREAM), "/dev/zero"],
            timeout=120,
            output_limit=_LONG_STREAM,
            on_output=count,
            keep_output=False,
        )
    assert result.exit_code == 0 and result.stdout_bytes == b"", result
    assert counted == _LONG_STREAM, counted
    assert peak[0] < _MEMORY_BOUND, (
        f"streaming {_LONG_STREAM // MiB} MiB raised traced host memory by "
        f"{peak[0] / MiB:.1f} MiB (bound {_MEMORY_BOUND / MiB:.0f} MiB)"
    )
