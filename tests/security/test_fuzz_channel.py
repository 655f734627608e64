"""Attack class 21: the host's parsers of the channel agent's bytes, fuzzed (hypothesis).

Everything the host reads from the channel's stream came from the sandbox: the agent's greeting
(``ready`` / ``no-python``), the frame stream (``FramedStream._parse``: header, length, tag),
and, once a frame authenticated, its payload (``Hello``, ``ErrorReport``, ``DIGEST``,
``ALERT``, the ``u32``/``i32`` numbers of ``STARTED``, ``EXIT``, ``ACK``, ``DONE``, the relay's
``OPENED``/``R_*`` frames). The agent authenticates every frame with the per-start key, but a
root policy can read the agent's memory, so an *authenticated* frame is no more trusted than
any other byte: these tests hold the key (they play the agent) and send both forged frames and
correctly tagged ones with arbitrary fields.

The invariant, for every input: the outcome is a correct parse, or the project's typed error
(``SandboxError`` and its subclasses at the supervisor, which routes every public call; the
stream's own "tampered" verdict at the frame level), never an untyped exception (in the call,
on the event loop, or ending the reader thread), never a hang, and never an allocation out of
proportion with the input (a header announcing 4 GiB allocates nothing of it).

The budget: see :mod:`tests.security.fuzzing` (a fixed number of derandomized examples in
``make test``, ``VF_FUZZ_EXAMPLES`` for a longer session).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runtimes.channel import bootstrap
from runtimes.channel.agent import wire
from runtimes.channel.framing import FramedStream, PendingRequest
from runtimes.channel.protocol import MAX_FRAME, RELAY_WINDOW
from runtimes.channel.relay import RelayedConnection, RelayListener
from runtimes.errors import ChannelTamperedError, HostRouteError, SandboxError

from .fuzzing import allocation_peak, cut, fuzz
from .scripted_agent import REQUESTS, NoTransport, ScriptedAgent, converse, tagged

pytestmark = pytest.mark.attack(21)

TAG = wire.TAG
HEADER = wire.HEADER
AGENT_KINDS = [
    wire.HELLO,
    wire.STARTED,
    wire.STDOUT,
    wire.STDERR,
    wire.EXIT,
    wire.ERROR,
    wire.CHUNK,
    wire.DONE,
    wire.ACK,
    wire.ALERT,
    wire.DIGEST,
    wire.STDIN_CLOSED,
    wire.OPENED,
    wire.R_DATA,
    wire.R_ACK,
    wire.R_EOF,
    wire.R_CLOSE,
]
WHATS = ["prog", "cwd", "user", "path", "limit", "special", "pids", "internal", "unsupported"]
CONVERSATION_PEAK = 2 * 1024 * 1024
"""Allocations of one whole conversation whatever its answer (see its test)."""
BASE_PEAK = 256 * 1024
"""Allocations one parse may make whatever its input (the frames' objects, hypothesis's own
bookkeeping in other threads); the rest must be proportional to the input."""


def parse_all(stream: FramedStream, pieces: list[bytes]) -> tuple[list[Any], str | None, int]:
    """Feed ``pieces`` through the stream's parser as its reader thread does; the frames, the
    tamper verdict (the reader stops at it), and the bytes left buffered."""
    buf = bytearray()
    frames: list[Any] = []
    for piece in pieces:
        buf += piece
        got, tampered = stream._parse(buf)
        frames += got
        assert len(buf) < HEADER.size + MAX_FRAME + TAG
        if tampered is not None:
            return frames, tampered, len(buf)
    return frames, None, len(buf)


# ---------------------------------------------------------------------- the frame parser

sizes = st.lists(st.integers(1, 300), min_size=1, max_size=6)


@fuzz(300)
@given(data=st.binary(max_size=4096), chunks=sizes)
@example(data=HEADER.pack(wire.STDOUT, 1, 2**32 - 1) + b"x" * 64, chunks=[3])
@example(data=b"\x00" * HEADER.size, chunks=[1])
def test_arbitrary_bytes_are_frames_or_a_tamper_verdict(data: bytes, chunks: list[int]) -> None:
    stream = FramedStream(NoTransport(), "fuzz")
    with allocation_peak() as peak:
        frames, tampered, left = parse_all(stream, cut(data, chunks))
    # Without the key nothing authenticates (a 2**-128 chance per frame).
    assert frames == []
    if tampered is None and left >= HEADER.size:
        # what is left is the start of one frame, still waiting for its bytes
        size = HEADER.unpack_from(data, len(data) - left)[2]
        assert size <= MAX_FRAME and left < HEADER.size + size + TAG
    assert peak[0] < BASE_PEAK + 4 * len(data), peak


frame_fields = st.tuples(
    st.sampled_from(AGENT_KINDS) | st.integers(0, 255),
    st.integers(0, 2**32 - 1),
    st.binary(max_size=2048),
)


@fuzz(200)
@given(frames=st.lists(frame_fields, max_size=12), chunks=sizes)
def test_authentic_frames_cut_anywhere_parse_exactly(
    frames: list[tuple[int, int, bytes]], chunks: list[int]
) -> None:
    stream = FramedStream(NoTransport(), "fuzz")
    key = stream._key
    data = b"".join(tagged(key, seq, *f) for seq, f in enumerate(frames))
    with allocation_peak() as peak:
        got, tampered, left = parse_all(stream, cut(data, chunks))
    assert tampered is None
    assert got == frames and left == 0
    assert peak[0] < BASE_PEAK + 4 * len(data), peak


@st.composite
def corrupted(draw: st.DrawFn) -> tuple[list[tuple[int, int, bytes]], int, bytes]:
    """Authentic frames, one of which is then forged: a bit flipped anywhere in it, tagged
    at another place in the stream (replayed, reordered), or tagged with another key."""
    frames = draw(st.lists(frame_fields, min_size=1, max_size=6))
    bad = draw(st.integers(0, len(frames) - 1))
    key = b"k" * wire.KEY
    how = draw(st.sampled_from(["flip", "seq", "key"]))
    kind, rid, payload = frames[bad]
    if how == "flip":
        raw = bytearray(tagged(key, bad, kind, rid, payload))
        bit = draw(st.integers(0, len(raw) * 8 - 1))
        raw[bit // 8] ^= 1 << (bit % 8)
        forged = bytes(raw)
    elif how == "seq":
        seq = draw(st.integers(0, 2**64 - 1).filter(lambda s: s != bad))
        forged = tagged(key, seq, kind, rid, payload)
    else:
        forged = tagged(b"x" * wire.KEY, bad, kind, rid, payload)
    return frames, bad, forged


@fuzz(200)
@given(case=corrupted(), chunks=sizes)
def test_no_frame_at_or_after_a_forged_one_is_delivered(
    case: tuple[list[tuple[int, int, bytes]], int, bytes], chunks: list[int]
) -> None:
    frames, bad, forged = case
    stream = FramedStream(NoTransport(), "fuzz")
    key = b"k" * wire.KEY
    stream._key = key
    data = b"".join(forged if seq == bad else tagged(key, seq, *f) for seq, f in enumerate(frames))
    got, tampered, left = parse_all(stream, cut(data, chunks))
    assert got == frames[:bad]
    # A flipped length may leave the forged frame waiting for bytes that never come: it is
    # then never delivered either.
    assert tampered is not None or left > 0


@fuzz(100)
@given(size=st.integers(MAX_FRAME + 1, 2**32 - 1), kind=st.integers(0, 255))
@example(size=2**32 - 1, kind=wire.CHUNK)
def test_a_huge_announced_frame_is_refused_before_anything_is_buffered(
    size: int, kind: int
) -> None:
    stream = FramedStream(NoTransport(), "fuzz")
    with allocation_peak() as peak:
        got, tampered, _ = parse_all(stream, [HEADER.pack(kind, 1, size) + b"x" * 100])
    assert got == [] and tampered is not None and str(size) in tampered
    assert peak[0] < BASE_PEAK, peak


# ---------------------------------------------------------------------- the relay's frames

relay_frames = st.lists(
    st.tuples(
        st.sampled_from(sorted(wire.RELAY_KINDS)) | st.integers(0, 255),
        st.integers(0, 3).map(lambda n: wire.RELAY_BIT | n) | st.integers(0, 2**32 - 1),
        st.one_of(
            st.binary(max_size=64),
            st.just(wire.U32.pack(1)),
            st.integers(0, 2 * RELAY_WINDOW).map(wire.U32.pack),
            st.integers(0, 2 * RELAY_WINDOW)
            .map(lambda n: b"d" * min(n, 8192) * (n // 8192 + 1))
            .map(lambda b: b[: 2 * RELAY_WINDOW]),
        ),
    ),
    max_size=20,
)


@fuzz(300)
@given(frames=relay_frames)
@example(frames=[(wire.OPENED, wire.RELAY_BIT, b"\x00")])
@example(
    frames=[(wire.OPENED, wire.RELAY_BIT, wire.U32.pack(1)), (wire.R_ACK, wire.RELAY_BIT, b"")]
)
def test_relay_frames_are_obeyed_or_a_tamper_verdict(frames: list[tuple[int, int, bytes]]) -> None:
    """The relay's frames, authenticated (``Relay.take`` runs after ``_parse``): a connection
    opened on listener 1, data, acknowledgements, closes, in any order and size. The host
    side of each connection is not connected (only the frames' handling is fuzzed)."""
    stream = FramedStream(NoTransport(), "fuzz")
    relay = stream.relay
    inbox, outbox = anyio.create_memory_object_stream[Any](0)
    request = PendingRequest(1, inbox, outbox)
    relay.add(RelayListener(stream, request, ("127.0.0.1", 9), max_connections=2))
    size = sum(len(p) for _, _, p in frames)
    with pytest.MonkeyPatch.context() as patch, allocation_peak() as peak:
        patch.setattr(RelayedConnection, "start", lambda self: None)
        try:
            rest, problem = relay.take(frames)
            held = [conn.held for conn in relay.connections.values()]
        finally:
            stream.close()
    assert rest == [f for f in frames if not f[1] & wire.RELAY_BIT][: len(rest)]
    if problem is None:
        assert all(h <= RELAY_WINDOW for h in held), held
    assert peak[0] < BASE_PEAK + 2 * size, peak
    inbox.close()
    outbox.close()


# -------------------------------------------------------------- authenticated, malformed

u32s = st.integers(0, 2**32 - 1).map(wire.U32.pack)
i32s = st.integers(-(2**31), 2**31 - 1).map(wire.I32.pack)
reports = st.builds(
    lambda num, what, message: wire.ErrorReport(num, what, message).to_wire(),
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from(WHATS) | st.text(max_size=8),
    st.text(max_size=40),
)
u32 = st.integers(0, 2**32 - 1)
infos = st.builds(
    wire.PathInfo,
    st.sampled_from(wire.KINDS),
    u32,
    u32,
    u32,
    u32,
    st.integers(0, 2**64 - 1),
    target=st.text(max_size=20),
    content=st.binary(max_size=100),
).map(wire.PathInfo.to_wire)
well_formed = u32s | i32s | st.just(wire.U16.pack(8080)) | reports | infos | st.just(b"\x01")
payloads = st.one_of(
    st.binary(max_size=96),
    well_formed,
    well_formed.flatmap(lambda b: st.integers(0, max(0, len(b) - 1)).map(lambda n: b[:n])),
    well_formed.map(lambda b: b + b"\x00"),
)
THE_REQUEST = -1
"""A frame addressed to the host's request (its id is known only once the host sent it)."""
rids = st.one_of(
    st.just(THE_REQUEST),
    st.just(THE_REQUEST),
    st.just(0),
    st.integers(0, 2**32 - 1),
    st.integers(0, 4).map(lambda n: wire.RELAY_BIT | n),
)
answer_frames = st.lists(
    st.tuples(
        st.sampled_from(AGENT_KINDS) | st.integers(0, 255),
        rids,
        payloads,
        st.sampled_from(["ok", "ok", "ok", "ok", "forged", "replayed"]),
    ),
    max_size=8,
)


def answer_with(frames: list[tuple[int, int, bytes, str]]) -> Callable[[bytes, int], bytes]:
    def answer(key: bytes, rid: int) -> bytes:
        out = []
        for seq, (kind, to, payload, how) in enumerate(frames, start=1):
            to = rid if to == THE_REQUEST else to
            if how == "forged":
                out.append(HEADER.pack(kind, to, len(payload)) + payload + bytes(TAG))
            else:
                out.append(tagged(key, seq if how == "ok" else seq - 1, kind, to, payload))
        return b"".join(out)

    return answer


@fuzz(300)
@given(what=st.sampled_from(REQUESTS), frames=answer_frames, chunks=sizes)
@example(what="exec", frames=[(wire.STARTED, THE_REQUEST, b"\x00", "ok")], chunks=[7])
@example(what="exec", frames=[(wire.EXIT, THE_REQUEST, b"", "ok")], chunks=[7])
@example(what="exec", frames=[(wire.ERROR, THE_REQUEST, b"\x00\x00", "ok")], chunks=[7])
@example(what="write", frames=[(wire.ACK, THE_REQUEST, b"", "ok")], chunks=[7])
@example(what="read", frames=[(wire.ERROR, THE_REQUEST, b"", "ok")], chunks=[7])
@example(what="sweep", frames=[(wire.DONE, THE_REQUEST, b"\x01", "ok")], chunks=[7])
@example(what="listen", frames=[(wire.DONE, THE_REQUEST, b"", "ok")], chunks=[7])
@example(what="halt", frames=[(wire.ERROR, THE_REQUEST, b"\xff", "ok")], chunks=[7])
@example(what="exists", frames=[(wire.ALERT, 0, b"\x00", "ok")], chunks=[7])
@example(what="exists", frames=[(wire.DIGEST, 0, b"\x00\x00\x00\x09ab", "ok")], chunks=[7])
def test_every_answer_to_a_call_is_a_result_or_a_typed_error(
    what: str, frames: list[tuple[int, int, bytes, str]], chunks: list[int]
) -> None:
    agent = ScriptedAgent(answer_with(frames), chunks)
    with allocation_peak() as peak:
        outcome, untyped = converse(what, agent)
    assert untyped == [], untyped
    assert outcome.error is None or isinstance(outcome.error, SandboxError), repr(outcome.error)
    # A supervisor, its channel, its threads and the test's own copy of the agent's source
    # take a constant; the answer itself at most a few copies.
    assert peak[0] < CONVERSATION_PEAK + 4 * agent.answered, peak


@fuzz(200)
@given(greeting=st.binary(max_size=40), hello=st.binary(max_size=80), chunks=sizes)
@example(greeting=bootstrap.READY, hello=b"\x00" * 23, chunks=[5])
@example(greeting=bootstrap.NO_PYTHON, hello=b"", chunks=[2])
def test_any_greeting_and_hello_leave_a_working_runtime(
    greeting: bytes, hello: bytes, chunks: list[int]
) -> None:
    """The bytes before the first frame, and a malformed (but authenticated) ``HELLO``: the
    supervisor's start never raises; the call goes through the plain path or the channel."""

    def answer(key: bytes, rid: int) -> bytes:
        return tagged(key, 1, wire.DONE, rid, b"\x01")

    agent = ScriptedAgent(answer, chunks, greeting=greeting, hello=hello)
    outcome, untyped = converse("exists", agent)
    assert untyped == [], untyped
    assert outcome.error is None and outcome.value in (True, "plain"), outcome


MALFORMED = [
    ("exec", wire.STARTED, b"\x00", ChannelTamperedError),
    ("exec", wire.EXIT, b"", ChannelTamperedError),
    ("exec", wire.EXIT, b"\x00" * 5, ChannelTamperedError),
    ("exec", wire.ERROR, b"\x00\x00", ChannelTamperedError),
    ("write", wire.ACK, b"\x01", ChannelTamperedError),
    ("read", wire.ERROR, b"", ChannelTamperedError),
    ("remove", wire.ERROR, b"\x00\x00\x00\x02\x00\x00\x00\x09ab", ChannelTamperedError),
    ("sweep", wire.DONE, b"\x01", ChannelTamperedError),
    ("lstat", wire.DONE, b"\x01\x02", ChannelTamperedError),
    ("lstat", wire.DONE, wire.PathInfo("file", content=bytes(66)).to_wire(), ChannelTamperedError),
    ("listen", wire.DONE, b"", HostRouteError),
    ("listen", wire.ERROR, b"\x07", HostRouteError),
    ("halt", wire.ERROR, b"\xff", None),
]


@pytest.mark.parametrize(("what", "kind", "payload", "error"), MALFORMED)
def test_a_malformed_authenticated_answer_distrusts_the_channel(
    what: str, kind: int, payload: bytes, error: type[SandboxError] | None
) -> None:
    """The real agent never sends these; one that does (with the key) is not the agent the
    host started: the call fails typed and the channel is distrusted, not restarted."""
    agent = ScriptedAgent(answer_with([(kind, THE_REQUEST, payload, "ok")]), [1 << 20])
    outcome, untyped = converse(what, agent)
    assert untyped == [], untyped
    if error is None:
        assert outcome.error is None and outcome.value is False, outcome
    else:
        assert isinstance(outcome.error, error), repr(outcome.error)
    assert outcome.state == "distrusted", outcome


@pytest.mark.parametrize(
    ("kind", "payload"),
    [(wire.ALERT, b"\x00"), (wire.DIGEST, b"\x00\x00\x00\x01/" + b"\x00" * 5)],
)
def test_a_malformed_alert_or_digest_frame_distrusts_the_channel(kind: int, payload: bytes) -> None:
    agent = ScriptedAgent(answer_with([(kind, 0, payload, "ok")]), [1 << 20])
    outcome, untyped = converse("exists", agent)
    assert untyped == [], untyped
    assert isinstance(outcome.error, ChannelTamperedError), repr(outcome.error)
    assert outcome.state == "distrusted", outcome


# -------------------------------------------------------------- correct, cut anywhere


@st.composite
def conversations(draw: st.DrawFn) -> tuple[str, list[tuple[int, bytes]], Any]:
    """A well-formed answer to one call, and the result the call must return."""
    what = draw(st.sampled_from(["exec", "read", "exists", "sweep"]))
    if what == "exec":
        out, err = draw(st.binary(max_size=3000)), draw(st.binary(max_size=3000))
        code = draw(st.integers(-(2**31), 2**31 - 1))
        frames = [(wire.STARTED, wire.U32.pack(draw(st.integers(1, 2**31))))]
        frames += [(wire.STDOUT, out), (wire.STDERR, err)]
        return what, [*frames, (wire.EXIT, wire.I32.pack(code))], (code, out, err)
    if what == "read":
        parts = draw(st.lists(st.binary(max_size=1000), max_size=4))
        frames = [(wire.CHUNK, p) for p in parts] + [(wire.DONE, b"")]
        return what, frames, b"".join(parts)
    if what == "exists":
        there = draw(st.booleans())
        return what, [(wire.DONE, b"\x01" if there else b"\x00")], there
    killed = draw(st.integers(0, 2**32 - 1))
    return what, [(wire.DONE, wire.U32.pack(killed))], killed


@fuzz(200)
@given(case=conversations(), chunks=sizes)
def test_a_correct_conversation_cut_anywhere_gives_the_exact_result(
    case: tuple[str, list[tuple[int, bytes]], Any], chunks: list[int]
) -> None:
    what, frames, expected = case

    def answer(key: bytes, rid: int) -> bytes:
        return b"".join(
            tagged(key, seq, kind, rid, payload) for seq, (kind, payload) in enumerate(frames, 1)
        )

    outcome, untyped = converse(what, ScriptedAgent(answer, chunks))
    assert untyped == [], untyped
    assert outcome.error is None, repr(outcome.error)
    assert outcome.value == expected
