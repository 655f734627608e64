"""Attack class 21: a hostile sandbox answers a listing (``list``, ``stat``, ``glob``).

The names in a listing are the sandbox's: a policy makes names that forge entries (newlines,
field separators, non-UTF-8 bytes), directories far larger than anyone wants on the host, and
a root policy can replace ``find`` to answer anything at all. Each test asserts the listing
stays exact, or ends in a typed error, never an unbounded answer or a crash; the forged
answers are played against the host-side parser through a runtime whose sandbox answers with
the attacker's bytes.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runtimes import (
    FileInfo,
    ListingLimitExceededError,
    SandboxError,
    SubprocessConfig,
    SubprocessRuntime,
)
from runtimes.listing import parse_glob, parse_list, parse_stat
from runtimes.models import ExecRequest, OutputSink

from .fuzzing import fuzz

pytestmark = [pytest.mark.anyio, pytest.mark.attack(21)]


@pytest.fixture
async def rt() -> AsyncIterator[SubprocessRuntime]:
    async with SubprocessRuntime(SubprocessConfig()) as runtime:
        yield runtime


async def test_forged_entries_in_names_stay_names(rt: SubprocessRuntime) -> None:
    """Names holding newlines, what a line-based parser would read as whole entries, and
    bytes that are not UTF-8 come back as exactly those names, nothing more."""
    forged = "x\nf\t644\t 1 0 shadow\n"
    await rt.write(forged, b"a")
    await rt.exec(["sh", "-c", 'touch "$(printf "\\377\\376")"; mkdir -p "d\n../e"'])
    names = sorted(e.name for e in await rt.list("."))
    assert names == sorted([forged, "\udcff\udcfe", "d\n.."]), names
    deep = [e.path for e in await rt.glob("*/*")]
    assert deep == [f"{rt.workdir}/d\n../e"], deep


async def test_huge_directory_is_cut_with_a_typed_error(rt: SubprocessRuntime) -> None:
    """A directory of 30,000 entries is not taken onto the host: the default listing and
    a glob over it raise, naming the bound; a raised bound lists them all."""
    await rt.exec(["sh", "-c", "mkdir big && cd big && seq 30000 | xargs touch"])
    with pytest.raises(ListingLimitExceededError, match="max_entries"):
        await rt.list("big")
    with pytest.raises(ListingLimitExceededError):
        await rt.glob("big/*")
    assert len(await rt.list("big", max_entries=30_000)) == 30_000


async def test_replaced_find_on_the_policy_path_is_not_run(rt: SubprocessRuntime) -> None:
    """A ``find`` the policy put early on the ``PATH`` of the sandbox's environment is not
    the one a listing runs (the machinery's fixed ``PATH``)."""
    await rt.write("bin/find", "#!/bin/sh\nprintf 'f\\0000\\0000\\0000\\0\\0pwned\\0'\n")
    await rt.exec(["chmod", "+x", "bin/find"])
    rt.config.env["PATH"] = f"{rt.workdir}/bin:/usr/bin:/bin"
    try:
        names = [e.name for e in await rt.list("bin")]
    finally:
        del rt.config.env["PATH"]
    assert names == ["find"], names


class _Answering(SubprocessRuntime):
    """A sandbox whose listing program answers with ``answer`` (a replaced ``find``)."""

    answer = b""

    async def _routed_exec(self, request: ExecRequest, sink: OutputSink) -> int:
        if request.argv[:2] == ("sh", "-c") and "fmt=" in request.argv[2]:
            sink.feed("stdout", self.answer)
            return 0
        return await super()._routed_exec(request, sink)


ENTRY = b"f\x00644\x001\x001.5\x00\x00%s\x00"

FORGED = {
    "slash in a listed name": ENTRY % b"a/b" + b"\x000\x00",
    "dot-dot name": ENTRY % b".." + b"\x000\x00",
    "empty status": ENTRY % b"a" + b"\x00x\x00",
    "mode out of range": b"f\x0099999\x001\x001\x00\x00a\x00\x000\x00",
    "negative size": b"f\x00644\x00-1\x001\x00\x00a\x00\x000\x00",
    "nan mtime": b"f\x00644\x001\x00nan\x00\x00a\x00\x000\x00",
    "huge link target": b"l\x00777\x001\x001\x00" + b"t" * 20000 + b"\x00a\x00\x000\x00",
    "no NUL at the end": ENTRY % b"a" + b"\x000",
    "status then more": b"\x000\x00" + ENTRY % b"a",
}


@pytest.mark.parametrize("answer", FORGED.values(), ids=FORGED.keys())
async def test_forged_answers_are_typed_errors(answer: bytes) -> None:
    async with _Answering(SubprocessConfig()) as runtime:
        runtime.answer = answer
        with pytest.raises(SandboxError):
            await runtime.list(".")


async def test_endless_answer_is_bounded_by_the_read_limit() -> None:
    """An answer over ``read_limit`` bytes is refused, not kept."""
    async with _Answering(SubprocessConfig(read_limit=4096)) as runtime:
        runtime.answer = (ENTRY % (b"n" * 200)) * 100 + b"\x000\x00"
        with pytest.raises(ListingLimitExceededError, match="bytes"):
            await runtime.list(".")


# ---------------------------------------------------------------------- fuzzed parsers

_FIELD = st.one_of(
    st.sampled_from([b"", b"f", b"d", b"l", b"644", b"1", b"1.5", b"..", b".", b"a/b", b"nan"]),
    st.binary(max_size=24),
)
_ANSWERS = st.one_of(
    st.binary(max_size=2048),
    st.lists(_FIELD, max_size=40).map(lambda fields: b"".join(f + b"\0" for f in fields)),
    st.lists(
        st.tuples(
            st.sampled_from([b"f", b"d", b"l", b"s"]),
            st.from_regex(rb"\A[0-7]{1,5}\Z"),
            st.integers(0, 1 << 40).map(lambda n: str(n).encode()),
            st.from_regex(rb"\A-?[0-9]{1,12}(\.[0-9]{0,12})?\Z"),
            _FIELD,
            st.lists(st.sampled_from([b"a", b".h", b"b.py", b"\xff", b"n\n"]), min_size=1).map(
                b"/".join
            ),
        ),
        max_size=20,
    ).map(lambda entries: b"".join(b"\0".join(e) + b"\0" for e in entries) + b"\x000\x00"),
)


def _check_infos(infos: list[FileInfo], base: str) -> None:
    for info in infos:
        assert info.path.startswith(base.rstrip("/") + "/"), info
        assert info.kind in ("file", "directory", "symlink", "other")
        assert 0 <= info.mode <= 0o7777 and info.size >= 0 and math.isfinite(info.mtime)
        assert info.target is None or info.kind == "symlink"


@fuzz(300)
@given(answer=_ANSWERS, max_entries=st.integers(1, 30))
def test_any_listing_answer_parses_or_is_a_typed_error(answer: bytes, max_entries: int) -> None:
    for parse in (
        lambda: parse_list(answer, "/w", max_entries),
        lambda: parse_glob(answer, "/w", ["**", "*.py"], max_entries),
        lambda: parse_glob(answer, "/", ["*", ".*"], max_entries),
        lambda: [parse_stat(answer, "/w/x")],
    ):
        try:
            infos = parse()
        except SandboxError:
            continue
        _check_infos(infos, "/")
        assert len(infos) <= max(max_entries, 1)


def test_a_path_thousands_deep_is_matched_without_recursion() -> None:
    deep = b"/".join([b"a"] * 10000) + b"/x.py"
    answer = b"f\x00644\x001\x001\x00\x00" + deep + b"\x00\x000\x00"
    with pytest.raises(SandboxError, match="too long"):
        parse_glob(answer, "/w", ["**", "*.py"], 10)
    deep = b"/".join([b"a"] * 2000) + b"/x.py"
    answer = b"f\x00644\x001\x001\x00\x00" + deep + b"\x00\x000\x00"
    assert len(parse_glob(answer, "/w", ["**", "*.py"], 10)) == 1
