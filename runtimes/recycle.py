"""Recycling a used sandbox for the next acquirer of a pool, with a proof that it is clean
(``RuntimePool(..., recycle=True)``; ``docs/pools.md``, Recycling).

A reset is not trusted on its word. Right after a pooled sandbox started (the policy's
account made and handed the workdir), :func:`take_baseline` records what a next user
could see: the processes, the System V IPC objects, every socket the kernel lists or counts, the
mount table, every entry of every writable place (owner, mode, size, SHA-256, extended
attributes) and what the host sees of the root file system without running anything in
the sandbox (:meth:`~runtimes.capabilities.ResetProof.outside_view`: Docker's engine diff).
:func:`reset` ends every use (:meth:`~runtimes.composed.BackendRuntime.end_uses`: sessions,
background runs, relays, then every process but the runtime's agent), empties every
writable place and removes every IPC object (``scripts/recycle_probe.py``, as root, from
``/``, ``python3 -I -S``, the machinery's ``PATH``), puts back the world the baseline had,
then takes the same survey again and compares: any difference, or anything that could not
be read, raises :class:`SandboxResetError`, and the pool destroys the sandbox instead.

Only a backend that is a :class:`~runtimes.capabilities.ResetProof` and says its config can
be proven (:meth:`~runtimes.capabilities.ResetProof.recycle_refusal`) is recycled: on
Docker, a read-only root file system, an unprivileged policy account, no writable mount, no
network. Everything else a process could change is either on the read-only root (the
engine's diff proves it unchanged) or root's, and only the host's machinery runs as root.
"""

from __future__ import annotations

import collections
import logging
import weakref
from dataclasses import dataclass, field
from importlib import resources

import anyio
from pydantic import BaseModel, ConfigDict, ValidationError

from .base import Runtime
from .capabilities import ResetProof
from .composed import BackendRuntime
from .errors import SandboxError
from .machinery import isolated_python, run_machinery

__all__ = [
    "DEFAULT_AUDIT_EVERY",
    "MAX_WORLD_BYTES",
    "Baseline",
    "Recycler",
    "SandboxResetError",
    "Survey",
    "recycle_refusal",
    "reset",
    "take_baseline",
]

log = logging.getLogger("runtimes.pool")

PROBE = resources.files("runtimes.scripts").joinpath("recycle_probe.py").read_text("utf-8")
"""The program the reset and the survey run in the sandbox (read, never imported here)."""

PROBE_TIMEOUT = 120.0
PROBE_OUTPUT_LIMIT = 16 << 20
MAX_WORLD_BYTES = 64 << 20
"""The most a pooled sandbox's writable places may hold at start (its prepared world, kept
on the host as an archive to put back at each reset); a larger one is not recycled."""


DEFAULT_AUDIT_EVERY = 32
"""How often a reset also reads :meth:`~runtimes.capabilities.ResetProof.outside_view`
(every Nth reset of a sandbox; 1: every reset), besides the baseline's."""


class SandboxResetError(SandboxError):
    """A used sandbox could not be proven back to its state after start: it is destroyed,
    never handed to another acquirer."""


class Survey(BaseModel):
    """What a next user of the sandbox could see (``scripts/recycle_probe.py``'s report)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stray: list[tuple[int, str]]
    watched: dict[str, list[tuple[str, int, int, int, int]]]
    ipc: dict[str, list[str]]
    net: dict[str, list[str]]
    mounts: list[str]
    places: dict[str, list[tuple[str, int, int, int, int, int, str, list[str]]]]
    truncated: bool
    errors: list[str]

    def differences(self, other: Survey) -> list[str]:
        """What differs from ``other`` (the baseline), in words; empty: nothing."""
        found = [f"{len(self.stray)} processes left: {self.stray[:5]}"] if self.stray else []
        found += [f"could not survey: {error}" for error in self.errors[:5]]
        if self.truncated:
            found.append("a writable place holds more entries than the survey lists")
        for kind in sorted(set(self.ipc) | set(other.ipc)):
            if self.ipc.get(kind) != other.ipc.get(kind):
                found.append(f"System V IPC {kind}: {self.ipc.get(kind, [])[:3]}")
        for table in sorted(set(self.net) | set(other.net)):
            if self.net.get(table) != other.net.get(table):
                found.append(f"sockets ({table}): {self.net.get(table, [])[:3]}")
        for place in sorted(set(self.watched) | set(other.watched)):
            now_names = {e[0]: e for e in self.watched.get(place, [])}
            then_names = {e[0]: e for e in other.watched.get(place, [])}
            if now_names != then_names:
                changed = sorted(
                    n
                    for n in set(now_names) | set(then_names)
                    if now_names.get(n) != then_names.get(n)
                )
                found.append(f"{place} (root's): {changed[:3]}")
        if self.mounts != other.mounts:
            found.append(f"mounts: {sorted(set(self.mounts) ^ set(other.mounts))[:3]}")
        for place in sorted(set(self.places) | set(other.places)):
            now, then = self.places.get(place, []), other.places.get(place, [])
            if now != then:
                changed = sorted({e[0] for e in now} ^ {e[0] for e in then}) or [
                    a[0] for a, b in zip(now, then, strict=False) if a != b
                ]
                found.append(f"{place}: {changed[:3]}")
        return found


@dataclass(frozen=True)
class Baseline:
    """A pooled sandbox's state right after start, which each reset must prove again."""

    survey: Survey
    view: tuple[str, ...]
    """:meth:`~runtimes.capabilities.ResetProof.outside_view` then."""
    world: dict[str, bytes] = field(default_factory=dict)
    """The places that held something at start: a tar of each, put back at each reset."""

    def owners(self) -> dict[str, list[int]]:
        """Each place's ``[mode, uid, gid]`` at start."""
        return {
            place: [entries[0][2], entries[0][3], entries[0][4]]
            for place, entries in self.survey.places.items()
        }


