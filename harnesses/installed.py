"""Installed harnesses: off-the-shelf agents installed INTO the sandbox and launched there.

A sandbox may hold whatever a policy left in it, so an installed agent is never trusted
by its path. Installation (:meth:`InstalledHarness.setup`) is idempotent, verified and
locked:

1. This host process remembers, per sandbox (runtime object) and set of pinned
   requirements, the venv it installed and a **tree digest** of it, computed right after
   the install by the sandbox's ``python -I -S`` (not the venv's) from ``lstat`` of every
   entry: type, mode, owner, size, inode, mtime, ctime and link targets (a changed or
   replaced file changes its ctime or inode). A later setup recomputes the digest and
   reuses the venv only if it matches; otherwise, or when this process never installed
   one there, it installs afresh. A venv found at some path is never reused.
2. A fresh install goes to an **unpredictable** directory,
   ``<install_root>/<package>/<version>-<hash>-<random>/`` created with mode 0755 by the
   sandbox's default user (root where the sandbox runs as root), never one that existed:
   readable by a policy account that runs the agent (``user``), writable by nobody else.
3. The host prepares a **wheelhouse** for the sandbox's interpreter and platform
   (``pip download --only-binary=:all: --python-version X.Y --platform
   manylinux_2_N_<arch>``), cached under ``~/.cache/vf-sandbox/wheelhouses/`` (or
   ``VF_SANDBOX_CACHE``), or uses the one the config names (fully offline), and uploads
   it into that fresh directory (never reusing a wheelhouse found in the sandbox).
4. Under ``flock`` on ``<install_root>/<package>/install.lock`` inside the sandbox, a
   venv is created and the package installed with ``pip install --no-index
   --find-links``; each install appends a line to ``install.log`` there. Concurrent
   setups from this process install once (a host-side lock per sandbox and requirements).
5. The venv is checked against the wheels the host uploaded
   (:func:`harnesses.wheel_check.verify_install`): each file a wheel's ``RECORD`` lists,
   opened without following links, must have the wheel's sha256 and size; every pinned
   requirement must come from the wheelhouse, no other distribution or ``.pth`` file may
   appear. Only then is the tree digest of step 1 taken (once before the check and once
   after: they must agree). So the digest fingerprints what the host meant to install,
   not whatever a step the sandbox could influence left.

Every command of the machinery here runs through :func:`runtimes.machinery.run_machinery`
(as the sandbox's default user, cwd ``/``, a fixed system ``PATH``, no shell start-up
files, no pip configuration), and every Python it starts is isolated: ``python -I -m venv``,
``<venv>/bin/python -I -m pip install --isolated --no-input --no-cache-dir
--only-binary=:all:``, the version and platform probes under ``-I`` (``-I -S`` where no
site-packages are needed). The policy's working directory, a ``pip/``, ``venv/``,
``platform.py``, ``json.py``, ``sitecustomize.py`` or ``.pth`` it left there, a
``python3`` early on the image's ``PATH``, ``PYTHONPATH`` or ``PIP_*`` settings in the
image's environment: none of it is loaded. ``python`` in the config is searched in that
fixed ``PATH``; give an absolute path for an interpreter elsewhere. An agent launched
through :meth:`InstalledHarness.venv_entry` runs its console script under the venv's
``python -I -B -u`` too.

A run starts a :class:`~harnesses.proxy.ModelProxy` reachable from the sandbox
(:func:`~harnesses.proxy.route_to_host`), registers the run with a fresh secret, and
launches the agent with the proxy's URL and the secret as its OpenAI settings (and
``PYTHONDONTWRITEBYTECODE=1``, so running it does not change its tree). Every
model call lands on the trace; when the proxy refuses a turn for budget, the harness
stops the agent at once (the runtime kills its process tree) instead of waiting for the
agent's own retries. Wall time is a hard deadline on the agent process.

What the digest cannot cover: the sandbox's own interpreter and system libraries the
venv runs on, and the tools the check runs. An unprivileged policy cannot alter those;
a root policy could.
"""

from __future__ import annotations

import abc
import hashlib
import logging
import re
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import anyio
from pydantic import Field

