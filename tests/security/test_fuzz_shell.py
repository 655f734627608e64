"""Attack class 21: the host's parsers of a shell session's driver bytes, fuzzed (hypothesis).

A shell session (``runtimes/shell``, ``docs/shell.md``) reads its driver's stdout: the
bootstrap's ``ready`` line, then the channel's authenticated frames (``type u8 | request id u32
| length u32 | payload | tag``, :class:`runtimes.shell.protocol.FrameParser`, after the
driver's ``GREET``; here the driver is scripted and knows the key, as a replaced one would
not) whose ``READY`` and ``END`` payloads are a pid and a command's status in ASCII
(:func:`runtimes.shell.protocol.number`), ``OUT``/``ERR`` the command's output and ``DEAD`` a
reason; and the driver's stderr, kept as a tail to explain a death. The driver runs in the
sandbox (a root policy can replace ``python3``), so every byte of it is hostile.

The invariant, for every input: a correct parse (the frames sent, the status sent), or the
project's typed error (``DriverProtocolError`` from the parser, which kills the session;
``ShellSessionError`` / ``ExecTimeoutError`` / ``OutputLimitExceededError`` from the session),
never an untyped exception (the session's own catch-all would report it as "failed
unexpectedly": that counts as a failure here), never a hang, never an allocation out of
proportion with the input (a header announcing 4 GiB allocates nothing of it).

The budget: see :mod:`tests.security.fuzzing` (a fixed number of derandomized examples in
``make test``, ``VF_FUZZ_EXAMPLES`` for a longer session).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, cast

import anyio
import anyio.lowlevel
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runtimes import ExecResult
from runtimes.channel import bootstrap
from runtimes.channel.agent.codec import Opener, Sealer
from runtimes.errors import (
    ExecTimeoutError,
    OutputLimitExceededError,
    SandboxError,
    ShellSessionError,
)
from runtimes.shell import protocol
from runtimes.shell.protocol import HEADER, KEY, MAX_PAYLOAD, TAG, DriverProtocolError, FrameParser
from runtimes.shell.session import STDERR_TAIL, ShellSession

from .fuzzing import allocation_peak, cut, fuzz

pytestmark = pytest.mark.attack(21)

BASE_PEAK = 256 * 1024
"""Allocations one parse may make whatever its input; the rest must be proportional to it."""
SESSION_PEAK = 1024 * 1024
"""Allocations of one whole session whatever the driver says (see its test)."""
DRIVER_KINDS = [protocol.READY, protocol.OUT, protocol.ERR, protocol.END, protocol.DEAD]
TEST_KEY = bytes(range(KEY))
protocol.driver_source()  # joined once (cached): not a cost of the first session measured
Frames = list[tuple[int, bytes]]
Script = Frames | bytes
"""What a scripted driver says: frames (sealed under the key as it plays them) or raw bytes."""


def sealed(frames: Frames, sealer: Sealer | None = None) -> bytes:
    """``frames`` as a driver keyed with ``TEST_KEY`` (or ``sealer``'s key) writes them."""
    sealer = sealer or Sealer(TEST_KEY)
    return b"".join(sealer.seal(kind, 0, payload) for kind, payload in frames)


def frame(kind: int, payload: bytes) -> Frames:
    return [(kind, payload)]


def feed_all(parser: FrameParser, pieces: list[bytes]) -> tuple[list[tuple[int, bytes]], bool]:
    """Feed ``pieces`` as the session does; the frames, and whether the parser refused the
    stream (the session is killed then: nothing more is fed)."""
    frames: list[tuple[int, bytes]] = []
    for piece in pieces:
        try:
            frames += parser.feed(piece)
        except DriverProtocolError:
            return frames, True
        assert parser.buffered < HEADER.size + MAX_PAYLOAD + TAG
    return frames, False


sizes = st.lists(st.integers(1, 300), min_size=1, max_size=6)


# ---------------------------------------------------------------------- the frame parser


@fuzz(400)
@given(data=st.binary(max_size=4096), chunks=sizes)
@example(data=HEADER.pack(protocol.OUT, 0, 2**32 - 1) + b"x" * 64, chunks=[2])
@example(data=HEADER.pack(protocol.END, 0, MAX_PAYLOAD) + b"1", chunks=[1])
@example(data=sealed([(protocol.OUT, b"x")]) + b"junk" * 9, chunks=[5])
def test_arbitrary_bytes_are_frames_or_a_protocol_error(data: bytes, chunks: list[int]) -> None:
    parser = FrameParser(TEST_KEY)
    with allocation_peak() as peak:
        frames, refused = feed_all(parser, cut(data, chunks))
    assert sum(HEADER.size + len(p) for _, p in frames) <= len(data)
    if not refused:
        assert data.startswith(sealed(frames))
    assert peak[0] < BASE_PEAK + 4 * len(data), peak


frames_st = st.lists(
    st.tuples(st.sampled_from(DRIVER_KINDS) | st.integers(0, 255), st.binary(max_size=3000)),
    max_size=12,
)


@fuzz(300)
@given(frames=frames_st, chunks=sizes)
def test_frames_cut_anywhere_parse_exactly(
    frames: list[tuple[int, bytes]], chunks: list[int]
) -> None:
    data = sealed(frames)
    parser = FrameParser(TEST_KEY)
    got, refused = feed_all(parser, cut(data, chunks))
    assert not refused and got == frames and parser.buffered == 0


@fuzz(100)
@given(size=st.integers(MAX_PAYLOAD + 1, 2**32 - 1), kind=st.integers(0, 255))
@example(size=2**32 - 1, kind=protocol.OUT)
def test_a_huge_announced_frame_is_refused_before_anything_is_buffered(
    size: int, kind: int
) -> None:
    parser = FrameParser(TEST_KEY)
    with allocation_peak() as peak, pytest.raises(DriverProtocolError, match=str(size)):
        parser.feed(HEADER.pack(kind, 0, size) + b"x" * 100)
    assert peak[0] < BASE_PEAK, peak


@fuzz(400)
@given(payload=st.binary(max_size=30) | st.integers(0, 10**12).map(lambda n: str(n).encode()))
@example(payload="١٢".encode())  # Arabic-Indic digits: str.isdigit, never an exit status
@example(payload=b" 7")
@example(payload=b"-1")
@example(payload=b"")
def test_a_pid_or_status_is_its_ascii_number_or_a_protocol_error(payload: bytes) -> None:
    try:
        value = protocol.number(payload)
    except DriverProtocolError:
        assert not (payload.isascii() and payload.isdigit() and len(payload) <= 10)
        return
    assert payload.isascii() and payload.isdigit()
    assert value == int(payload.decode("ascii")) and 0 <= value < 10**10


# ---------------------------------------------------------------------- a scripted driver


class ScriptedDriver:
    """A runtime whose ``exec`` of the driver plays a scripted driver: ``stderr``, the
    bootstrap's ``ready``, then (keyed) its ``GREET`` and ``greeting`` (its stdout before the
    first command), then, once the session sent the command, ``answer``, each cut at
    ``sizes``; then it exits. ``on_output`` is called as a runtime calls it, and what it
    raises ends the exec (as ``Runtime.exec`` re-raises it after killing the tree)."""

    def __init__(
        self, greeting: Script, answer: Script, sizes: list[int], stderr: bytes = b""
    ) -> None:
        self.greeting = greeting
        self.answer = answer
        self.sizes = sizes
        self.stderr = stderr
        self.config = SimpleNamespace(output_limit=1 << 20)

    async def exec(self, argv: list[str], **kwargs: Any) -> ExecResult:
        on_output: Callable[[str, bytes], object] = kwargs["on_output"]
        stdin: AsyncIterator[bytes] = kwargs["stdin"]
        sent = bytearray()

        async def received(size: int) -> bool:
            """Read stdin until ``sent`` holds ``size`` bytes; False if it ended first."""
            while len(sent) < size:
                try:
                    sent.extend(await anext(stdin))
                except StopAsyncIteration:
                    return False
            return True

        for piece in cut(self.stderr, self.sizes):
            on_output("stderr", piece)
        for piece in cut(bootstrap.READY, self.sizes):
            on_output("stdout", piece)
            await anyio.lowlevel.checkpoint()
        # the bootstrap reads the source; then the host sends the key
        if not await received(10) or not await received(10 + int(sent[:10]) + KEY):
            return ExecResult(0, b"", b"")
        start = 10 + int(sent[:10])
        sealer = Sealer(bytes(sent[start : start + KEY]))
        opener = Opener(sealer.key, 1 << 30)
        del sent[: start + KEY]
        greet = sealer.seal(protocol.GREET, 0, protocol.VERSION_FIELD.pack(protocol.VERSION))
        for piece in cut(greet + _played(self.greeting, sealer), self.sizes):
            on_output("stdout", piece)
            await anyio.lowlevel.checkpoint()
        if not _answered(self.greeting):
            return ExecResult(0, b"", b"")  # the session would only wait for its start timeout
        frames = opener.feed(bytes(sent))  # OPEN, then the command or the session's QUIT
        fed = len(sent)
        while len(frames) < 2 and await received(fed + 1):
            frames += opener.feed(bytes(sent[fed:]))
            fed = len(sent)
        if len(frames) >= 2 and frames[1][0] == protocol.RUN:
            for piece in cut(_played(self.answer, sealer), self.sizes):
                on_output("stdout", piece)
                await anyio.lowlevel.checkpoint()
        return ExecResult(0, b"", b"")


def _played(script: Script, sealer: Sealer) -> bytes:
    return script if isinstance(script, bytes) else sealed(script, sealer)


def _answered(greeting: Script) -> bool:
    """Whether the session answers ``greeting`` (a command once ready, a ``QUIT`` once dead):
    it holds a ``READY`` or a ``DEAD`` frame (raw bytes never authenticate)."""
    if isinstance(greeting, bytes) or any(len(p) > MAX_PAYLOAD for _, p in greeting):
        return False
    return any(kind in (protocol.READY, protocol.DEAD) for kind, _ in greeting)


@dataclass
class Outcome:
    started: bool = False
    result: ExecResult | None = None
    error: BaseException | None = None
    pid: int | None = None


def session(driver: ScriptedDriver) -> Outcome:
    """Open a session on ``driver`` and run one command; what came of it."""

    async def main() -> Outcome:
        outcome = Outcome()
        sh = ShellSession(cast(Any, driver), start_timeout=5, interrupt_grace=0.1)
        with anyio.fail_after(20):  # a hang is a failure
            try:
                async with sh:
                    outcome.started = True
                    outcome.pid = sh.pid
                    outcome.result = await sh.run("true")
            except Exception as exc:  # noqa: BLE001 - classified by the tests
                outcome.error = exc
        return outcome

    return anyio.run(main)


def assert_typed(outcome: Outcome) -> None:
    error = outcome.error
    if error is None:
        return
    assert isinstance(error, ShellSessionError | ExecTimeoutError | OutputLimitExceededError), repr(
        error
    )
    assert "failed unexpectedly" not in str(error), error


statuses = st.one_of(
    st.integers(0, 255).map(lambda n: str(n).encode()),
    st.binary(max_size=12),
    st.integers(0, 10**11).map(lambda n: str(n).encode()),
)
driver_frames = st.lists(
    st.one_of(
        st.tuples(st.sampled_from([protocol.READY, protocol.END]), statuses),
        st.tuples(st.sampled_from(DRIVER_KINDS) | st.integers(0, 255), st.binary(max_size=200)),
    ),
    max_size=6,
)


@fuzz(300)
@given(
    greeting=driver_frames | st.binary(max_size=64),
    answer=driver_frames | st.binary(max_size=64),
    stderr=st.binary(max_size=3 * STDERR_TAIL),
    chunks=sizes,
)
@example(greeting=frame(protocol.READY, b"x1"), answer=b"", stderr=b"", chunks=[3])
@example(
    greeting=frame(protocol.READY, b"12"),
    answer=frame(protocol.END, b"\xd9\xa1"),
    stderr=b"\xff" * 10,
    chunks=[1],
)
@example(
    greeting=frame(protocol.READY, b"12"),
    answer=frame(protocol.DEAD, b"\xff\xfe") + frame(protocol.END, b"0"),
    stderr=b"",
    chunks=[2],
)
def test_anything_the_driver_says_is_a_result_or_a_typed_error(
    greeting: Script, answer: Script, stderr: bytes, chunks: list[int]
) -> None:
    driver = ScriptedDriver(greeting, answer, chunks, stderr)
    with allocation_peak() as peak:
        outcome = session(driver)
    assert_typed(outcome)
    if outcome.error is not None and not outcome.started:
        assert isinstance(outcome.error, ShellSessionError), repr(outcome.error)
    size = len(sealed(greeting) if isinstance(greeting, list) else greeting)
    size += len(sealed(answer) if isinstance(answer, list) else answer) + len(stderr)
    assert peak[0] < SESSION_PEAK + 4 * size, peak


@st.composite
def conversations(draw: st.DrawFn) -> tuple[Frames, Frames, int, ExecResult]:
    """A well-formed driver: ready with a pid, then output and the command's status."""
    pid = draw(st.integers(1, 2**22))
    out = draw(st.lists(st.binary(min_size=1, max_size=2000), max_size=4))
    err = draw(st.lists(st.binary(min_size=1, max_size=2000), max_size=4))
    code = draw(st.integers(0, 255))
    body = [(protocol.OUT, o) for o in out] + [(protocol.ERR, e) for e in err]
    body = draw(st.permutations(body))
    answer = [*body, (protocol.END, str(code).encode())]
    stdout = b"".join(p for k, p in body if k == protocol.OUT)
    expected = ExecResult(code, stdout, b"".join(p for k, p in body if k == protocol.ERR))
    return frame(protocol.READY, str(pid).encode()), answer, pid, expected


@fuzz(200)
@given(case=conversations(), chunks=sizes)
def test_a_correct_driver_cut_anywhere_gives_the_exact_result(
    case: tuple[Frames, Frames, int, ExecResult], chunks: list[int]
) -> None:
    greeting, answer, pid, expected = case
    outcome = session(ScriptedDriver(greeting, answer, chunks))
    assert outcome.error is None, repr(outcome.error)
    assert outcome.pid == pid and outcome.result is not None
    result = outcome.result
    assert (result.exit_code, result.stdout_bytes, result.stderr_bytes) == (
        expected.exit_code,
        expected.stdout_bytes,
        expected.stderr_bytes,
    )


@pytest.mark.parametrize(
    ("greeting", "answer", "says"),
    [
        (frame(protocol.READY, b"abc"), b"", "not a number"),
        (frame(protocol.READY, b"7"), frame(protocol.END, b"1" * 11), "not a number"),
        (frame(protocol.READY, b"7"), HEADER.pack(protocol.OUT, 0, MAX_PAYLOAD + 1), "bytes"),
    ],
)
def test_a_driver_that_breaks_the_protocol_kills_the_session_typed(
    greeting: bytes, answer: bytes, says: str
) -> None:
    outcome = session(ScriptedDriver(greeting, answer, [7]))
    assert isinstance(outcome.error, ShellSessionError), repr(outcome.error)
    assert "broke its protocol" in str(outcome.error) and says in str(outcome.error)
    assert isinstance(outcome.error, SandboxError)
