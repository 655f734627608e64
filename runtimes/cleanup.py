"""Sweeping leaked sandboxes: what ``vf-sandbox cleanup`` runs.

A sandbox is swept when its labels say the session that created it is dead (its
process is gone from this host), or unconditionally with ``all_sessions=True``, or when
it is older than ``older_than`` seconds. Sandboxes of live sessions, and of sessions on
other hosts whose liveness cannot be checked from here, are left alone by default. A
sandbox kept on purpose (``keep=True``, :func:`runtimes.ownership.is_kept`) is left alone
whatever its session or age, unless ``kept=True`` (``cleanup --kept``) or ``all_sessions``.

Snapshots (:mod:`runtimes.snapshot`) are swept by the same rules, after each backend's
sandboxes (a Docker snapshot's image cannot go while a fork's container uses it);
:func:`remove_snapshot` removes one by hand.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from . import ownership
from .base import Runtime
from .config import RuntimeConfig
from .errors import SandboxError, SandboxInvalidArgumentError
from .models import SandboxInfo
from .registry import available_runtimes, load_runtime_class, resolve_runtime_config
from .snapshot import SandboxSnapshot, held_config, release

log = logging.getLogger("runtimes.cleanup")

NOT_LISTABLE = (
    "the backend does not implement list_sandboxes: its sandboxes cannot be listed or swept"
)


def lists_sandboxes(cls: type[Runtime]) -> bool:
    """Whether a backend overrides :meth:`Runtime.list_sandboxes` (the base's finds nothing,
    which must not read as "no sandboxes")."""
    return getattr(cls.list_sandboxes, "__func__", None) is not getattr(
        Runtime.list_sandboxes, "__func__", None
    )


async def list_target(
    target: str | RuntimeConfig,
) -> tuple[type[Runtime], RuntimeConfig | None, list[SandboxInfo]]:
    """The backend class of ``target`` (a type name or a config), the config to list it
    with (``None``: its default place) and its labelled sandboxes.

    Raises:
        SandboxError: the backend cannot be loaded or reached, or cannot list at all
            (:data:`NOT_LISTABLE`): never an empty list that would read as "nothing leaked".
    """
    cls, config = target_class(target)
    return cls, config, await cls.list_sandboxes(config)


def target_class(target: str | RuntimeConfig) -> tuple[type[Runtime], RuntimeConfig | None]:
    """The backend class of ``target`` (a type name or a config) and the config to list it
    with (``None``: its default place).

    Raises:
        SandboxError: the backend cannot be loaded, or cannot list (:data:`NOT_LISTABLE`).
    """
    config = None if isinstance(target, str) else target
    cls = load_runtime_class(target if isinstance(target, str) else target.type)
    if not lists_sandboxes(cls):
        raise SandboxError(NOT_LISTABLE)
    return cls, config


def snapshot_info(snapshot: SandboxSnapshot) -> SandboxInfo:
    """A snapshot as a sweep reports it."""
    return SandboxInfo(
        backend=snapshot.backend,
        id=snapshot.id,
        labels=snapshot.labels,
        state="snapshot",
        created=snapshot.created,
    )


@dataclass(frozen=True)
class SweepResult:
    info: SandboxInfo
    action: str  # "removed", "kept", "would remove", "failed"
    reason: str
    kind: Literal["sandbox", "snapshot"] = "sandbox"


SelfSweep = Callable[[RuntimeConfig | None, "Sweep"], Awaitable[list[SweepResult]]]
"""A backend's own sweep (see :func:`own_sweep`)."""


def own_sweep(cls: type[Runtime]) -> SelfSweep | None:
    """The sweep a backend runs itself, where its sandboxes live, or ``None`` (the others:
    listed and judged here).

    A backend whose sandboxes' creators are processes of other machines (the ``ray``
    backend's are processes of its nodes) defines a classmethod ``sweep_sandboxes(config,
    sweep)`` that applies ``sweep``'s rules (:meth:`Sweep.one`) there and returns the
    results; one that raises :class:`SandboxError` is skipped like a backend that cannot be
    listed.
    """
    hook: SelfSweep | None = getattr(cls, "sweep_sandboxes", None)
    return hook


def _should_sweep(
    labels: Mapping[str, str], all_sessions: bool, older_than: float | None, kept: bool = False
) -> tuple[bool, str]:
    if all_sessions:
        return True, "--all"
    if ownership.is_kept(labels):
        return (True, "kept, --kept") if kept else (False, "kept (keep=True)")
    if older_than is not None:
        created = ownership.created_at(labels)
        if created is not None:
            age = (_dt.datetime.now(_dt.UTC) - created).total_seconds()
            if age > older_than:
                return True, f"older than {older_than:g}s ({age:.0f}s)"
    dead = ownership.creator_is_dead(labels)
    if dead:
        return True, "session is dead"
    if dead is None:
        return False, "session on another host or unlabelled"
    return False, "session is alive"