def recycle_refusal(runtime: Runtime) -> str | None:
    """Why ``runtime``'s sandboxes cannot be proven clean after use, or ``None``. Looks at
    the config only: an unstarted runtime is enough."""
    if not isinstance(runtime, BackendRuntime) or not isinstance(runtime.backend, ResetProof):
        return (
            f"the {runtime.config.type} backend cannot prove a used sandbox clean (its "
            "writable surface is not fully known): its sandboxes are never recycled"
        )
    return runtime.backend.recycle_refusal()


async def take_baseline(runtime: Runtime) -> Baseline:
    """Record a started sandbox's state, before anyone uses it (the policy's account is
    made first, as its first command would).

    Raises:
        SandboxResetError: the state cannot serve as a baseline (processes outside the
            runtime's, a place too full or unreadable), or the survey failed.
    """
    backend = _proof(runtime)
    try:
        await runtime.prepare_policy_user()
        survey = await _probe(runtime, "survey")
        view = tuple(await backend.outside_view())
        world = {
            place: await _archive(runtime, place)
            for place, entries in survey.places.items()
            if len(entries) > 1
        }
    except SandboxError as exc:
        raise SandboxResetError(f"{runtime.describe()}: no baseline: {exc}") from exc
    problems = survey.differences(survey)  # compared with itself: strays, errors, size
    if problems:
        raise SandboxResetError(f"{runtime.describe()}: no baseline: {'; '.join(problems)}")
    return Baseline(survey, view, world)


async def reset(runtime: Runtime, baseline: Baseline, *, outside: bool = True) -> None:
    """End every use of ``runtime``'s sandbox, empty it back to ``baseline`` and prove it;
    ``outside``: also compare what the host sees of it (Docker: the engine's diff).

    Raises:
        SandboxResetError: anything differs from the baseline, or a step failed: the
            sandbox must be destroyed (it may hold anything).
    """
    backend = _proof(runtime)
    assert isinstance(runtime, BackendRuntime)
    channel = runtime.channel_info
    if channel.state == "distrusted":  # the policy spoke for it, or replaced its agent
        raise SandboxResetError(f"{runtime.describe()}: its channel is distrusted: {channel}")
    try:
        await runtime.end_uses()
        survey = await _probe(runtime, "reset", baseline.owners())
        if baseline.world:
            for place, archive in baseline.world.items():
                await _unpack(runtime, place, archive)
            survey = await _probe(runtime, "survey")
        view = tuple(await backend.outside_view()) if outside else baseline.view
    except SandboxError as exc:
        raise SandboxResetError(f"{runtime.describe()}: the reset failed: {exc}") from exc
    found = survey.differences(baseline.survey)
    if view != baseline.view:
        found.append(f"root file system: {sorted(set(view) ^ set(baseline.view))[:3]}")
    if found:
        raise SandboxResetError(f"{runtime.describe()} is not clean: {'; '.join(found)}")


def _proof(runtime: Runtime) -> ResetProof:
    refusal = recycle_refusal(runtime)
    if refusal is not None:
        raise SandboxResetError(f"{runtime.describe()} cannot be recycled: {refusal}")
    assert isinstance(runtime, BackendRuntime) and isinstance(runtime.backend, ResetProof)
    return runtime.backend


