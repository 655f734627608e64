"""Attack class 21: the host's reader of an exec's status report, fuzzed (hypothesis).

On the plain path (Docker's engine exec, SSH, Modal) a command runs under the wrapper
(``runtimes/wrapper.py``), whose first line on stderr reports how the start went: the process
group the command runs in, or the errno that stopped it. The host finds that line with
:class:`runtimes.wrapper.ReportReader` among whatever came before it (a login shell's noise)
and :func:`runtimes.wrapper.parse_report`; everything on that stream came from the sandbox,
whose ``sh`` a root policy may have replaced.

The invariant, for any stderr cut anywhere: the report found is the first line that is exactly
a report of this exec's nonce (a group id of 1 to 10 digits, or an errno of at most 3 digits on
a known ``what``), the command's stderr after it comes back byte for byte, never an exception,
and the reader holds at most its limit (plus one chunk) while no report came.

The budget: see :mod:`tests.security.fuzzing`.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runtimes.wrapper import REPORT_WHATS, ReportReader, WrapperReport, parse_report

from .fuzzing import allocation_peak, cut, fuzz

pytestmark = pytest.mark.attack(21)

NONCE = "4f2a9c"
TAG = b"vf-sandbox-" + NONCE.encode() + b":"
OTHER = b"vf-sandbox-ffffff:"
REPORT_MAX = 64


def expected(data: bytes) -> tuple[WrapperReport, bytes, bytes] | None:
    """The report in ``data`` as documented: the first tagged line (complete, its newline
    within the report's length) that parses; with the bytes before it and after its line."""
    start = data.find(TAG)
    while start >= 0:
        end = data.find(b"\n", start, start + len(TAG) + REPORT_MAX + 1)
        if end >= 0:
            report = parse_report(data[start:end], NONCE)
            if report is not None:
                return report, data[:start], data[end + 1 :]
        start = data.find(TAG, start + 1)
    return None


fragments = st.one_of(
    st.binary(max_size=40),
    st.just(TAG),
    st.just(OTHER),
    st.just(b"\n"),
    st.builds(
        lambda head, tail: TAG + head + b":" + tail + b"\n",
        st.sampled_from([b"ok", b"2", b"13", b"1234", b"", b"-1", b"\xd9\xa1"])
        | st.binary(max_size=4),
        st.sampled_from([b"1", b"0", b"12345678901", b"77", *[w.encode() for w in REPORT_WHATS]])
        | st.binary(max_size=70),
    ),
)
sizes = st.lists(st.integers(1, 200), min_size=1, max_size=6)


@fuzz(400)
@given(parts=st.lists(fragments, max_size=12), chunks=sizes)
@example(parts=[b"noise", TAG + b"ok:12\n", b"stderr"], chunks=[1])
@example(parts=[TAG + b"ok:0\n", TAG + b"2:prog\n", b"x"], chunks=[3])
@example(parts=[TAG + b"ok:" + b"1" * 80 + b"\n", TAG + b"ok:5\n"], chunks=[7])
def test_the_report_is_the_first_exact_report_line_and_the_rest_comes_back(
    parts: list[bytes], chunks: list[int]
) -> None:
    data = b"".join(parts)
    reader = ReportReader(NONCE)  # the default limit (64 KiB) is never reached here
    out = b""
    with allocation_peak() as peak:
        for piece in cut(data, chunks):
            out += reader.feed(piece)
    want = expected(data)
    if want is None:
        assert reader.report is None and out == b"" and reader.held == data
    else:
        report, preamble, rest = want
        assert reader.report == report
        assert reader.preamble == preamble and out == rest
        if report.ok:
            assert 0 < (report.pgid or 0) < 10**10, report
        else:
            assert 0 <= report.errno < 1000 and report.what in REPORT_WHATS, report
    assert peak[0] < 256 * 1024 + 4 * len(data), peak


@fuzz(200)
@given(data=st.binary(max_size=3000), chunks=sizes, limit=st.integers(0, 500))
def test_a_stream_without_a_report_is_held_only_up_to_the_limit(
    data: bytes, chunks: list[int], limit: int
) -> None:
    reader = ReportReader(NONCE, limit=limit)
    for piece in cut(data.replace(b"vf-sandbox-", b"vf-sandbox_"), chunks):
        assert reader.feed(piece) == b""
        assert len(reader.held) <= limit + max(chunks)
    assert reader.report is None
    assert reader.gave_up == (len(reader.held) > limit)
