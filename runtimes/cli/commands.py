"""Commands other packages add to ``vf-sandbox``: the ``vf_sandbox.commands`` entry-point group.

A distribution registers a :class:`Command` object (``placement`` registers ``judge``)::

    [project.entry-points."vf_sandbox.commands"]
    judge = "placement.cli:JUDGE_COMMAND"

The runtime commands (check, cleanup, ls, doctor, exec, shell, rm) are the package's own;
an added command comes first in the help and may not take one of their names. A command
that cannot be loaded costs only itself: one line on stderr, the other commands work.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Protocol

from .output import say

COMMAND_GROUP = "vf_sandbox.commands"


class CommandFactory(Protocol):
    """``build_parser``'s way to add a subcommand: its parser, with the help formatting and
    (``reporting=True``) the ``--json`` and ``-v`` options of every reporting command."""

    def __call__(
        self, name: str, summary: str, description: str = "", reporting: bool = False
    ) -> argparse.ArgumentParser: ...


@dataclass(frozen=True)
class Command:
    """A subcommand another package adds.

    ``add`` registers its parser through the :class:`CommandFactory` and sets
    ``func(args) -> int`` (its exit status) as the parser's default. ``summary`` is its
    line in the top help's command list; an ``intro`` (a paragraph) presents it above the
    list instead. ``usage_errors`` it raises exit 2, ``errors`` exit 1, each with a
    one-line message (a ``SandboxError`` does so already).
    """

    name: str
    add: Callable[[CommandFactory], None]
    summary: str = ""
    intro: str = ""
    usage_errors: tuple[type[Exception], ...] = ()
    errors: tuple[type[Exception], ...] = ()


def _distribution(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "an unknown distribution"


def installed_commands(reserved: frozenset[str]) -> list[Command]:
    """The commands installed distributions add, by name; none named in ``reserved``.

    One that raises on import, is not a :class:`Command` or takes a reserved or already
    taken name is left out with one line on stderr naming its distribution.
    """
    found: list[Command] = []
    taken = set(reserved)
    for ep in sorted(entry_points(group=COMMAND_GROUP), key=lambda e: e.name):
        where = f"vf-sandbox: the {ep.name!r} command (from {_distribution(ep)})"
        try:
            command = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plugin costs its own command only
            say(f"{where} cannot be loaded: {type(exc).__name__}: {exc}", stderr=True)
            continue
        if not isinstance(command, Command):
            say(f"{where} is not a Command ({type(command).__name__}): left out", stderr=True)
        elif command.name in taken:
            say(f"{where} takes the name of another command: left out", stderr=True)
        else:
            taken.add(command.name)
            found.append(command)
    return found
