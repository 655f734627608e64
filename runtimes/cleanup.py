"""Sweeping leaked sandboxes: what ``vf-sandbox cleanup`` runs.

A sandbox is swept when its labels say the session that created it is dead (its
process is gone from this host), or unconditionally with ``all_sessions=True``, or when
it is older than ``older_than`` seconds. Sandboxes of live sessions, and of sessions on
other hosts whose liveness cannot be checked from here, are left alone by default.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from . import ownership
from .config import RuntimeConfig
from .errors import SandboxError
from .models import SandboxInfo
from .registry import available_runtimes, load_runtime_class, resolve_runtime_config

log = logging.getLogger("runtimes.cleanup")


@dataclass(frozen=True)
class SweepResult:
    info: SandboxInfo
    action: str  # "removed", "kept", "would remove", "failed"
    reason: str


def _should_sweep(
    labels: Mapping[str, str], all_sessions: bool, older_than: float | None
) -> tuple[bool, str]:
    if all_sessions:
        return True, "--all"
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
) -> list[SweepResult]:
    """Find labelled sandboxes on each backend and remove those that leaked.

    ``backends`` are type names or configs (a config tells a backend where to look, for
    example a Docker ``base_url``); by default every registered backend is swept with
    its default config. A backend that cannot be reached is logged and skipped, never
    fatal for the others. The current session's own sandboxes are kept unless
    ``all_sessions``.
    """
    results: list[SweepResult] = []
    targets = list(backends) if backends is not None else list(available_runtimes())
    for target in targets:
        config = None if isinstance(target, str) else resolve_runtime_config(target)
        type_name = target if isinstance(target, str) else config.type  # type: ignore[union-attr]
        try:
            cls = load_runtime_class(type_name)
            found = await cls.list_sandboxes(config)
        except SandboxError as exc:
            log.warning("cleanup: skipping backend %s: %s", type_name, exc)
            continue
        for info in found:
            sweep, reason = _should_sweep(info.labels, all_sessions, older_than)
            if not sweep or (
                info.labels.get(ownership.SESSION) == ownership.SESSION_ID and not all_sessions
            ):
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
