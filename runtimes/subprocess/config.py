"""The subprocess runtime's config: where sandbox directories live, and who runs commands."""

from __future__ import annotations

import os
import tempfile
from typing import Literal

from pydantic import Field

from ..config import RuntimeConfig

_META = "meta.json"
_READ_CHUNK = 64 * 1024


def default_root() -> str:
    return os.path.join(tempfile.gettempdir(), "vf-sandbox")


class SubprocessConfig(RuntimeConfig):
    """Config of the ``subprocess`` runtime.

    ``root`` is where sandbox directories are created (default: ``$TMPDIR/vf-sandbox``);
    each sandbox gets ``<root>/<id>/work`` as its workdir unless ``workdir`` is given, in
    which case that directory is used as is and left in place on close.
    ``inherit_env`` passes the host's whole environment to commands; by default they get
    only ``PATH``, ``LANG``, ``HOME`` (the workdir) and the config's ``env``.
    """

    type: Literal["subprocess"] = "subprocess"
    root: str | None = None
    inherit_env: bool = False
    user: str | None = Field(default=None, description="default user for exec (root host only)")

    def is_local(self) -> bool:
        return True
