"""Hooks for the whole suite."""

from __future__ import annotations

import atexit
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from runtimes import drain_removals_blocking
from tests import parallel

if TYPE_CHECKING:
    from tests.ray.cluster import LocalCluster


@pytest.fixture(autouse=True)
def _removals_finish_within_their_test() -> Iterator[None]:
    """Sandboxes a test closed are removed (in the background on Docker) before the next test
    starts, and a removal that failed fails the test that closed the sandbox, not a later one."""
    yield
    drain_removals_blocking()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase",
        choices=("all", "parallel", "serial"),
        default="all",
        help="all tests, or those of `make test`'s side-by-side or serial phase "
        "(tests/parallel.py)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's xdist group and phase (tests/parallel.py)."""
    parallel.place(items)
    phase = config.getoption("--phase")
    if phase != "all":
        wanted = phase == "serial"
        kept, dropped = [], []
        for item in items:
            serial = item.get_closest_marker("serial") is not None
            (kept if serial == wanted else dropped).append(item)
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = kept


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a side-by-side worker: pytest-xdist took every test's group (tests/parallel.py)."""
    parallel.check_grouped(session.config, session.items)


def pytest_runtest_setup(item: pytest.Item) -> None:
    parallel.fail_ungrouped(item)


_FILE_SECONDS: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    parallel.attach(outcome.get_result())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Add each phase's time (set-up, call, teardown) to its test file's total, and take what
    the test counted for the summary (tests/parallel.py)."""
    parallel.receive(report)
    name = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[name] = _FILE_SECONDS.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Where the suite's time goes, by test file: what to look at first when `make test`
    nears its time budget; then the tallies the suite's parts count."""
    from tests.reliability.conftest import write_tally
    from tests.security.conftest import write_attack_tally

    write_tally(terminalreporter, parallel.RECEIVED["reliability"])
    write_attack_tally(terminalreporter, parallel.RECEIVED["attack"])
    if not _FILE_SECONDS:
        return
    total = sum(_FILE_SECONDS.values())
    ranked = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])
    terminalreporter.section("time by test file (set-up + call + teardown)")
    for name, seconds in ranked[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {name}")
    if len(ranked) > 25:
        rest = sum(seconds for _, seconds in ranked[25:])
        terminalreporter.write_line(
            f"{rest:8.1f}s {100 * rest / total:5.1f}%  ({len(ranked) - 25} more)"
        )
    terminalreporter.write_line(f"{total:8.1f}s 100.0%  in all")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalCluster]:
    """A real 3-node Ray cluster (tests/ray/cluster.py: each worker node a network namespace
    of its own, 4 ``vf_sandbox`` slots each) with this process connected as its driver. It
    fails, never skips, where it cannot be built: CI runs as root with iproute2."""
    from tests.ray.cluster import LocalCluster, require_root_and_ip

    require_root_and_ip()
    cluster = LocalCluster(workers=3, slots=4)
    atexit.register(cluster.stop)  # a backstop where the session ends without teardown
    try:
        cluster.start()
        cluster.connect()
        yield cluster
    finally:
        cluster.stop()
