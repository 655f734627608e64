"""The conformance suite as a reusable kit.

For a plugin's own tests (pytest)::

    from runtimes.testing import RuntimeConformance

    class TestMyBackend(RuntimeConformance):
        runtime_config = {"type": "mybackend", "host": "..."}

From the command line: ``vf-sandbox check --runtime '{"type": "mybackend", ...}'``.
From code: :func:`run_conformance`, or :class:`CheckRunner` inside an event loop.

By default every check gets a fresh sandbox. With ``share_sandbox`` (a class attribute of
``RuntimeConformance``, a keyword of :func:`run_conformance` and :class:`CheckRunner`), the
checks marked :attr:`Check.shares_sandbox` run one after another in one sandbox, which saves a
sandbox creation per check; the others still get a fresh one. See ``docs/conformance.md``.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio

from ..base import Runtime
from ..config import RuntimeConfig
from ..registry import open_runtime, resolve_runtime_config
from .checks import (
    CHECKS,
    Check,
    CheckOutcome,
    CheckSkipped,
    assert_left_nothing,
    workdir_names,
)

if TYPE_CHECKING:
    from .pytest_suite import RuntimeConformance

__all__ = [
    "CHECKS",
    "Check",
    "CheckOutcome",
    "CheckRunner",
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


class CheckRunner:
    """Runs checks against one config, in the running event loop.

    With ``share_sandbox`` (the default), a check marked :attr:`Check.shares_sandbox` runs in
    one sandbox kept open for the next such check: opened when first needed, closed (and
    replaced at the next need) after a check fails, since a failed check may have left
    anything behind. Every other check, and every check without ``share_sandbox``, gets a
    fresh sandbox (:func:`run_check`). Use it as an async context manager, or call
    :meth:`aclose`: either closes the shared sandbox.
    """

    def __init__(
        self, config: ConfigLike, *, share_sandbox: bool = True, verify_sharing: bool = False
    ) -> None:
        self.config = resolve_runtime_config(config)
        self.share_sandbox = share_sandbox
        self.verify_sharing = verify_sharing
        """After each check in the shared sandbox, fail it unless it left nothing a later
        check could see: no process its commands started (``stop_processes()`` finds none),
        no new workdir entry outside the checks' scratch prefix. Costs a few commands per
        check; meant for proving the kit's ``shares_sandbox`` marks on a backend."""
        self._shared: Runtime | None = None

    async def run(self, check: Check) -> None:
        """Run ``check``, in the shared sandbox or a fresh one (see the class).

        Raises whatever the check raises (``AssertionError``, a ``SandboxError``,
        :class:`CheckSkipped`), ``TimeoutError`` if opening a sandbox and running the check
        take over five minutes, ``AssertionError`` if a check marked ``shares_sandbox``
        closed its sandbox (or, with ``verify_sharing``, left something behind), and a
        ``SandboxError`` if a sandbox cannot be opened or closed.
        """
        if not (self.share_sandbox and check.shares_sandbox):
            await run_check(check, self.config)
            return
        with anyio.fail_after(CHECK_TIMEOUT):
            runtime = await self._shared_runtime()
            try:
                before = await workdir_names(runtime) if self.verify_sharing else set()
                await check.fn(runtime)
                if runtime.closed:
                    raise AssertionError(f"check {check.name} shares its sandbox but closed it")
                if self.verify_sharing:
                    await assert_left_nothing(check.name, runtime, before)
            except CheckSkipped:
                raise
            except BaseException:
                await self.aclose()  # a failed check may have left anything behind
                raise

    async def _shared_runtime(self) -> Runtime:
        if self._shared is None:
            self._shared = await open_runtime(self.config).start()
        return self._shared

    async def aclose(self) -> None:
        """Close the shared sandbox, if one is open.

        Raises:
            SandboxTransportError: the backend could not confirm the sandbox is gone.
        """
        runtime, self._shared = self._shared, None
        if runtime is not None:
            await runtime.close()

    async def __aenter__(self) -> CheckRunner:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def run_conformance(
    config: ConfigLike,
    *,
    backend: str = "asyncio",
    select: list[str] | None = None,
    share_sandbox: bool = False,
) -> list[CheckOutcome]:
    """Run every check (or those named in ``select``) and report each outcome.

    Each check runs in a fresh sandbox under an event loop of its own; with
    ``share_sandbox``, all run under one event loop and the checks marked
    :attr:`Check.shares_sandbox` share one sandbox (:class:`CheckRunner`).

    Raises:
        SandboxTransportError: with ``share_sandbox``, the shared sandbox could not be
            closed at the end (a failing check is an outcome, never raised).
    """
    resolved = resolve_runtime_config(config)
    checks = [chk for chk in CHECKS if not select or chk.name in select]
    if share_sandbox:
        return anyio.run(_outcomes_in_one_loop, checks, resolved, backend=backend)
    outcomes = []
    for chk in checks:
        started = time.monotonic()
        try:
            anyio.run(run_check, chk, resolved, backend=backend)
        except Exception as exc:  # noqa: BLE001 - a failed check is a reported outcome
            outcomes.append(_failed(chk, exc, started))
        else:
            outcomes.append(_passed(chk, started))
    return outcomes


async def _outcomes_in_one_loop(checks: list[Check], config: RuntimeConfig) -> list[CheckOutcome]:
    outcomes = []
    async with CheckRunner(config) as runner:
        for chk in checks:
            started = time.monotonic()
            try:
                await runner.run(chk)
            except Exception as exc:  # noqa: BLE001 - a failed check is a reported outcome
                outcomes.append(_failed(chk, exc, started))
            else:
                outcomes.append(_passed(chk, started))
    return outcomes


def _passed(chk: Check, started: float) -> CheckOutcome:
    return CheckOutcome(chk.name, "pass", "", time.monotonic() - started)


def _failed(chk: Check, exc: Exception, started: float) -> CheckOutcome:
    """The outcome of a check that raised: a skip, or a failure with the error's one line."""
    seconds = time.monotonic() - started
    if isinstance(exc, CheckSkipped):
        return CheckOutcome(chk.name, "skip", str(exc), seconds)
    detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return CheckOutcome(chk.name, "fail", detail, seconds)


def __getattr__(name: str) -> Any:
    if name == "RuntimeConformance":
        from .pytest_suite import RuntimeConformance

        return RuntimeConformance
    raise AttributeError(f"module 'runtimes.testing' has no attribute {name!r}")
