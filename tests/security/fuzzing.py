"""What the fuzzing tests of attack class 21 (host parsers of sandbox bytes) share: their
hypothesis settings and a bound on what one parse may allocate.

The budget is bounded and reproducible in ``make test``: a fixed number of examples per test
(``max_examples``), examples drawn from a fixed seed (``derandomize=True``: CI sees the same
inputs on every run, so a red build can be replayed exactly), no deadline (a loaded 2-core CI
machine must not turn slowness into a failure; hangs are caught by the tests' own timeouts),
and no example database (nothing written into the checkout).

A longer session, run locally: ``VF_FUZZ_EXAMPLES=20000 .venv/bin/pytest tests/security -k fuzz
-p no:cacheprovider``. With the variable set every fuzz test runs that many examples, from a
fresh random seed each run (``derandomize`` off) and with the falsifying example's blob printed
for ``@reproduce_failure``; a failure found so goes back into the test as an ``@example``.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from hypothesis import HealthCheck, settings

EXAMPLES_ENV = "VF_FUZZ_EXAMPLES"
"""Environment variable: the number of examples each fuzz test runs (a longer session)."""

T = TypeVar("T")


def long_session() -> int | None:
    """The number of examples ``VF_FUZZ_EXAMPLES`` asks for, ``None`` when it is unset."""
    value = os.environ.get(EXAMPLES_ENV, "").strip()
    if not value:
        return None
    try:
        examples = int(value)
    except ValueError:
        raise ValueError(f"{EXAMPLES_ENV} must be a number of examples, got {value!r}") from None
    if examples < 1:
        raise ValueError(f"{EXAMPLES_ENV} must be at least 1, got {examples}")
    return examples


def fuzz(examples: int) -> Callable[[T], T]:
    """The settings of one fuzz test: ``examples`` in ``make test`` (sized so the module runs
    in well under 30 s on a 2-core machine), ``VF_FUZZ_EXAMPLES`` in a longer session."""
    longer = long_session()
    return settings(
        max_examples=longer or examples,
        deadline=None,
        derandomize=longer is None,
        database=None,
        print_blob=longer is not None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def cut(data: bytes, sizes: list[int]) -> list[bytes]:
    """``data`` in pieces whose sizes cycle through ``sizes``: a stream as a transport may
    deliver it, cut anywhere."""
    pieces, pos, i = [], 0, 0
    while pos < len(data):
        step = sizes[i % len(sizes)]
        pieces.append(data[pos : pos + step])
        pos += step
        i += 1
    return pieces


@contextmanager
def allocation_peak() -> Iterator[list[int]]:
    """Measure the peak of Python allocations (all threads) inside the block, above what was
    allocated at its start; the value lands in the yielded list once the block ends."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    before, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    peak: list[int] = []
    try:
        yield peak
    finally:
        _, top = tracemalloc.get_traced_memory()
        peak.append(max(0, top - before))
        if started:
            tracemalloc.stop()