from runtimes import (
    ExecResult,
    ExecTimeoutError,
    Runtime,
    SandboxError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from runtimes.machinery import isolated_python, run_machinery

from .base import Budget, BudgetClock, Harness, HarnessConfig, Trace
from .errors import HarnessConfigError, HarnessInstallError, ProxyRouteError
from .installed_scripts import (
    INSTALL_SCRIPT,
    MAKE_BASE,
    PYTHON_PROBE,
    TREE_DIGEST,
    VERSION_CHECK,
)
from .llm import Message, ModelEndpoint
from .proxy import ModelProxy, ProxyRoute, ProxyRun, route_to_host
from .wheel_check import verify_install
from .wheelhouse import SandboxPython, prepare_wheelhouse, wheelhouse_cache_dir

__all__ = [
    "AgentLaunch",
    "InstalledConfig",
    "InstalledHarness",
    "SandboxPython",
    "prepare_wheelhouse",
    "wheelhouse_cache_dir",
]

log = logging.getLogger("harnesses.installed")

_BUDGET_POLL = 0.2


class InstalledConfig(HarnessConfig):
    """Fields every installed harness understands.

    ``version`` pins the agent; ``extra_requirements`` pin dependencies next to it (each
    set of requirements gets its own venv). ``install_root`` is where agents live inside the sandbox
    (with the subprocess runtime that is the host's filesystem). ``wheelhouse`` is a
    host directory of wheels prepared beforehand (nothing is downloaded then);
    otherwise the host downloads one into its cache. ``proxy_route`` picks the runtime's
    route to the model proxy (``None``: its default, the channel relay where it has one;
    ``"gateway"``, ``"forward"``, ``"loopback"`` explicitly); ``proxy_url`` /
    ``proxy_bind_host`` override it (see :mod:`harnesses.proxy`).
    """

    version: str
    extra_requirements: list[str] = Field(
        default_factory=list, description="pins installed alongside, e.g. 'litellm==1.102.4'"
    )
    install_root: str = "/opt/vf-harness"
    python: str = "python3"
    wheelhouse: str | None = None
    install_timeout: float = Field(default=1800.0, gt=0)
    lock_timeout: float = Field(default=1800.0, gt=0)
    proxy_url: str | None = None
    proxy_bind_host: str | None = None
    proxy_route: Literal["channel", "loopback", "gateway", "forward"] | None = None
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    user: str | None = Field(
        default=None,
        description="the sandbox user the agent runs as (a rollout's policy: the sandbox's "
        "policy_user); installs always run as the sandbox's default user",
    )
    output_limit: int = Field(default=16 * 1024 * 1024, gt=0)


def _tail(data: bytes | str, limit: int = 3000) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


@dataclass(frozen=True)
class AgentLaunch:
    """How to start the agent: argv, environment, working directory, where its output is."""

    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None


@dataclass(frozen=True)
class _Install:
    """A venv this host process installed in one sandbox, and its tree digest then."""

    venv: str
    digest: str
    site: str  # site-packages, relative to the venv


# Per sandbox (the runtime object, held weakly): install key -> what this process installed.
_INSTALLS: weakref.WeakKeyDictionary[Runtime, dict[str, _Install]] = weakref.WeakKeyDictionary()
_LOCKS: weakref.WeakKeyDictionary[Runtime, dict[str, anyio.Lock]] = weakref.WeakKeyDictionary()


def _install_lock(runtime: Runtime, key: str) -> anyio.Lock:
    locks = _LOCKS.setdefault(runtime, {})
    if key not in locks:
        locks[key] = anyio.Lock()
    return locks[key]


class InstalledHarness(Harness):
    """Base of agents installed into the sandbox from a wheelhouse. See the module doc.

    Subclasses set ``package`` (the PyPI distribution), ``config_model`` (a subclass of
    :class:`InstalledConfig`) and implement :meth:`launch` and :meth:`collect`.
    """

    package: ClassVar[str]
    config_model: ClassVar[type[HarnessConfig]] = InstalledConfig

    def __init__(self, config: HarnessConfig | None = None):
        super().__init__(config)
        self.config: InstalledConfig
        self._venv: str | None = None
        self._site: str | None = None

    # ------------------------------------------------------------------ paths

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.config.version}"

    @property
    def requirements(self) -> list[str]:
        """The agent's pinned requirement followed by the extra pins."""
        return [self.requirement, *self.config.extra_requirements]

    @property
    def agent_dir(self) -> str:
        return f"{self.config.install_root}/{self.package}"

    @property
    def install_key(self) -> str:
        """What identifies one install: the pinned requirements, root and interpreter."""
        return "\n".join([self.config.install_root, self.config.python, *self.requirements])

    @property
    def venv(self) -> str:
        """The venv this harness last installed or verified (set by :meth:`setup`).

        Raises:
            HarnessConfigError: no venv was set up yet.
        """
        if self._venv is None:
            raise HarnessConfigError(f"{self.requirement} is not set up: call setup() first")
        return self._venv

    @property
    def site_packages(self) -> str:
        """The site-packages directory of :attr:`venv` (as verified by :meth:`setup`).

        Raises:
            HarnessConfigError: no venv was set up yet.
        """
        if self._site is None:
            raise HarnessConfigError(f"{self.requirement} is not set up: call setup() first")
        return f"{self.venv}/{self._site}"

    def venv_bin(self, program: str) -> str:
        return f"{self.venv}/bin/{program}"

    def venv_entry(self, script: str) -> list[str]:
        """The argv prefix that runs the venv's console script ``script`` under the venv's
        isolated Python (``-I``: nothing from the current directory, the user site or
        ``PYTHON*`` variables; ``-B``: no bytecode written into the verified tree; ``-u``:
        output as it is written, as ``PYTHONUNBUFFERED`` would, which ``-I`` ignores)."""
        return [self.venv_bin("python"), "-I", "-B", "-u", self.venv_bin(script)]

    # ------------------------------------------------------------------ install

    async def installed_version(self, runtime: Runtime) -> str | None:
        """The agent's version in the venv this process installed in ``runtime``, if that
        venv is still exactly as installed (tree digest); else ``None``.

        Raises:
            SandboxError: the sandbox failed (typed, from :mod:`runtimes.errors`).
        """
        known = await self._verified(runtime)
        if known is None:
            return None
        probe = await run_machinery(
            runtime,
            isolated_python(f"{known.venv}/bin/python", "-c", VERSION_CHECK, self.package),
            timeout=60,
        )
        return probe.stdout.strip() if probe.exit_code == 0 else None

    async def setup(self, runtime: Runtime | None) -> None:
        """Install the agent into ``runtime`` unless this process installed it there and
        its tree is unchanged. See the module doc.

        Idempotent; concurrent calls on one sandbox from this process install once.

        Raises:
            HarnessConfigError: ``runtime`` is ``None``.
            HarnessInstallError: the wheelhouse or the installation failed (with output).
            SandboxError: the sandbox failed (typed, from :mod:`runtimes.errors`).
        """
        sandbox = self._require_runtime(runtime)
        async with _install_lock(sandbox, self.install_key):
            known = await self._verified(sandbox)
            if known is None:
                known = await self._install(sandbox)
                _INSTALLS.setdefault(sandbox, {})[self.install_key] = known
            self._venv, self._site = known.venv, known.site

    async def _verified(self, runtime: Runtime) -> _Install | None:
        """The install this process made in ``runtime``, if its tree digest still matches."""
        known = _INSTALLS.get(runtime, {}).get(self.install_key)
        if known is None:
            return None
        digest = await self._tree_digest(runtime, known.venv)
        if digest == known.digest:
            return known
        log.warning(
            "%s: %s at %s changed since it was installed; installing afresh",
            runtime.describe(),
            self.requirement,
            known.venv,
        )
        _INSTALLS.get(runtime, {}).pop(self.install_key, None)
        return None

    async def _tree_digest(self, runtime: Runtime, venv: str) -> str | None:
        probe = await run_machinery(
            runtime,
            isolated_python(self.config.python, "-c", TREE_DIGEST, venv, site=False),
            timeout=600,
        )
        digest = probe.stdout.strip()
        if probe.exit_code != 0 or not re.fullmatch(r"[0-9a-f]{64}", digest):
            return None
        return digest

    async def _install(self, runtime: Runtime) -> _Install:
        tag = hashlib.sha256("\n".join(self.requirements).encode()).hexdigest()[:8]
        base = f"{self.agent_dir}/{self.config.version}-{tag}-{secrets.token_hex(8)}"
        venv = f"{base}/venv"
        made = await run_machinery(
            runtime,
            ["sh", "-c", MAKE_BASE, "vf-install", self.config.install_root, self.agent_dir, base],
        )
        if made.exit_code != 0:
            raise HarnessInstallError(f"cannot create {base}: {_tail(made.stderr)}")
        local, wheels = await self._upload_wheelhouse(runtime, f"{base}/wheelhouse")
        argv = ["sh", "-c", INSTALL_SCRIPT, "vf-install", self.agent_dir, base, venv, wheels]
        argv += [self.config.python, str(int(self.config.lock_timeout)), *self.requirements]
        try:
            result = await self._run_install(runtime, argv)
        except ExecTimeoutError as exc:
            raise HarnessInstallError(
                f"installing {self.requirement} took longer than {self.config.install_timeout}s: "
                f"{_tail(exc.stderr)}"
            ) from exc
        if result.exit_code != 0:
            raise HarnessInstallError(
                f"installing {self.requirement} into {runtime.describe()} failed "
                f"(exit {result.exit_code}): {_tail(result.stderr or result.stdout)}"
            )
        # The digest before and after the check against the wheels must agree: what the
        # check read is what the fingerprint pins.
        before = await self._tree_digest(runtime, venv)
        site = await verify_install(runtime, self.config.python, venv, local, self.requirements)
        digest = await self._tree_digest(runtime, venv)
        if digest is None or before is None:
            raise HarnessInstallError(
                f"cannot compute the tree digest of {venv} with {self.config.python!r}"
            )
        if digest != before:
            raise HarnessInstallError(f"{venv} changed while it was verified")
        log.info("%s: %s", runtime.describe(), result.stdout.strip())
        return _Install(venv, digest, site)

    async def sandbox_python(self, runtime: Runtime) -> SandboxPython:
        """The sandbox interpreter's version, machine and glibc.

        Raises:
            HarnessInstallError: ``python`` does not run in the sandbox.
            SandboxError: the sandbox failed.
        """
        try:
            probe = await run_machinery(
                runtime,
                isolated_python(self.config.python, "-c", PYTHON_PROBE, site=False),
                timeout=60,
            )
        except SandboxError as exc:
            if isinstance(exc, SandboxUnavailableError | SandboxTransportError):
                raise
            raise HarnessInstallError(
                f"{self.config.python!r} cannot run in {runtime.describe()}: {exc}"
            ) from exc
        fields = probe.stdout.split()
        if probe.exit_code != 0 or len(fields) != 3:
            raise HarnessInstallError(
                f"{self.config.python!r} in {runtime.describe()} did not report its version: "
                f"{_tail(probe.stderr or probe.stdout)}"
            )
        return SandboxPython(*fields)

    async def _run_install(self, runtime: Runtime, argv: list[str]) -> ExecResult:
        """Run the install script (venv + pip) as the machinery."""
        return await run_machinery(runtime, argv, timeout=self.config.install_timeout)

    async def _upload_wheelhouse(self, runtime: Runtime, remote: str) -> tuple[Path, str]:
        """Upload the wheelhouse to ``remote`` (inside the fresh install directory);
        return the host's directory and ``remote``."""
        if self.config.wheelhouse is not None:
            given = anyio.Path(self.config.wheelhouse)
            if not await given.is_dir():
                raise HarnessInstallError(f"wheelhouse {given} is not a directory")
            local = Path(await given.resolve())
        else:
            target = await self.sandbox_python(runtime)
            local = await prepare_wheelhouse(self.requirements, target)
        await runtime.upload(local, remote)
        return local, remote

    # ------------------------------------------------------------------ run

    @abc.abstractmethod
    def launch(
        self, task: str, *, base_url: str, api_key: str, run_dir: str, budget: Budget
    ) -> AgentLaunch:
        """The command that runs the agent on ``task`` against ``base_url`` with ``api_key``.

        ``run_dir`` is a fresh directory in the sandbox for this run's files.
        """

    @abc.abstractmethod
    async def collect(
        self, runtime: Runtime, run_dir: str, result: ExecResult | None, trace: Trace
    ) -> None:
        """Read the agent's results after it exited: set ``trace.output``/``metadata``.

        ``result`` is ``None`` when the agent was stopped (budget, time).
        """

    async def run(
        self,
        task: str | Sequence[Message],
        *,
        runtime: Runtime | None,
        model: ModelEndpoint,
        budget: Budget | None = None,
    ) -> Trace:
        """Install if needed, then run the agent in the sandbox with its model calls
        routed through the proxy. Budget, model, sandbox, install and agent failures
        are recorded on ``trace.error``.

        Raises:
            HarnessConfigError: an empty task, a task given as messages (installed
                agents take a string), or ``runtime`` is ``None``.
            ModelConfigError: the endpoint's API key variable is not set.
        """
        sandbox = self._require_runtime(runtime)
        text = _task_text(task)
        budget = budget or Budget()
        trace = self.new_trace(model)
        clock = BudgetClock(budget, trace)
        with anyio.move_on_after(clock.remaining_seconds()) as scope:
            try:
                await self.setup(sandbox)
                route = await route_to_host(
                    sandbox,
                    proxy_url=self.config.proxy_url,
                    bind_host=self.config.proxy_bind_host,
                    via=self.config.proxy_route,
                )
                with ModelProxy(host=route.bind_host) as proxy:
                    await self._run_agent(sandbox, text, route, proxy, model, budget, trace)
            except HarnessInstallError as exc:
                trace.fail("install_error", str(exc), exc)
            except ProxyRouteError as exc:
                trace.fail("sandbox_error", str(exc), exc)
            except SandboxError as exc:
                trace.fail("sandbox_error", f"{sandbox.describe()}: {exc}", exc)
        if scope.cancelled_caught:
            clock.record_time_out()
        return trace.finish()

    async def _run_agent(
        self,
        runtime: Runtime,
        task: str,
        route: ProxyRoute,
        proxy: ModelProxy,
        model: ModelEndpoint,
        budget: Budget,
        trace: Trace,
    ) -> None:
        run_dir = f"{self.agent_dir}/runs/{secrets.token_hex(8)}"
        made = await run_machinery(runtime, ["mkdir", "-p", "--", run_dir])
        if made.exit_code == 0 and self.config.user is not None:
            if self.config.user == runtime.policy_user:
                await runtime.prepare_policy_user()
            made = await run_machinery(runtime, ["chown", "--", f"{self.config.user}:", run_dir])
        if made.exit_code != 0:
            raise HarnessInstallError(f"cannot create the run directory {run_dir}: {made.stderr}")
        with proxy.open_run(model, trace, budget) as proxy_run:
            base_url = await route.sandbox_base_url(runtime, proxy)
            try:
                launch = self.launch(
                    task,
                    base_url=base_url,
                    api_key=proxy_run.secret,
                    run_dir=run_dir,
                    budget=budget,
                )
                result = await self._exec_watching_budget(runtime, launch, proxy_run)
                lost = route.lost()
            finally:
                with anyio.CancelScope(shield=True):
                    await route.release(runtime)
        if lost is not None and trace.error is None:
            # The agent's model calls could not reach the proxy any more: that is the cause,
            # whatever the agent made of its connection errors.
            trace.fail("sandbox_error", f"the route to the model proxy ({route.via}) died: {lost}")
        if result is not None and result.exit_code != 0 and trace.error is None:
            self._record_agent_failure(result, trace)
        await self.collect(runtime, run_dir, result, trace)

    async def _exec_watching_budget(
        self, runtime: Runtime, launch: AgentLaunch, proxy_run: ProxyRun
    ) -> ExecResult | None:
        """Run the agent; stop it as soon as the proxy refused a turn for budget."""
        outcome: list[ExecResult] = []
        failure: list[SandboxError] = []
        async with anyio.create_task_group() as group:

            async def agent() -> None:
                try:
                    outcome.append(
                        await runtime.exec(
                            launch.argv,
                            env={
                                "PYTHONDONTWRITEBYTECODE": "1",
                                **launch.env,
                                **self.config.env,
                            },
                            cwd=launch.cwd or self.config.cwd,
                            user=self.config.user,
                            output_limit=self.config.output_limit,
                        )
                    )
                except SandboxError as exc:  # re-raised below, outside the task group
                    failure.append(exc)
                group.cancel_scope.cancel()

            async def watch_budget() -> None:
                # The proxy records a refusal from its own thread: poll the flag.
                while proxy_run.trace.error is None:  # noqa: ASYNC110
                    await anyio.sleep(_BUDGET_POLL)
                group.cancel_scope.cancel()

            group.start_soon(agent)
            group.start_soon(watch_budget)
        if failure:
            raise failure[0]
        return outcome[0] if outcome else None

    @staticmethod
    def _record_agent_failure(result: ExecResult, trace: Trace) -> None:
        last = trace.turns[-1] if trace.turns else None
        if last is not None and last.status_code is not None and last.status_code >= 400:
            trace.fail(
                "model_error",
                f"the agent stopped after the model answered HTTP {last.status_code}: "
                f"{last.error or ''}",
                status_code=last.status_code,
            )
            return
        trace.fail(
            "agent_error",
            f"the agent exited with code {result.exit_code}: "
            f"{_tail(result.stderr or result.stdout)}",
        )


def _task_text(task: str | Sequence[Message]) -> str:
    if not isinstance(task, str):
        raise HarnessConfigError("installed agents take the task as a string, not messages")
    if not task.strip():
        raise HarnessConfigError("the task is empty")
    return task
