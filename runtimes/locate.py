"""Finding a labelled sandbox by its id (or a unique prefix of it) across backends: what
``vf-sandbox shell`` and ``vf-sandbox rm`` look up first (:mod:`runtimes.keep` says how a
kept sandbox is got into).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .base import Runtime
from .cleanup import list_target
from .config import RuntimeConfig
from .errors import SandboxError, SandboxInvalidArgumentError, SandboxUnavailableError
from .models import SandboxInfo
from .registry import available_runtimes

__all__ = ["find_sandbox", "shell_argv_for"]

log = logging.getLogger("runtimes.keep")  # the name it logged under before it moved here


def _matches(found: Iterable[SandboxInfo], wanted: str) -> list[SandboxInfo]:
    infos = list(found)
    exact = [info for info in infos if info.id == wanted]
    return exact or [info for info in infos if info.id.startswith(wanted)]


async def find_sandbox(
    sandbox_id: str, targets: Iterable[str | RuntimeConfig] | None = None
) -> tuple[type[Runtime], RuntimeConfig | None, SandboxInfo]:
    """The backend, config and listing of the labelled sandbox ``sandbox_id`` (its id or a
    unique prefix of it), searched on ``targets`` (type names or configs; default: every
    backend with its default config). A backend that cannot be loaded or listed is skipped.

    Raises:
        SandboxUnavailableError: no such sandbox.
        SandboxInvalidArgumentError: an empty id, or a prefix of several sandboxes' ids.
    """
    if not sandbox_id.strip():
        raise SandboxInvalidArgumentError("the sandbox id is empty")
    searched = list(targets) if targets is not None else list(available_runtimes())
    hits: list[tuple[type[Runtime], RuntimeConfig | None, SandboxInfo]] = []
    listed: list[str] = []
    unlisted: list[str] = []
    for target in searched:
        name = target if isinstance(target, str) else target.type
        try:
            cls, config, found = await list_target(target)
        except SandboxError as exc:
            log.debug("shell: cannot list %s sandboxes: %s", name, exc)
            unlisted.append(name)
            continue
        listed.append(name)
        hits.extend((cls, config, info) for info in _matches(found, sandbox_id))
    if len(hits) > 1:
        names = ", ".join(f"{cls.name} {info.id}" for cls, _, info in hits)
        raise SandboxInvalidArgumentError(f"{sandbox_id!r} is ambiguous: {names}")
    if not hits:
        where = f"searched: {', '.join(listed) or 'nothing'}"
        if unlisted:
            where += f"; could not list: {', '.join(unlisted)}"
        raise SandboxUnavailableError(f"no sandbox {sandbox_id!r} ({where})")
    return hits[0]


async def shell_argv_for(
    sandbox_id: str, targets: Iterable[str | RuntimeConfig] | None = None, *, tty: bool
) -> list[str]:
    """The host argv of an interactive shell in sandbox ``sandbox_id`` (see
    :func:`find_sandbox` and :meth:`Keeping.shell_argv`).

    Raises:
        SandboxUnavailableError: no such sandbox, or it is not running.
        SandboxInvalidArgumentError: an ambiguous id, or a backend that cannot open shells.
        SandboxFileNotFoundError: the host tool the shell needs is not installed.
    """
    cls, config, info = await find_sandbox(sandbox_id, targets)
    return await cls.shell_argv(info, config, tty=tty)
