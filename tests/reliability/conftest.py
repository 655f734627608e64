"""Shared pieces of the reliability suite: bounded calls, real servers, counters.

Every faulted call goes through :func:`settle`: it runs under ``anyio.fail_after(limit)``
and returns what the call raised (or returned). A call that hangs fails the test with
"hung", which can never be mistaken for the typed error the test expects: ``fail_after``
raises a bare ``TimeoutError``, the runtimes raise ``ExecTimeoutError``.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import Runtime, ownership
from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, require_docker_image
from runtimes.reaper import drain_removals_blocking
from tests.parallel import emit
from tests.processes import sleep_token
from tests.ssh.sshd import IMAGE as SSHD_IMAGE
from tests.ssh.sshd import SSHServer, image_present

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---------------------------------------------------------------------- bounded calls


@dataclass
class Outcome:
    """What a bounded call did: its result, or what it raised, and how long it took."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0

    def raised(self, *kinds: type[BaseException]) -> BaseException:
        assert self.error is not None, f"expected {kinds}, the call returned {self.value!r}"
        assert isinstance(self.error, kinds), (
            f"expected {kinds}, got {type(self.error).__name__}: {self.error}"
        )
        return self.error


async def settle(call: Awaitable[Any], limit: float) -> Outcome:
    """Await ``call`` for at most ``limit`` seconds; a hang fails the test."""
    started = time.monotonic()
    outcome = Outcome()
    try:
        with anyio.fail_after(limit) as scope:
            outcome.value = await call
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        if type(exc) is TimeoutError and scope.cancel_called:
            pytest.fail(f"the call hung: no answer within {limit:g}s")
        outcome.error = exc
    outcome.seconds = time.monotonic() - started
    return outcome


async def settle_during(
    call: Awaitable[Any], delay: float, fault: Callable[[], None], limit: float
) -> Outcome:
    """:func:`settle` ``call``; ``delay`` seconds in, inject ``fault`` (blocking, in a thread)."""

    async def inject() -> None:
        await anyio.sleep(delay)
        await anyio.to_thread.run_sync(fault)

    async with anyio.create_task_group() as tg:
        tg.start_soon(inject)
        return await settle(call, limit)


# ---------------------------------------------------------------------- host resources


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def live_threads() -> int:
    return threading.active_count()


async def settle_host(limit_fds: int, limit_threads: int, within: float = 15) -> tuple[int, int]:
    """Wait (at most ``within`` seconds) until this process holds at most ``limit_fds``
    descriptors and ``limit_threads`` threads; return both counts. anyio prunes a worker
    thread idle for 10 s when the pool is next used, so the wait keeps using it."""
    fds, threads = open_fds(), live_threads()
    with anyio.move_on_after(within):
        while fds > limit_fds or threads > limit_threads:
            await anyio.sleep(0.25)
            await anyio.to_thread.run_sync(time.sleep, 0)
            fds, threads = open_fds(), live_threads()
    return fds, threads


@dataclass
class Tally:
    """Numbers the suite reports (docs/reliability.md): printed at the end of a run."""

    counts: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, amount: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + amount
        emit("reliability", [key, amount])


TALLY = Tally()

TABLES: dict[str, list[str]] = {}
"""Tables a test prints at the end of the run (title: lines), whatever ``-s`` says."""


def write_tally(terminalreporter: Any, counted: list[Any]) -> None:
    """The reliability tally of the whole run (each worker's counts, tests/parallel.py)."""
    totals: dict[str, int] = {}
    for key, amount in counted:
        totals[key] = totals.get(key, 0) + int(amount)
    if totals:
        terminalreporter.section("reliability tally")
        for key in sorted(totals):
            terminalreporter.write_line(f"{key}: {totals[key]}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for title, lines in TABLES.items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)


# ---------------------------------------------------------------------- servers


@pytest.fixture(scope="session")
def sshd_image() -> str:
    if not image_present():
        pytest.fail(f"{SSHD_IMAGE} is missing: build it with `make images`")
    return SSHD_IMAGE


@pytest.fixture(scope="session")
def shared_sshd(tmp_path_factory: pytest.TempPathFactory, sshd_image: str) -> Iterator[SSHServer]:
    """One sshd for the tests that do not kill it."""
    with SSHServer(Path(tmp_path_factory.mktemp("sshd"))) as server:
        yield server


# ---------------------------------------------------------------------- processes in a sandbox


token = sleep_token
"""A unique sleep duration: ``sleep <token>`` is findable with ps, and nothing else is."""


async def processes_matching(rt: Runtime, needle: str) -> list[str]:
    """Lines of ``ps -eo pid,args`` inside the sandbox that mention ``needle``."""
    result = await rt.exec(["ps", "-eo", "pid,args"], timeout=30)
    return [line for line in result.stdout.splitlines() if needle in line and "ps -eo" not in line]


async def assert_no_process(rt: Runtime, needle: str, wait: float = 3.0) -> None:
    """Poll briefly (a kill is sent before the error is raised; reaping may lag)."""
    left: list[str] = []
    with anyio.move_on_after(wait):
        while left := await processes_matching(rt, needle):  # noqa: ASYNC110 - polling ps
            await anyio.sleep(0.1)
    assert not left, f"processes left running in the sandbox: {left}"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------- docker


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A plain docker SDK client, to do to containers what a crash or an operator does."""
    import docker

    require_docker_image(DOCKER_TEST_IMAGE)
    client = docker.from_env(timeout=60)
    try:
        yield client
    finally:
        client.close()


def session_containers(client: Any, session_id: str = ownership.CREATOR_ID) -> list[Any]:
    found: list[Any] = client.containers.list(
        all=True, filters={"label": f"{ownership.CREATOR}={session_id}"}
    )
    return found


@pytest.fixture
def no_container_leaks(docker_client: Any) -> Iterator[None]:
    """Fail the test if it leaves a container of this session behind (and remove those)."""
    before = {c.id for c in session_containers(docker_client)}
    yield
    drain_removals_blocking()  # close() returns before the background removal ends
    left = [c for c in session_containers(docker_client) if c.id not in before]
    for container in left:
        container.remove(force=True)
    assert not left, f"containers left behind: {[c.name for c in left]}"