async def cleanup_sandboxes(
    backends: Iterable[str | RuntimeConfig | Mapping[str, Any]] | None = None,
    *,
    all_sessions: bool = False,
    older_than: float | None = None,
    dry_run: bool = False,
    kept: bool = False,
    match: Mapping[str, str] | None = None,
    snapshots: bool = True,
) -> list[SweepResult]:
    """Find labelled sandboxes on each backend and remove those that leaked.

    ``backends`` are type names or configs (a config tells a backend where to look, for
    example a Docker ``base_url``); by default every registered backend is swept with
    its default config. A backend that cannot be reached is logged and skipped, never
    fatal for the others. The current session's own sandboxes are kept unless
    ``all_sessions``. Kept sandboxes (``keep=True``) are removed only with ``kept`` (of
    any session, this one's included) or ``all_sessions``. ``match`` narrows the sweep to
    sandboxes carrying all of these labels (others are not reported). Snapshots are swept
    the same way, after each backend's sandboxes (``snapshots=False``: left alone).
    """
    results: list[SweepResult] = []
    targets = list(backends) if backends is not None else list(available_runtimes())
    for target in targets:
        resolved = target if isinstance(target, str) else resolve_runtime_config(target)
        sweep = Sweep(all_sessions, older_than, dry_run, kept, match)
        try:
            cls, config = target_class(resolved)
            itself = own_sweep(cls)
            if itself is not None:
                results += await itself(config, sweep)
                found = []
            else:
                found = await cls.list_sandboxes(config)
        except SandboxError as exc:
            name = resolved if isinstance(resolved, str) else resolved.type
            log.warning("cleanup: skipping backend %s: %s", name, exc)
            continue
        for info in found:
            results += await sweep.one(info, partial(cls.destroy_sandbox, info, config))
        if not snapshots:
            continue
        try:
            taken = await cls.list_snapshots(config)
        except SandboxError as exc:
            log.warning("cleanup: skipping the snapshots of backend %s: %s", cls.name, exc)
            continue
        for snap in taken:
            results += await sweep.one(
                snapshot_info(snap),
                partial(_remove_snapshot, cls, snap, config),
                "snapshot",
            )
    return results


async def remove_snapshot(
    snapshot: SandboxSnapshot, config: RuntimeConfig | Mapping[str, Any] | str | None = None
) -> None:
    """Delete ``snapshot``; one already gone is fine. Forks already opened from it go on.

    ``config`` tells the backend where the snapshot lives (a Docker ``base_url``, an SSH
    host and its credentials); by default, the config of the runtime that took it, when this
    process took it, else the backend's default config (SSH has none: pass it).

    Raises:
        SnapshotUnsupportedError: the backend cannot take snapshots.
        SandboxInvalidArgumentError: ``config`` is of another backend, ``snapshot`` is not one
            of this backend's snapshots, or SSH without a config.
        SandboxError: the backend refused (Docker: a fork's container still uses the image).
        SandboxTransportError: the backend could not be reached.
    """
    resolved = None if config is None else resolve_runtime_config(config)
    if resolved is not None and resolved.type != snapshot.backend:
        raise SandboxInvalidArgumentError(
            f"{snapshot.describe()} cannot be removed with a {resolved.type!r} config"
        )
    cls = load_runtime_class(snapshot.backend)
    if resolved is None:
        resolved = held_config(snapshot)
    await cls.destroy_snapshot(snapshot, resolved)
    release(snapshot)


async def _remove_snapshot(
    cls: type[Runtime], snapshot: SandboxSnapshot, config: RuntimeConfig | None
) -> None:
    await cls.destroy_snapshot(snapshot, config)
    release(snapshot)


@dataclass(frozen=True)
class Sweep:
    """The decision and the removal for one listed sandbox or snapshot: the rules of one
    :func:`cleanup_sandboxes` call (a backend that sweeps itself, ``sweep_sandboxes``, gets
    them to apply where its sandboxes live)."""

    all_sessions: bool
    older_than: float | None
    dry_run: bool
    kept: bool
    match: Mapping[str, str] | None

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a sandbox with ``labels`` is in this sweep at all (``match``)."""
        return not self.match or all(labels.get(k) == v for k, v in self.match.items())

    async def one(
        self,
        info: SandboxInfo,
        remove: Callable[[], Awaitable[None]],
        kind: Literal["sandbox", "snapshot"] = "sandbox",
    ) -> list[SweepResult]:
        labels = info.labels
        if not self.matches(labels):
            return []
        sweep, reason = _should_sweep(labels, self.all_sessions, self.older_than, self.kept)
        own = labels.get(ownership.CREATOR) == ownership.CREATOR_ID
        if not sweep or (own and not self.all_sessions and not ownership.is_kept(labels)):
            return [SweepResult(info, "kept", reason, kind)]
        if self.dry_run:
            return [SweepResult(info, "would remove", reason, kind)]
        try:
            await remove()
        except SandboxError as exc:
            return [SweepResult(info, "failed", f"{reason}; {exc}", kind)]
        return [SweepResult(info, "removed", reason, kind)]
