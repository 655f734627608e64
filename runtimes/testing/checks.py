"""The conformance checks every backend must pass.

Each check is an async function taking a started :class:`~runtimes.Runtime`.
It raises ``AssertionError`` (or any other exception) on failure and
:class:`CheckSkipped` when it does not apply to this sandbox (for example permission
checks inside a sandbox that runs as root, where nothing is unreadable).

Every check says whether it may share its sandbox with other checks
(``@check(shares_sandbox=...)``, :attr:`Check.shares_sandbox`): a sharing check leaves nothing
a later check could see (no process, no file outside paths of its own with unique names, the
runtime open); a check that closes the runtime or is about the sandbox's processes as a whole
always gets a fresh sandbox.

The same list drives the pytest suite (:mod:`runtimes.testing.pytest_suite`) and
``vf-sandbox check``.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from ..base import Runtime

CheckFn = Callable[[Runtime], Awaitable[None]]


class CheckSkipped(Exception):
    """The check does not apply to this sandbox; the message says why."""


@dataclass(frozen=True)
class Check:
    name: str
    fn: CheckFn
    doc: str
    shares_sandbox: bool = False
    """Whether the check may run in a sandbox other checks use before and after it: it
    leaves no process running, writes only under paths of its own with unique names, and
    leaves the runtime open. ``False``: it always gets a fresh sandbox."""


CHECKS: list[Check] = []


def check(*, shares_sandbox: bool) -> Callable[[CheckFn], CheckFn]:
    """Register the decorated ``check_<name>`` function as the check ``<name>``."""

    def register(fn: CheckFn) -> CheckFn:
        name = fn.__name__.removeprefix("check_")
        doc = (fn.__doc__ or "").strip().splitlines()[0]
        CHECKS.append(Check(name, fn, doc, shares_sandbox))
        return fn

    return register


# ---------------------------------------------------------------------- helpers


def unique_token() -> str:
    """A unique sleep duration, so the check can find its own processes with ps."""
    return f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"


async def processes_matching(rt: Runtime, token: str) -> list[str]:
    result = await rt.exec(["ps", "-eo", "pid,args"], timeout=30)
    return [line for line in result.stdout.splitlines() if token in line and "ps -eo" not in line]


async def wait_for_processes(rt: Runtime, token: str, count: int) -> list[str]:
    """Poll briefly: a process shows its argv only once it has exec'd, and ps prints an
    empty command line for one caught in the middle of an ``execve``."""
    seen: list[str] = []
    for _ in range(40):
        seen = await processes_matching(rt, token)
        if len(seen) >= count:
            return seen
        await anyio.sleep(0.05)
    raise AssertionError(f"expected {count} processes with {token}, saw {seen}")


async def assert_no_process(rt: Runtime, token: str) -> None:
    """Poll briefly: the kill is sent before the error is raised, reaping may lag."""
    left: list[str] = []
    for _ in range(40):
        left = await processes_matching(rt, token)
        if not left:
            return
        await anyio.sleep(0.05)
    raise AssertionError(f"processes left running in the sandbox: {left}")


async def is_root(rt: Runtime) -> bool:
    return (await rt.exec(["id", "-u"])).stdout.strip() == "0"


def assert_names(exc: BaseException, path: str) -> None:
    assert path in str(exc), f"error message does not name {path!r}: {exc}"


SCRATCH_PREFIX = "conformance-"
"""How the paths a check makes in the workdir begin (each with a unique random suffix)."""


async def scratch_dir(rt: Runtime) -> str:
    path = f"{rt.workdir}/{SCRATCH_PREFIX}{random.randrange(1 << 30)}"
    result = await rt.exec(["mkdir", "-p", path])
    assert result.exit_code == 0, result
    return path


async def expect_raises(
    expected: type[BaseException] | tuple[type[BaseException], ...], awaitable: Awaitable[object]
) -> BaseException:
    try:
        await awaitable
    except expected as exc:
        return exc
    except BaseException as exc:
        raise AssertionError(f"expected {expected}, got {type(exc).__name__}: {exc}") from exc
    raise AssertionError(f"expected {expected}, nothing was raised")


async def workdir_names(rt: Runtime) -> set[str]:
    listing = await rt.exec(
        [
            "sh",
            "-c",
            'cd "$1" && for f in * .[!.]* ..?*; do [ -e "$f" ] || [ -L "$f" ] &&'
            ' printf "%s\\0" "$f"; done; true',
            "sh",
            rt.workdir,
        ],
        timeout=60,
    )
    assert listing.exit_code == 0, listing
    return set(listing.stdout_bytes.decode("utf-8", "surrogateescape").split("\0")[:-1])


async def assert_left_nothing(name: str, rt: Runtime, before: set[str]) -> None:
    """What a check marked ``shares_sandbox`` promises the next check: no process its
    commands started is left, the runtime answers, and the workdir gained only paths with
    the scratch prefix."""
    left = await rt.stop_processes()
    assert left == 0, f"{name} shares its sandbox but left {left} processes running"
    added = await workdir_names(rt) - before
    foreign = sorted(n for n in added if not n.startswith(SCRATCH_PREFIX))
    assert not foreign, f"{name} shares its sandbox but made {foreign} in the workdir"


@dataclass(frozen=True)
class CheckOutcome:
    name: str
    status: str  # "pass", "fail", "skip"
    detail: str
    seconds: float


# Registering the checks, in the order they run: exec, then files and the lifecycle.
from . import (  # noqa: E402, F401
    exec_checks,
    file_checks,
    listing_checks,
    path_checks,
    process_checks,
    shell_checks,
    stdin_checks,
    stream_checks,
)
