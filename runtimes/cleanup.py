"""Sweeping leaked sandboxes: what ``vf-sandbox cleanup`` runs.

A sandbox is swept when its labels say the session that created it is dead (its
process is gone from this host), or unconditionally with ``all_sessions=True``, or when
it is older than ``older_than`` seconds. Sandboxes of live sessions, and of sessions on
other hosts whose liveness cannot be checked from here, are left alone by default. A
sandbox kept on purpose (``keep=True``, :func:`runtimes.ownership.is_kept`) is left alone
whatever its session or age, unless ``kept=True`` (``cleanup --kept``) or ``all_sessions``.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import ownership
from .config import RuntimeConfig
from .errors import SandboxError
from .models import SandboxInfo
from .registry import available_runtimes, load_runtime_class, resolve_runtime_config

if TYPE_CHECKING:
    from .base import Runtime

log = logging.getLogger("runtimes.cleanup")

NOT_LISTABLE = (
    "the backend does not implement list_sandboxes: its sandboxes cannot be listed or swept"
)


def lists_sandboxes(cls: type[Runtime]) -> bool:
    """Whether a backend overrides :meth:`Runtime.list_sandboxes` (the base's finds nothing,
    which must not read as "no sandboxes")."""
    from .base import Runtime

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
    config = None if isinstance(target, str) else target
    cls = load_runtime_class(target if isinstance(target, str) else target.type)
    if not lists_sandboxes(cls):
        raise SandboxError(NOT_LISTABLE)
    return cls, config, await cls.list_sandboxes(config)


@dataclass(frozen=True)
class SweepResult:
    info: SandboxInfo
    action: str  # "removed", "kept", "would remove", "failed"
    reason: str


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
    dead = ownership.session_is_dead(labels)
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
) -> list[SweepResult]:
    """Find labelled sandboxes on each backend and remove those that leaked.

    ``backends`` are type names or configs (a config tells a backend where to look, for
    example a Docker ``base_url``); by default every registered backend is swept with
    its default config. A backend that cannot be reached is logged and skipped, never
    fatal for the others. The current session's own sandboxes are kept unless
    ``all_sessions``. Kept sandboxes (``keep=True``) are removed only with ``kept`` (of
    any session, this one's included) or ``all_sessions``. ``match`` narrows the sweep to
    sandboxes carrying all of these labels (others are not reported).
    """
    results: list[SweepResult] = []
    targets = list(backends) if backends is not None else list(available_runtimes())
    for target in targets:
        resolved = target if isinstance(target, str) else resolve_runtime_config(target)
        try:
            cls, config, found = await list_target(resolved)
        except SandboxError as exc:
            name = resolved if isinstance(resolved, str) else resolved.type
            log.warning("cleanup: skipping backend %s: %s", name, exc)
            continue
        for info in found:
            if match and any(info.labels.get(key) != value for key, value in match.items()):
                continue
            sweep, reason = _should_sweep(info.labels, all_sessions, older_than, kept)
            own = info.labels.get(ownership.SESSION) == ownership.SESSION_ID
            if not sweep or (own and not all_sessions and not ownership.is_kept(info.labels)):
                results.append(SweepResult(info, "kept", reason))
                continue
            if dry_run:
                results.append(SweepResult(info, "would remove", reason))
                continue
            try:
                await cls.destroy_sandbox(info, config)
            except SandboxError as exc:
                results.append(SweepResult(info, "failed", f"{reason}; {exc}"))
            else:
                results.append(SweepResult(info, "removed", reason))
    return results
