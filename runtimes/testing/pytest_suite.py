"""The conformance suite as a pytest base class.

Subclass :class:`RuntimeConformance` in a test module and either set ``config`` (a
dict, a type name or a config model) or override the ``runtime_config`` fixture when
the config depends on other fixtures (a container started by testcontainers, say).
``anyio_backends`` lists the event loops every check runs under. ``share_sandbox = True``
runs the checks marked :attr:`~runtimes.testing.Check.shares_sandbox` in one sandbox per
event loop for the whole class (see ``docs/conformance.md``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

import anyio
import pytest
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ..config import RuntimeConfig
from ..registry import resolve_runtime_config
from . import CHECKS, Check, CheckRunner, CheckSkipped, ConfigLike, run_check


class RuntimeConformance:
    """Every conformance check, as one test each, against ``runtime_config``."""

    config: ClassVar[ConfigLike | None] = None
    anyio_backends: ClassVar[tuple[str, ...]] = ("asyncio",)
    share_sandbox: ClassVar[bool] = False
    """Run the checks marked ``shares_sandbox`` in one sandbox per event loop, kept open
    from the first such check of the class to the class's end (each event loop then runs
    in a thread of its own). The fixtures ``runtime_config`` depends on must outlive it:
    give them the class scope or a wider one, and make class-scoped ones autouse, so
    pytest sets them up before the shared sandboxes and tears them down after."""
    verify_sharing: ClassVar[bool] = False
    """With ``share_sandbox``: after each check in a shared sandbox, fail it unless it left
    nothing a later check could see (:class:`~runtimes.testing.CheckRunner`)."""

    @pytest.fixture
    def runtime_config(self) -> ConfigLike:
        if self.config is None:
            pytest.fail(f"{type(self).__name__} sets neither `config` nor a runtime_config fixture")
        return self.config

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_shared_sandboxes(cls) -> Iterator[SharedSandboxes]:
        """The class's shared sandboxes (none is opened without ``share_sandbox``)."""
        with SharedSandboxes(verify_sharing=cls.verify_sharing) as shared:
            yield shared

    @pytest.mark.parametrize("check", CHECKS, ids=[c.name for c in CHECKS])
    def test_conformance(
        self,
        check: Check,
        runtime_config: ConfigLike,
        conformance_shared_sandboxes: SharedSandboxes,
    ) -> None:
        for backend in self.anyio_backends:
            try:
                if self.share_sandbox and check.shares_sandbox:
                    conformance_shared_sandboxes.run(check, runtime_config, backend)
                else:
                    anyio.run(run_check, check, runtime_config, backend=backend)
            except CheckSkipped as exc:
                pytest.skip(str(exc))


class SharedSandboxes:
    """Shared sandboxes across tests: one event loop per anyio backend, running in a thread
    of its own (a blocking portal), with one :class:`CheckRunner` per config in it. Leaving
    the context closes every shared sandbox, then stops the loops."""

    def __init__(self, *, verify_sharing: bool = False) -> None:
        self._verify_sharing = verify_sharing
        self._stack = contextlib.ExitStack()
        self._portals: dict[str, BlockingPortal] = {}
        self._runners: dict[tuple[str, RuntimeConfig], CheckRunner] = {}

    def run(self, check: Check, config: ConfigLike, backend: str) -> None:
        """Run ``check`` under ``backend`` in that loop's shared sandbox for ``config``.

        Raises what :meth:`CheckRunner.run` raises.
        """
        portal = self._portal(backend)
        key = (backend, resolve_runtime_config(config))
        runner = self._runners.get(key)
        if runner is None:
            runner = CheckRunner(key[1], verify_sharing=self._verify_sharing)
            self._runners[key] = runner
            self._stack.callback(portal.call, runner.aclose)
        portal.call(runner.run, check)

    def _portal(self, backend: str) -> BlockingPortal:
        if backend not in self._portals:
            self._portals[backend] = self._stack.enter_context(start_blocking_portal(backend))
        return self._portals[backend]

    def __enter__(self) -> SharedSandboxes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Close every shared sandbox (all are tried), then stop the event loops.

        Raises:
            SandboxTransportError: a backend could not confirm a sandbox is gone.
        """
        self._stack.close()
