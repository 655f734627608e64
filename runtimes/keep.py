"""Keeping a sandbox for debugging (``keep=True``), and getting into one (``vf-sandbox shell``).

A runtime whose config says ``keep=True`` and whose sandbox opened is *kept* at close:
``close()`` (and the exit backstop) release everything host-side (channel, connections, the
``max_live`` slot) but leave the sandbox, and what runs in it, where it is; a WARNING on the
``runtimes.keep`` logger names it and the command to get in. Its
:data:`~runtimes.ownership.KEEP` label makes every sweep spare it except an explicit
``vf-sandbox cleanup --kept`` (or ``--all``). A sandbox whose start failed is never kept:
there is nothing to debug in it.

:meth:`Keeping.shell_argv` is the host command that opens an interactive shell in a listed
sandbox's workdir; :func:`shell_argv_for` finds the sandbox by id (or a unique prefix of it)
across backends first.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Iterable
from typing import TYPE_CHECKING, ClassVar

from .config import RuntimeConfig, RuntimeConfigError
from .errors import SandboxError, SandboxInvalidArgumentError, SandboxUnavailableError
from .models import SandboxInfo

if TYPE_CHECKING:
    from .base import Runtime

__all__ = ["Keeping", "announce_kept", "find_sandbox", "runtime_argument", "shell_argv_for"]

log = logging.getLogger("runtimes.keep")

_NOT_LOCATING = {"keep", "labels", "env", "workdir", "output_limit", "read_limit"}
_SECRET_WORDS = ("password", "passphrase", "secret", "token")


class Keeping:
    """The keep half of :class:`~runtimes.base.Runtime`."""

    name: ClassVar[str] = "runtime"
    config: RuntimeConfig

    keep_supported: ClassVar[bool] = False
    """Whether this backend can keep its sandboxes: its ``_close`` and ``_close_at_exit``
    release only host-side resources while ``self._keep``, and its sandboxes carry
    ``ownership.session_labels(..., keep=config.keep)``. Others refuse ``keep=True``."""

    _keep: bool = False
    """Whether ``close()`` leaves the sandbox: set by ``start()`` once a ``keep=True``
    sandbox is open (a start that failed is cleaned up as usual)."""

    def keep_at_close(self) -> None:
        """Leave this open sandbox running at ``close()`` (and at interpreter exit), as
        ``keep=True`` would, when that is decided only after it started (inspect's
        ``--no-sandbox-cleanup``). It lacks the keep label: ``vf-sandbox cleanup`` removes it
        once this process has ended, like any sandbox of a dead session.

        Raises:
            RuntimeConfigError: the backend cannot keep a sandbox.
        """
        if not self.keep_supported:
            raise RuntimeConfigError(
                f"the {self.name} backend cannot keep a sandbox after close()",
                [{"type": "value_error", "loc": ("keep",), "msg": "keep is not supported"}],
            )
        self._keep = True

    def _check_keep(self) -> None:
        """Refuse ``keep=True`` on a backend that would destroy the sandbox anyway.

        Raises:
            RuntimeConfigError: naming the ``keep`` field.
        """
        if self.config.keep and not self.keep_supported:
            raise RuntimeConfigError(
                f"invalid {self.config.type!r} runtime config:\n  keep: the {self.name} "
                "backend cannot keep a sandbox after close()",
                [{"type": "value_error", "loc": ("keep",), "msg": "keep is not supported"}],
            )

    @classmethod
    def shell_hint(cls, sandbox_id: str, config: RuntimeConfig) -> str:
        """The command line that gets into sandbox ``sandbox_id`` made with ``config`` (the
        kept-sandbox notice gives it): ``vf-sandbox shell ID --runtime ...``."""
        argument = shlex.quote(runtime_argument(config))
        return f"vf-sandbox shell {sandbox_id} --runtime {argument}"

    @classmethod
    async def shell_argv(
        cls, info: SandboxInfo, config: RuntimeConfig | None = None, *, tty: bool
    ) -> list[str]:
        """The host argv (for ``os.execvp``) of an interactive shell in the workdir of
        ``info`` (found by :meth:`~runtimes.base.Runtime.list_sandboxes`); ``tty``: whether
        stdin is a terminal (else the shell reads commands from the piped stdin).

        Raises:
            SandboxInvalidArgumentError: this backend cannot open a shell (the default).
            SandboxUnavailableError: the sandbox is gone or not running.
            SandboxFileNotFoundError: the host tool the shell needs (``docker``, ``ssh``) is
                not installed.
        """
        raise SandboxInvalidArgumentError(
            f"the {cls.name} backend cannot open a shell in its sandboxes"
        )


def runtime_argument(config: RuntimeConfig) -> str:
    """What to pass as ``--runtime`` to find this config's sandboxes again: the type name,
    or a JSON object of the fields that locate them (secrets left out)."""
    fields = config.model_dump(mode="json", exclude_defaults=True, exclude=_NOT_LOCATING)
    located = {
        key: value
        for key, value in fields.items()
        if key != "type" and not any(word in key for word in _SECRET_WORDS)
    }
    if not located:
        return config.type
    return json.dumps({"type": config.type, **located}, separators=(",", ":"))


def announce_kept(runtime: Runtime) -> None:
    """Log, at WARNING, that ``runtime``'s sandbox was kept and how to get in and remove it."""
    log.warning(
        "kept %s (keep=True): it is still running; get in with `%s`; remove it with "
        "`vf-sandbox cleanup --kept`",
        runtime.describe(),
        runtime.shell_hint(str(runtime.sandbox_id), runtime.config),
    )


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
    from .cleanup import list_target
    from .registry import available_runtimes

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
