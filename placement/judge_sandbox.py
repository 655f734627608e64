"""What a judge gets in the sandbox it is placed in: its own account and who runs each of its
commands, where its inputs are, and the cleanup of its inputs dir.

Where the runtime has a judges' account (:attr:`~runtimes.base.Runtime.judge_user`), a
judge's commands that write its verdict run as that account and every other command as the
policy's (:func:`command_user`): nothing a judge runs gets more than the policy had
(``docs/security.md``, "Judges' own account").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import anyio

from harnesses.base import HarnessConfig
from runtimes import Runtime, SandboxError, SandboxSnapshot, open_runtime, remove_snapshot

from .errors import PlacementConfigError
from .guard import VerdictGuard
from .inputs import VERDICT_FILE

log = logging.getLogger("placement.run")

__all__ = [
    "CLEANUP_SECONDS",
    "INPUTS_ENV",
    "VERDICT_ENV",
    "InputsCleanup",
    "command_user",
    "drop_fork",
    "judge_account",
    "open_fork",
    "remove_inputs",
    "take_fork",
    "with_input_env",
]

CLEANUP_SECONDS = 30.0
"""How long the shielded cleanup of a cancelled or failed judge (stopping its processes,
removing its inputs dir) may take before it is abandoned."""


def command_user(
    guard: VerdictGuard, judge_user: str | None, policy_user: str | None
) -> Callable[[str], str | None]:
    """Who runs each command of a judge with an account of its own: the commands that
    write its verdict (they name it, :meth:`VerdictGuard.names_verdict`) run as the judge's
    account, every other command — the policy's programs it runs among them — as the
    policy's account, with exactly the rights the policy had: it can change the world the
    policy left (build, run tests), never reach the judge's inputs dir or the verdict."""

    def user_for(command: str) -> str | None:
        return judge_user if guard.names_verdict(command) else policy_user

    return user_for


async def judge_account(runtime: Runtime) -> tuple[int, int] | None:
    """Make the judges' own account (:attr:`~runtimes.base.Runtime.judge_user`) and return
    its uid and gid, read from the sandbox's ``/etc/passwd`` (a file the policy's account
    cannot write); ``None`` where the runtime has no such account.

    Raises:
        ProvisioningError: the account could not be made.
        PlacementConfigError: ``/etc/passwd`` does not list it after it was made.
        SandboxError: the sandbox failed.
    """
    name = await runtime.prepare_judge_user()
    if name is None:
        return None
    passwd = await runtime.read("/etc/passwd", max_bytes=4 << 20)
    for line in passwd.decode("utf-8", "replace").splitlines():
        fields = line.split(":")
        if len(fields) >= 4 and fields[0] == name and fields[2].isdigit() and fields[3].isdigit():
            return int(fields[2]), int(fields[3])
    raise PlacementConfigError(f"the judges' account {name!r} is not in /etc/passwd")


INPUTS_ENV = "VF_AGENT_INPUTS"
VERDICT_ENV = "VF_AGENT_VERDICT"


def with_input_env(config: HarnessConfig, inputs_dir: str | None) -> HarnessConfig:
    """Tell a tools harness where its inputs are: as shell variables its commands have
    but the programs they run do not inherit (``shell_vars``, the ``bash`` harness), or
    else through its commands' environment (``env``, installed agents)."""
    fields = type(config).model_fields
    if inputs_dir is None:
        return config
    values = {INPUTS_ENV: inputs_dir, VERDICT_ENV: f"{inputs_dir}/{VERDICT_FILE}"}
    for field in ("shell_vars", "env"):
        if field in fields:
            merged = {**(getattr(config, field, {}) or {}), **values}
            return config.model_copy(update={field: merged})
    return config


@dataclass(frozen=True)
class InputsCleanup:
    """Exit callback of one agent's inputs dir: removes it, and when the agent ended by an
    exception (a failure or a cancellation) in a rollout's sandbox, first stops what it
    left running. Shielded from cancellation and bounded by :data:`CLEANUP_SECONDS`."""

    runtime: Runtime
    inputs_dir: str
    sweep: bool

    async def __call__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        with anyio.move_on_after(CLEANUP_SECONDS, shield=True):
            if self.sweep and exc is not None and not self.runtime.closed:
                with contextlib.suppress(SandboxError):  # lost: the caller reports it
                    await self.runtime.stop_processes()
            await remove_inputs(self.runtime, self.inputs_dir)
        return False


async def remove_inputs(runtime: Runtime, inputs_dir: str) -> None:
    if not runtime.closed:
        with contextlib.suppress(SandboxError):  # the sandbox is gone; nothing to remove
            await runtime.remove(inputs_dir, missing_ok=True)


def open_fork(runtime: Runtime | None, fork: SandboxSnapshot | None) -> Runtime:
    """A sandbox of the rollout's config started from ``fork`` (not yet started)."""
    if runtime is None or fork is None:
        raise PlacementConfigError("a fork-placed agent needs the rollout's runtime and snapshot")
    return open_runtime(runtime.config, snapshot=fork)


async def take_fork(runtime: Runtime) -> SandboxSnapshot:
    """The one snapshot every fork-placed judge of a rollout starts from: the rollout's files
    as the policy left them, before any judge ran (processes are never part of it)."""
    return await runtime.snapshot()


async def drop_fork(fork: SandboxSnapshot) -> None:
    try:
        await remove_snapshot(fork)
    except SandboxError as exc:
        log.warning(
            "removing %s failed (%s); `vf-sandbox cleanup` removes it once this process ends",
            fork.describe(),
            exc,
        )
