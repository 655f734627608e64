"""Persistent shell sessions (:meth:`runtimes.Runtime.shell`): a ``bash`` kept alive in the
sandbox by a small driver, over one long ``exec``. See ``docs/shell.md``."""

from __future__ import annotations

from .session import ShellSession

__all__ = ["ShellSession"]
