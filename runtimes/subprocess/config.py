"""The subprocess runtime's config: where sandbox directories live, and who runs commands."""

from __future__ import annotations

import os
import tempfile
from typing import Literal

from pydantic import Field, model_validator

from ..config import RuntimeConfig

META_FILE = "meta.json"
READ_CHUNK = 64 * 1024


def default_root() -> str:
    return os.path.join(tempfile.gettempdir(), "vf-sandbox")


class SubprocessConfig(RuntimeConfig):
    """Config of the ``subprocess`` runtime.

    ``root`` is where sandbox directories are created (default: ``$TMPDIR/vf-sandbox``);
    each sandbox gets ``<root>/<id>/work`` as its workdir unless ``workdir`` is given (a
    host path; relative to the current directory at start). A given ``workdir`` must exist
    (``start()`` raises ``SandboxFileNotFoundError`` otherwise) and is used as is and left
    in place on close; with ``create_workdir=True`` a missing one is created, parents
    included, and ``close()`` removes the directories it created (never a pre-existing one,
    never through a link).
    ``inherit_env`` passes the host's whole environment to commands; by default they get
    only ``PATH``, ``LANG``, ``HOME`` (the workdir) and the config's ``env``.
    """

    type: Literal["subprocess"] = "subprocess"
    root: str | None = None
    inherit_env: bool = False
    user: str | None = Field(default=None, description="default user for exec (root host only)")
    create_workdir: bool = Field(
        default=False,
        description="create a missing workdir (and parents); close() removes what it created",
    )

    @model_validator(mode="after")
    def _create_workdir_needs_workdir(self) -> SubprocessConfig:
        if self.create_workdir and not self.workdir:
            raise ValueError(
                "create_workdir needs a workdir (the default private workdir is always "
                "created and removed)"
            )
        return self

    def is_local(self) -> bool:
        return True
