"""The conformance suite as a reusable kit.

For a plugin's own tests (pytest)::

    from runtimes.testing import RuntimeConformance

    class TestMyBackend(RuntimeConformance):
        runtime_config = {"type": "mybackend", "host": "..."}

From the command line: ``vf-sandbox check --runtime '{"type": "mybackend", ...}'``.
From code: :func:`run_conformance`.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from ..config import RuntimeConfig
from ..registry import open_runtime, resolve_runtime_config
from .checks import CHECKS, Check, CheckOutcome, CheckSkipped

if TYPE_CHECKING:
    from .pytest_suite import RuntimeConformance

__all__ = [
    "CHECKS",
    "Check",
    "CheckOutcome",
    "CheckSkipped",
    "RuntimeConformance",
    "run_check",
    "run_conformance",
]

ConfigLike = RuntimeConfig | Mapping[str, Any] | str

CHECK_TIMEOUT = 300.0


async def run_check(check: Check, config: ConfigLike) -> None:
    """Start a fresh sandbox from ``config``, run one check in it, and close it.

    Raises whatever the check raises (``AssertionError``, a ``SandboxError``,
    :class:`CheckSkipped`), and ``TimeoutError`` if it takes over five minutes.
    """
    with anyio.fail_after(CHECK_TIMEOUT):
        async with open_runtime(config) as rt:
            await check.fn(rt)


def run_conformance(
    config: ConfigLike,
    *,
    backend: str = "asyncio",
    select: list[str] | None = None,
) -> list[CheckOutcome]:
    """Run every check (or those named in ``select``) and report each outcome."""
    resolved = resolve_runtime_config(config)
    outcomes = []
    for chk in CHECKS:
        if select and chk.name not in select:
            continue
        started = time.monotonic()
        try:
            anyio.run(run_check, chk, resolved, backend=backend)
        except CheckSkipped as exc:
            outcomes.append(CheckOutcome(chk.name, "skip", str(exc), time.monotonic() - started))
        except Exception as exc:  # noqa: BLE001 - a failed check is a reported outcome
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            outcomes.append(CheckOutcome(chk.name, "fail", detail, time.monotonic() - started))
        else:
            outcomes.append(CheckOutcome(chk.name, "pass", "", time.monotonic() - started))
    return outcomes


def __getattr__(name: str) -> Any:
    if name == "RuntimeConformance":
        from .pytest_suite import RuntimeConformance

        return RuntimeConformance
    raise AttributeError(f"module 'runtimes.testing' has no attribute {name!r}")
