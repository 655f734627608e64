"""The POSIX ``sh`` programs the runtimes run inside sandboxes, one ``.sh`` file each.

They live in files (not Python strings) so that ``shellcheck`` lints them (``make lint``).
:func:`load` returns a script's text; backends keep their own scripts in a ``scripts/``
folder of their package and load them the same way.
"""

from __future__ import annotations

import functools
from importlib import resources

__all__ = ["load"]


@functools.cache
def load(name: str, package: str = __name__) -> str:
    """The text of ``<name>.sh`` in ``package`` (default: this one).

    Raises:
        FileNotFoundError: no such script (a packaging mistake, not a sandbox condition).
    """
    return resources.files(package).joinpath(f"{name}.sh").read_text(encoding="utf-8")
