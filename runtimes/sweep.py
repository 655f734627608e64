"""Finding what a runtime's commands left running: the mark, the sweep, the clock tick.

Every command a runtime starts carries ``VF_SANDBOX_RUNTIME=<runtime mark>`` in its
environment (:data:`MARK_VAR`), so :meth:`~runtimes.base.Runtime.stop_processes` can find
what is left of them with the sweep (``scripts/sweep.sh``: freeze, then kill).
"""

from __future__ import annotations

from .scripts import load

__all__ = ["CLOCK_TICK_SCRIPT", "MARK_VAR", "ORPHAN_KILL_SCRIPT", "SWEEP_SCRIPT", "sweep_argv"]

MARK_VAR = "VF_SANDBOX_RUNTIME"
"""The environment variable that carries a runtime's mark into every command it starts."""

SWEEP_SCRIPT = load("sweep")
"""The process sweep behind :meth:`~runtimes.base.Runtime.stop_processes` (POSIX ``sh``,
``/proc``); its header comment documents the modes and arguments."""

CLOCK_TICK_SCRIPT = load("clock_tick")
"""Prints the start time (clock ticks since boot) of the shell running it: every process
started later has a start time at least this large (the ``since:T`` sweep mode)."""

ORPHAN_KILL_SCRIPT = load("kill_orphans")
"""Kills process groups whose leader still carries a mark (``$1``: ``NAME=value``; then the
group ids): a kill retried later must not hit a process that reused the id."""


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
