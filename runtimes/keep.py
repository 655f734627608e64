"""Keeping a sandbox for debugging (``keep=True``), and getting into one (``vf-sandbox shell``).

A runtime whose config says ``keep=True`` and whose sandbox opened is *kept* at close:
``close()`` (and the exit backstop) release everything host-side (channel, connections, the
``max_live`` slot) but leave the sandbox, and what runs in it, where it is; a WARNING on the
``runtimes.keep`` logger names it and the command to get in. Its
:data:`~runtimes.ownership.KEEP` label makes every sweep spare it except an explicit
``vf-sandbox cleanup --kept`` (or ``--all``). A sandbox whose start failed is never kept:
there is nothing to debug in it.

:meth:`Keeping.shell_argv` is the host command that opens an interactive shell in a listed
sandbox's workdir; :func:`runtimes.locate.shell_argv_for` finds the sandbox by id (or a
unique prefix of it) across backends first.
"""

from __future__ import annotations

import json
import logging
import shlex
from typing import TYPE_CHECKING, ClassVar

from .config import RuntimeConfig, RuntimeConfigError
from .errors import SandboxInvalidArgumentError
from .models import SandboxInfo

if TYPE_CHECKING:
    from .base import Runtime

__all__ = ["Keeping", "announce_kept", "runtime_argument"]

log = logging.getLogger("runtimes.keep")

_NOT_LOCATING = {"keep", "labels", "env", "workdir", "output_limit", "read_limit"}
_SECRET_WORDS = ("password", "passphrase", "secret", "token")


class Keeping:
    """The keep half of :class:`~runtimes.base.Runtime`."""

    name: ClassVar[str] = "runtime"
    config: RuntimeConfig

    keep_supported: ClassVar[bool] = False
    """Whether this backend can keep its sandboxes: its ``_close`` and ``close_at_exit``
    release only host-side resources while ``self._keep``, and its sandboxes carry
    ``ownership.ownership_labels(..., keep=config.keep)``. Others refuse ``keep=True``."""

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
