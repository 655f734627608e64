"""Finding what a runtime's commands left running: the mark, the sweep, the clock tick.

Every command a runtime starts carries ``VF_SANDBOX_RUNTIME=<runtime mark>`` in its
environment (:data:`MARK_VAR`), so :meth:`~runtimes.base.Runtime.stop_processes` can find
what is left of them with the sweep (``scripts/sweep.sh``: freeze, then kill). It is the
one mark of every backend: SSH names its sandbox directory after it too, so cleanup can sweep
a dead session's processes by it.
"""

from __future__ import annotations

from collections.abc import Iterable

from .scripts import load

__all__ = [
    "CLOCK_TICK_SCRIPT",
    "KILL_SCRIPT",
    "MARK_VAR",
    "SWEEP_SCRIPT",
    "kill_args",
    "kill_argv",
    "sweep_argv",
]

MARK_VAR = "VF_SANDBOX_RUNTIME"
"""The environment variable that carries a runtime's mark into every command it starts."""

SWEEP_SCRIPT = load("sweep")
"""The process sweep behind :meth:`~runtimes.base.Runtime.stop_processes` (POSIX ``sh``,
``/proc``); its header comment documents the modes and arguments."""

CLOCK_TICK_SCRIPT = load("clock_tick")
"""Prints the start time (clock ticks since boot) of the shell running it: every process
started later has a start time at least this large (the ``since:T`` sweep mode)."""

KILL_SCRIPT = load("kill")
"""The one kill every backend runs in a sandbox (``scripts/kill.sh``): SIGKILL to each group's
leader, then the group; with ``--mark``, only groups whose leader still carries the mark."""


def kill_argv(pgids: Iterable[int], *, mark: str | None = None) -> list[str]:
    """The argv of one :data:`KILL_SCRIPT` run: kill these process groups (each leader's pid
    first); ``mark`` (``NAME=value``): only those whose leader's environment still carries it,
    so a kill retried later cannot hit a process that reused the id."""
    return ["sh", "-c", KILL_SCRIPT, "sh", *kill_args(pgids, mark=mark)]


def kill_args(pgids: Iterable[int], *, mark: str | None = None) -> list[str]:
    """The positional arguments of :data:`KILL_SCRIPT` (see :func:`kill_argv`)."""
    guard = ["--mark", mark] if mark is not None else []
    return [*guard, *(str(int(pgid)) for pgid in sorted(set(pgids)))]


def sweep_argv(
    mode: str,
    mark: str,
    *,
    keep: int | None = None,
    user: str | None = None,
    home: str | None = None,
) -> list[str]:
    """The argv of one :data:`SWEEP_SCRIPT` run (see its comment for the arguments)."""
    return ["sh", "-c", SWEEP_SCRIPT, "sh", mode, mark, str(keep or ""), user or "", home or ""]
