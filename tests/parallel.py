"""How the suite runs side by side (pytest-xdist, ``--dist loadgroup``): which tests share a
worker, which run alone after the others, and how what a worker counts reaches the summary.

`make test` runs the suite in two phases (docs/reliability.md, "How the suite runs"):

1. **side by side**: every test but the ``serial`` ones, on ``-n N`` workers. A worker takes a
   whole *group* at a time: a test file, or one class of it where the file has classes (a
   conformance class shares its sandboxes between its checks: splitting it would build them
   twice). Tests that act on a whole backend of this machine rather than on what they made
   share one group, :data:`MACHINE_WIDE`, so that they never run beside each other: a
   ``cleanup`` of dead sessions' or kept sandboxes removes what another such test left on
   purpose to look at. Every test that needs the real Ray cluster is in that group too (the
   cluster's cleanup sweeps the same engine), so one cluster is built, not one per worker.
2. **alone**: the ``serial`` tests (:data:`SERIAL`), in one process with nothing beside them:
   the soak loads both cores on purpose and measures what that does.

Everything else is safe beside other workers by construction: each test names what it
counts (a label with its own session or pool id, a unique ``sleep`` token), never "everything
on the machine".
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent

SERIAL = frozenset(
    {
        # loads both cores on purpose and measures what that does
        "tests/reliability/test_soak.py",
        # a turn budget bounded in seconds (60 s): 86 s beside three workers' load
        "tests/harnesses/test_mini_swe_agent.py",
        # kills SSH transports under calls in flight and bounds how soon each notices (seconds)
        "tests/ssh/test_transport_death.py",
    }
)
"""Test files that run alone, after the side-by-side phase (marked ``serial``)."""

MACHINE_WIDE = frozenset(
    {
        # `cleanup` of the dead sessions' sandboxes on a shared backend (Docker, the default
        # subprocess root), or of every kept one: each removes what the others left to see.
        "tests/docker/test_teardown.py",
        "tests/docker/test_leaks.py",
        "tests/ray/test_cleanup.py",
        "tests/pool/test_pool_docker.py",
        "tests/reliability/test_leaks.py",
        "tests/reliability/test_bad_config.py",
        "tests/snapshots/test_forks.py",
        "tests/snapshots/test_workdir_copies.py",
        "tests/snapshots/test_docker.py",
        "tests/test_keep.py",
        "tests/test_exec_check_and_repr.py",
        "tests/test_plugin_guide.py",
        # inspect_ai's own cleanup removes every ended eval's sandboxes.
        "tests/inspect/test_provider.py",
        "tests/inspect/test_eval.py",
    }
)
"""Test files that sweep or count a whole backend of this machine: one group, one at a time."""

MACHINE_GROUP = "machine"

FIRST = (MACHINE_GROUP, "tests/conformance/")
"""Groups started first (by prefix): the longest, so that none of them is the run's tail."""


def relative(item: pytest.Item) -> str:
    return Path(str(item.fspath)).resolve().relative_to(ROOT.parent).as_posix()


def group_of(item: pytest.Item) -> str:
    """The xdist group a test runs in (see the module's docstring)."""
    name = relative(item)
    # The cluster's cleanup sweeps the engine the other machine-wide tests leave things on.
    if "ray_cluster" in getattr(item, "fixturenames", ()) or name in MACHINE_WIDE:
        return MACHINE_GROUP
    cls = getattr(item, "cls", None)
    return f"{name}::{cls.__name__}" if cls is not None else name


def _rank(group: str) -> int:
    for index, prefix in enumerate(FIRST):
        if group.startswith(prefix):
            return index
    return len(FIRST)


def place(items: list[pytest.Item]) -> None:
    """Mark every test with its group (or ``serial``) and start the longest groups first."""
    groups: dict[int, str] = {}
    for item in items:
        if relative(item) in SERIAL:
            item.add_marker(pytest.mark.serial)
        group = group_of(item)
        groups[id(item)] = group
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: _rank(groups[id(item)]))


UNGROUPED = pytest.StashKey[str]()


def check_grouped(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker under ``--dist loadgroup``: note (``UNGROUPED``, each test then
    fails with it) unless every test carries its group in its id, which is what the
    controller schedules by (the worker's own hook appends ``@group``).

    pytest 9.2 keeps a node's id elsewhere than pytest-xdist 3.8 sets it: every test was
    then scheduled on its own, the groups' tests ran beside each other, and only the tests
    that count what a whole backend holds said so, at random (pyproject.toml pins pytest)."""
    if not config.getoption("loadgroup", default=False):
        return  # not a loadgroup worker
    lost = [item.nodeid for item in items if not item.nodeid.endswith("@" + group_of(item))]
    if lost:
        config.stash[UNGROUPED] = (
            f"pytest-xdist did not group {len(lost)} of {len(items)} tests (first: {lost[0]}): "
            "the groups of tests/parallel.py would run side by side; this pytest and "
            "pytest-xdist do not agree (pyproject.toml's test extra)"
        )


def fail_ungrouped(item: pytest.Item) -> None:
    """Fail ``item`` with :func:`check_grouped`'s finding, if it had one."""
    message = item.config.stash.get(UNGROUPED, None)
    if message is not None:
        pytest.fail(message, pytrace=False)


# ------------------------------------------------- what a worker counts, in the summary
#
# A count a test adds (the reliability tally, the attack suite's) is carried on the test's
# teardown report, which xdist sends from the worker to the controller: the summary at the end
# of the run is the whole run's, side by side or not.

SUMMARY = "vf-summary"
PENDING: list[tuple[str, Any]] = []
"""What tests of this process counted since the last report (see :func:`emit`)."""
RECEIVED: dict[str, list[Any]] = defaultdict(list)
"""What the reports carried, by name: the whole run's, on the process that prints."""


def emit(name: str, payload: Any) -> None:
    """Count ``payload`` under ``name`` (JSON-able) for the end-of-run summary."""
    PENDING.append((name, payload))


def attach(report: pytest.TestReport) -> None:
    """Carry what was counted on a teardown report."""
    if report.when == "teardown" and PENDING:
        report.user_properties.extend((SUMMARY, entry) for entry in PENDING)
        PENDING.clear()


def receive(report: pytest.TestReport) -> None:
    for key, value in report.user_properties:
        if key == SUMMARY:
            name, payload = value
            RECEIVED[name].append(payload)