async def _probe(runtime: Runtime, mode: str, owners: dict[str, list[int]] | None = None) -> Survey:
    """Run the probe as the sandbox's default user (root) and validate its report.

    Raises:
        SandboxResetError: it failed or reported something malformed.
        SandboxError: the sandbox failed.
    """
    proof = _proof(runtime)
    places = proof.wiped_places()
    agent = runtime.channel_info.agent_pid or 0
    owners = owners or {place: [0, 0, 0] for place in places}
    argv = isolated_python("python3", "-c", PROBE, mode, str(agent), site=False)
    argv += [f"{place}={':'.join(str(n) for n in owners[place])}" for place in places]
    argv += [f"+{place}" for place in proof.watched_places()]
    result = await run_machinery(
        runtime, argv, timeout=PROBE_TIMEOUT, output_limit=PROBE_OUTPUT_LIMIT
    )
    if result.exit_code != 0:
        raise SandboxResetError(
            f"{runtime.describe()}: the {mode} probe exited {result.exit_code}: "
            f"{result.stderr.strip()[-500:]}"
        )
    try:
        return Survey.model_validate_json(result.stdout_bytes)
    except ValidationError as exc:
        raise SandboxResetError(f"{runtime.describe()}: the {mode} probe's report: {exc}") from None


async def _archive(runtime: Runtime, place: str) -> bytes:
    """A tar of what ``place`` holds (numeric owners, modes, links as links).

    Raises:
        SandboxResetError: tar failed, or the world is over :data:`MAX_WORLD_BYTES`.
    """
    argv = ["tar", "-cf", "-", "--numeric-owner", "--xattrs", "-C", place, "."]
    result = await run_machinery(runtime, argv, timeout=PROBE_TIMEOUT, output_limit=MAX_WORLD_BYTES)
    if result.exit_code != 0:
        raise SandboxResetError(f"{runtime.describe()}: tar of {place}: {result.stderr.strip()}")
    return result.stdout_bytes


async def _unpack(runtime: Runtime, place: str, archive: bytes) -> None:
    """Put ``archive`` (the host's own, from :func:`_archive`) back into the emptied place.

    Raises:
        SandboxResetError: tar failed.
    """
    argv = ["tar", "-xpf", "-", "--numeric-owner", "--xattrs", "-C", place]
    result = await run_machinery(runtime, argv, timeout=PROBE_TIMEOUT, stdin=archive)
    if result.exit_code != 0:
        raise SandboxResetError(f"{runtime.describe()}: untar in {place}: {result.stderr.strip()}")


class Recycler:
    """A pool's recycling: the baseline of every sandbox it made, the resets, and what they
    cost. A sandbox is recycled only through :meth:`restore`, which destroys it instead
    when it cannot be proven clean."""

    def __init__(self, audit_every: int = DEFAULT_AUDIT_EVERY) -> None:
        self.audit_every = audit_every
        self.recycled = 0
        """Resets proven clean (each handed the sandbox to another acquirer)."""
        self.discarded = 0
        """Sandboxes destroyed because a reset could not prove them clean."""
        self.reset_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        """How long each proven reset took, release to back in stock (the last 4096)."""
        self._baselines: weakref.WeakKeyDictionary[Runtime, Baseline] = weakref.WeakKeyDictionary()
        self._resets: weakref.WeakKeyDictionary[Runtime, int] = weakref.WeakKeyDictionary()

    async def admit(self, runtime: Runtime) -> None:
        """Record a new sandbox's baseline (before anyone uses it).

        Raises:
            SandboxResetError: it cannot be recycled (as :func:`take_baseline`).
        """
        self._baselines[runtime] = await take_baseline(runtime)

    def knows(self, runtime: Runtime) -> bool:
        return runtime in self._baselines

    async def restore(self, runtime: Runtime) -> bool:
        """Reset a released sandbox; ``True``: proven clean, ready for the next acquirer;
        ``False``: it was destroyed instead (logged at INFO with the reason; a failed
        removal at WARNING). Cancelled, it destroys the sandbox before the cancellation
        goes on. Never raises but cancellation."""
        baseline = self._baselines.get(runtime)
        count = self._resets.get(runtime, 0) + 1
        started = anyio.current_time()
        try:
            if baseline is None or runtime.closed:
                raise SandboxResetError(f"{runtime.describe()} has no baseline or is closed")
            await reset(runtime, baseline, outside=count % self.audit_every == 0)
        except SandboxResetError as exc:
            log.info("%s: destroyed, not recycled: %s", runtime.describe(), exc)
            self.discarded += 1
            await _destroy(runtime)
            return False
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _destroy(runtime)
            raise
        self._resets[runtime] = count
        self.recycled += 1
        self.reset_seconds.append(anyio.current_time() - started)
        return True


async def _destroy(runtime: Runtime) -> None:
    try:
        await runtime.close()
    except SandboxError as exc:
        log.warning(
            "closing %s failed: %s; `vf-sandbox cleanup` removes it once this process has exited",
            runtime.describe(),
            exc,
        )
