"""Mounts of the ``docker`` runtime: bind mounts of host directories or files and named
(or anonymous) volumes, from the ``mounts`` config entries to the engine's ``Mounts``.

A mount may not hide what the runtime relies on: the workdir (a mount at it or above it),
the control directory ``/tmp/.vf-sandbox`` of the exec wrapper, or ``/`` itself. A
*writable* mount may not cover the system directories whose files the channel agent's
integrity check reads from the engine's diff (``/usr``, ``/lib*``, ``/bin``, ``/etc``, ...):
changes inside a mount never show in that diff, so sandbox code could replace them unseen
(``docs/security.md``).
"""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..wrapper import CONTROL_DIR

_VOLUME_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_KERNEL_DIRS = ("/proc", "/sys", "/dev")
_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc")

VOLUME_LABEL = "vf-sandbox.volume"
"""Label of the named volumes the engine created for a sandbox (value: the container name)."""


class MountSpec(BaseModel):
    """One mount: ``{"type": "bind", "source": "/host/dir", "target": "/data",
    "read_only": true}`` or ``{"type": "volume", "source": "cache", "target": "/cache"}``
    (``source`` omitted: an anonymous volume, removed with the sandbox)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["bind", "volume"] = "bind"
    source: str | None = Field(
        default=None, description="bind: absolute existing host path; volume: its name"
    )
    target: str = Field(description="absolute path in the container")
    read_only: bool = False

    @field_validator("target")
    @classmethod
    def _absolute_target(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError(f"target must be an absolute path in the container, got {value!r}")
        target = posixpath.normpath(value)
        if target == "/" or _within(target, _KERNEL_DIRS):
            raise ValueError(f"cannot mount over {target!r}")
        return target

    @model_validator(mode="after")
    def _source_fits_type(self) -> MountSpec:
        if self.type == "bind":
            if self.source is None or not os.path.isabs(self.source):
                raise ValueError(
                    f"a bind mount's source must be an absolute host path, got {self.source!r}"
                )
        elif self.source is not None and not _VOLUME_NAME.match(self.source):
            raise ValueError(f"{self.source!r} is not a valid volume name ([A-Za-z0-9_.-])")
        return self


def _within(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def _at_or_above(path: str, inner: str) -> bool:
    return inner == path or inner.startswith(path.rstrip("/") + "/")


def check_mounts(
    mounts: tuple[MountSpec, ...], workdir: str, policy_user: str | None, local_engine: bool
) -> None:
    """Raise ValueError (a config error on ``mounts``) for a mount that would hide the workdir
    or the control directory, a writable one over system directories, a target mounted twice,
    or (with a local engine) a bind source that does not exist. With a ``policy_user``, also
    a mount inside the workdir or over the account's home: handing them to it (``chown -R``,
    :mod:`runtimes.policy`) would change the owner of the host's files."""
    targets: list[str] = []
    for mount in mounts:
        target = mount.target
        if _at_or_above(target, workdir):
            raise ValueError(
                f"mount at {target!r} would hide the workdir {workdir!r}: mount elsewhere "
                "(/data, say)"
            )
        if policy_user and (
            _at_or_above(workdir, target) or _at_or_above(target, f"/home/{policy_user}")
        ):
            raise ValueError(
                f"mount at {target!r}: the workdir and /home/{policy_user} are handed to "
                f"policy_user {policy_user!r} (chown -R), which would change the owner of the "
                "mounted files; mount elsewhere (/data, say), or set policy_user=None"
            )
        if _at_or_above(target, CONTROL_DIR) or _at_or_above(CONTROL_DIR, target):
            raise ValueError(
                f"mount at {target!r} would cover {CONTROL_DIR}, the runtime's control directory"
            )
        if not mount.read_only and _within(target, _SYSTEM_DIRS):
            raise ValueError(
                f"a writable mount at {target!r} covers system files the runtime checks "
                "(changes in a mount are invisible to the engine's diff): set read_only=true"
            )
        if target in targets:
            raise ValueError(f"{target!r} is mounted twice")
        targets.append(target)
        if mount.type == "bind" and local_engine and not os.path.exists(str(mount.source)):
            raise ValueError(f"bind mount source {mount.source!r} does not exist on this host")


def engine_mounts(mounts: tuple[MountSpec, ...], labels: dict[str, str]) -> list[Any]:
    """The docker SDK's ``mounts`` create option. A named volume the engine creates for it
    carries ``labels`` (and :data:`VOLUME_LABEL`); an existing one is used as it is."""
    import docker.types

    made = []
    for mount in mounts:
        made.append(
            docker.types.Mount(
                target=mount.target,
                source=mount.source or "",
                type=mount.type,
                read_only=mount.read_only,
                labels=labels if mount.type == "volume" and mount.source else None,
            )
        )
    return made
