"""Keeping a judge's verdict its own, in a sandbox a policy may have left hostile.

A :class:`VerdictGuard` watches ``<inputs dir>/verdict.json`` of one file-verdict judge:

- **Sweeps.** :meth:`VerdictGuard.after_command` and :meth:`VerdictGuard.collect` first
  call ``runtime.stop_processes()``: nothing a command started (the policy's program the
  judge ran, a writer it forked, the judge's own background jobs) outlives that command,
  and nothing is alive when the verdict is read. Harnesses that run the judge's commands
  one by one call the hook after each (:meth:`harnesses.base.Harness.add_command_hook`,
  the ``bash`` harness); an installed agent runs as one process, swept when it ended.
- **Provenance.** After each command (and its sweep) the guard records what
  ``verdict.json`` is (absent, a regular file with its link count, owner and content
  digest, a symlink, ...). A change made by a command that does not name the verdict
  (``$VF_AGENT_VERDICT``, ``$VF_AGENT_INPUTS``, ``verdict.json`` or the inputs dir) was
  not the judge's doing: it was the program the judge ran, so the verdict is refused as
  :class:`~placement.errors.JudgeInputsTampered`. So is any change after the judge's last
  command (something escaped a sweep).
- **Kind.** The verdict read is a regular file with one link, owned by the uid that owns
  the judge's inputs dir, checked without following links; a symlink, a hard link or a
  foreign owner not of the judge's own making is ``JudgeInputsTampered``; one the judge
  itself made is :class:`~placement.errors.VerdictInvalid` (a dangling symlink:
  :class:`~placement.errors.VerdictMissing`).

The checks are :meth:`~runtimes.base.Runtime.lstat` calls, which the channel agent serves
from its own process (started before the policy ran, from an interpreter the host verified):
no program of the sandbox — ``sh``, ``stat``, ``head``, which a root policy may have
replaced — answers for the verdict. Without a channel they fall back to those programs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from harnesses.base import ToolResult, Trace
from runtimes import (
    OutputLimitExceededError,
    Runtime,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxPermissionError,
)

from .errors import JudgeInputsTampered, VerdictInvalid, VerdictMissing
from .inputs import VERDICT_FILE

__all__ = ["VERDICT_NAMES", "VerdictGuard", "VerdictState"]

# Words by which a judge's command names its verdict.
VERDICT_NAMES = ("VF_AGENT_VERDICT", "VF_AGENT_INPUTS", VERDICT_FILE)


@dataclass(frozen=True)
class VerdictState:
    """What ``verdict.json`` was at one moment, seen without following links."""

    kind: str  # file, absent, symlink, dangling, directory, special, replaced (the dir)
    dir_owner: str
    links: str
    owner: str
    size: str
    digest: str
    content: bytes

    def describe(self) -> str:
        if self.kind == "file":
            return f"a file ({self.size} bytes, {self.links} links, owner uid {self.owner})"
        if self.kind == "replaced":
            return "gone: the inputs dir was replaced"
        return f"a {self.kind}"


class VerdictGuard:
    """Sweeps, attributes and checks one judge's ``verdict.json``. See the module doc."""

    def __init__(
        self,
        runtime: Runtime,
        inputs_dir: str,
        judge: str,
        max_bytes: int,
        *,
        writer: int | None = None,
    ):
        """``writer``: the uid the judge's verdict must belong to (the judges' own account);
        ``None``: the owner of the inputs dir (the judge runs as the machinery's user)."""
        self.runtime = runtime
        self._writer = None if writer is None else str(writer)
        self.inputs_dir = inputs_dir
        self.path = f"{inputs_dir}/{VERDICT_FILE}"
        self.judge = judge
        self.max_bytes = max_bytes
        self.tracking = False  # True once a harness calls after_command for each command
        self._state: VerdictState | None = None
        self._owner: str | None = None
        self._by_judge = True  # who made the last change: the judge (naming it) or not
        self._changed_by: str | None = None
        self._failure: str | None = None

    async def start(self) -> None:
        """Record the fresh inputs dir's owner and that no verdict is there yet.

        Raises:
            JudgeInputsTampered: a verdict or a replaced dir is already there.
            SandboxError: the sandbox failed.
        """
        try:
            state = await self._probe()
        except _ProbeFailed as exc:
            raise JudgeInputsTampered(self.judge, str(exc)) from None
        if state.kind != "absent":
            raise JudgeInputsTampered(self.judge, f"{self.path} is {state.describe()} already")
        self._owner = state.dir_owner
        self._writer = self._writer or state.dir_owner
        self._state = state

    def names_verdict(self, command: str) -> bool:
        """Whether ``command`` names the verdict (so a change it makes is the judge's)."""
        return any(word in command for word in (*VERDICT_NAMES, self.inputs_dir))

    async def after_command(self, runtime: Runtime, command: str, result: ToolResult) -> None:
        """Stop what the command left running, then attribute any change to the verdict.

        Raises:
            SandboxError: the sweep or the probe failed.
        """
        del runtime, result  # the guard's own runtime is the one the harness ran on
        self.tracking = True
        await self.runtime.stop_processes()
        try:
            state = await self._probe()
        except _ProbeFailed as exc:  # raised at collection, with the trace
            self._failure = self._failure or str(exc)
            return
        if state != self._state:
            self._state = state
            self._by_judge = self.names_verdict(command)
            self._changed_by = command

    async def collect(self, trace: Trace | None) -> bytes:
        """Sweep, then read the verdict's bytes if it is the judge's own regular file.

        Raises:
            JudgeInputsTampered: the verdict (or its dir) was changed by something other
                than the judge's commands, or is a link or foreign file it did not make.
            VerdictMissing: no verdict (or the judge's own dangling symlink).
            VerdictInvalid: not a regular file of the judge's making, or too large.
            SandboxError: the sandbox failed (the caller reports the judge's sandbox lost).
        """
        await self.runtime.stop_processes()
        if self._failure is not None:
            raise JudgeInputsTampered(self.judge, self._failure, trace)
        try:
            state = await self._probe()
        except _ProbeFailed as exc:
            raise JudgeInputsTampered(self.judge, str(exc), trace) from None
        if self.tracking and state != self._state:
            raise JudgeInputsTampered(
                self.judge,
                f"{self.path} changed after the judge's last command (now {state.describe()})",
                trace,
            )
        if self.tracking and not self._by_judge:
            raise JudgeInputsTampered(
                self.judge,
                f"{self.path} was last changed by a command that does not name it (the "
                f"program it ran, not the judge): {_clip(self._changed_by or '')!r}",
                trace,
            )
        return await self._verdict_bytes(state, trace, judges_own=self.tracking)

    async def _confirm_missing(self, trace: Trace | None) -> None:
        """Raise VerdictMissing from the runtime's own typed missing-file error."""
        try:
            await self.runtime.read(self.path, max_bytes=0)
        except SandboxFileNotFoundError as exc:
            message = f"no verdict was written to {self.path}"
            raise VerdictMissing(self.judge, message, trace) from exc
        except (OutputLimitExceededError, SandboxPermissionError, SandboxIsADirectoryError):
            pass
        raise JudgeInputsTampered(self.judge, f"{self.path} appeared while collecting it", trace)

    async def _verdict_bytes(
        self, state: VerdictState, trace: Trace | None, *, judges_own: bool
    ) -> bytes:
        """The content of a verdict that is the judge's regular file; else the typed refusal.

        ``judges_own``: the last change is known to be the judge's (a link it made itself
        is its mistake, not a forgery); without that knowledge every link is a forgery.
        """
        foreign = state.kind == "replaced" or state.dir_owner != self._owner
        if foreign:
            raise JudgeInputsTampered(self.judge, f"{self.inputs_dir} was replaced", trace)
        if state.kind == "absent":
            await self._confirm_missing(trace)
        linked = state.kind in ("symlink", "dangling") or (
            state.kind == "file" and state.links != "1"
        )
        if linked and not judges_own:
            raise JudgeInputsTampered(
                self.judge, f"{self.path} is {state.describe()}, not a plain file", trace
            )
        if state.kind == "dangling":
            raise VerdictMissing(self.judge, f"{self.path} is a dangling symlink", trace)
        if state.kind != "file":
            raise VerdictInvalid(
                self.judge, f"{self.path} is not a readable regular file: {state.kind}", trace
            )
        if state.owner != self._writer:
            raise JudgeInputsTampered(
                self.judge,
                f"{self.path} is owned by uid {state.owner}, not the judge's uid {self._writer}",
                trace,
            )
        if state.links != "1":
            raise VerdictInvalid(
                self.judge, f"{self.path} has {state.links} hard links, not 1", trace
            )
        if len(state.content) > self.max_bytes:
            raise VerdictInvalid(
                self.judge, f"{self.path} is larger than {self.max_bytes} bytes", trace
            )
        return state.content

    async def _probe(self) -> VerdictState:
        """What the verdict is now, from ``lstat`` of the inputs dir and of the verdict
        (served by the channel agent where there is one: no ``sh``, ``stat`` or ``head``
        of the sandbox answers for it, so a root policy that replaced them cannot)."""
        try:
            folder = await self.runtime.lstat(self.inputs_dir)
            if folder.kind != "directory":
                return VerdictState("replaced", "-", "-", "-", "-", _EMPTY, b"")
            info = await self.runtime.lstat(self.path, content_limit=self.max_bytes)
        except (SandboxPermissionError, SandboxInvalidArgumentError) as exc:
            raise _ProbeFailed(f"cannot inspect {self.path}: {exc}") from None
        owner = str(folder.uid)
        kind = {"other": "special"}.get(info.kind, info.kind)
        if kind == "symlink":
            if not await self._resolves():
                kind = "dangling"
            target = info.target.encode("utf-8", "surrogateescape")[:4096]
            return VerdictState(kind, owner, "-", "-", "-", _EMPTY, target)
        if kind != "file":
            return VerdictState(kind, owner, "-", "-", "-", _EMPTY, b"")
        digest = hashlib.sha256(info.content).hexdigest()
        return VerdictState(
            "file", owner, str(info.links), str(info.uid), str(info.size), digest, info.content
        )

    async def _resolves(self) -> bool:
        """Whether the verdict's symlink leads to something (nothing of it is read: a cap of
        0 bytes; a directory, a FIFO or an unreadable file there still resolves).

        Raises:
            SandboxError: the sandbox failed.
        """
        try:
            await self.runtime.read(self.path, max_bytes=0)
        except SandboxFileNotFoundError:
            return False
        except (
            OutputLimitExceededError,
            SandboxPermissionError,
            SandboxIsADirectoryError,
            SandboxInvalidArgumentError,
        ):
            return True
        return True


_EMPTY = hashlib.sha256(b"").hexdigest()


class _ProbeFailed(Exception):
    """The verdict could not be inspected (the sandbox's tools misbehaved)."""


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
