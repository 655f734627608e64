"""Snapshots of sandboxes: ``snap = await rt.snapshot()``, then ``open_runtime(config,
snapshot=snap)`` opens a fresh sandbox whose files start as the snapshotted one's.

A snapshot holds files, never processes: a fork starts with nothing running. What it holds
depends on the backend (:attr:`SandboxSnapshot.holds`): the whole filesystem (Docker: a
committed image; Modal: ``Sandbox.snapshot_filesystem``) or the workdir only (subprocess, SSH:
a copy of the workdir under the runtime's root or the remote temp dir, links copied as links).

Snapshots are owned like sandboxes: they carry the session labels of the process that took
them (:mod:`runtimes.ownership`) plus the ``vf-sandbox.snapshot*`` labels below, ``vf-sandbox
ls`` lists them and ``vf-sandbox cleanup`` removes those of dead sessions. One taken with
``keep=True`` is spared by every sweep but ``cleanup --kept`` / ``--all``; any other is also
removed at interpreter exit, like a runtime nobody closed.
:func:`runtimes.cleanup.remove_snapshot` removes one explicitly.
"""

from __future__ import annotations

import atexit
import logging
import secrets
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from . import ownership
from .config import RuntimeConfig
from .errors import ProvisioningError, SandboxInvalidArgumentError

if TYPE_CHECKING:
    from .forking import Snapshotting

__all__ = [
    "SNAPSHOT",
    "SandboxSnapshot",
    "SnapshotHolds",
    "SnapshotNotFoundError",
    "SnapshotUnsupportedError",
    "snapshot_from_labels",
    "snapshot_labels",
]

log = logging.getLogger("runtimes.snapshot")

SnapshotHolds = Literal["filesystem", "workdir"]
"""What a snapshot holds: the sandbox's whole filesystem, or its workdir only."""

SNAPSHOT = ownership.LABEL_PREFIX + "snapshot"
"""A random token naming the snapshot (also the Docker image's tag)."""
SOURCE = ownership.LABEL_PREFIX + "snapshot-source"
"""The id of the sandbox it was taken of."""
WORKDIR = ownership.LABEL_PREFIX + "snapshot-workdir"
"""The snapshotted sandbox's workdir."""
POLICY_USER = ownership.LABEL_PREFIX + "snapshot-policy-user"
"""The policy's account, if the snapshotted sandbox had already made it and handed it the
workdir: a fork of the same workdir needs not do it again (``""``: none)."""
PYTHON = ownership.LABEL_PREFIX + "snapshot-python"
"""The absolute path of the interpreter the snapshotted sandbox's channel agent ran from
(pinned at its first start, before the policy ran): a fork's first agent starts from that path
directly — no ``sh``, no ``PATH`` search in the policy's filesystem (``""``: none pinned)."""
UNTRUSTED = ownership.LABEL_PREFIX + "snapshot-untrusted"
"""Why the interpreter a whole-filesystem snapshot holds may not be the image's (a changed
``python*`` or system library): the channel agent of a fork then never runs it (``""``: no
such change seen)."""


class SnapshotNotFoundError(ProvisioningError):
    """A sandbox was to start from a snapshot that is gone (removed, expired, or never on this
    engine / host / account): raised by ``start()``."""


class SnapshotUnsupportedError(SandboxInvalidArgumentError):
    """This backend cannot take snapshots or open sandboxes from them."""


class SandboxSnapshot(BaseModel):
    """A snapshot of a sandbox's files, as :meth:`~runtimes.base.Runtime.snapshot` returned it
    or a listing (``list_snapshots``) found it.

    ``id`` is the backend's handle: the image id (Docker), the image id (Modal), the snapshot
    directory's absolute path (subprocess: on this host; SSH: on the remote host). ``source`` is
    the id of the sandbox it was taken of, ``workdir`` that sandbox's workdir, ``created`` an
    ISO-8601 time. ``labels`` are every label stored with it (session labels included).
    ``policy_user``, ``untrusted`` and ``python``: see :data:`POLICY_USER`, :data:`UNTRUSTED`
    and :data:`PYTHON`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    backend: str
    id: str
    created: str | None = None
    labels: dict[str, str]
    source: str
    holds: SnapshotHolds
    workdir: str
    policy_user: str | None = None
    untrusted: str | None = None
    python: str | None = None

    def __hash__(self) -> int:
        return hash((self.backend, self.id))

    @property
    def kept(self) -> bool:
        """Whether it was taken with ``keep=True`` (spared by sweeps and at exit)."""
        return ownership.is_kept(self.labels)

    def describe(self) -> str:
        """A short human name for messages: backend, id, what it holds and of what."""
        what = "filesystem" if self.holds == "filesystem" else f"workdir {self.workdir}"
        return f"{self.backend} snapshot {self.id} ({what} of sandbox {self.source})"


def snapshot_labels(
    backend: str,
    extra: Mapping[str, str] | None,
    *,
    keep: bool,
    source: str,
    workdir: str,
    policy_user: str | None,
    untrusted: str | None = None,
    python: str | None = None,
) -> dict[str, str]:
    """Every label of a snapshot taken now by this process. Each snapshot key is set, empty
    when it says nothing, and ``keep`` is ``"true"`` or ``"false"``: a Docker commit merges
    the container's labels (a fork's, which carry its snapshot's) under these."""
    labels = ownership.ownership_labels(backend, extra, keep=keep)
    labels[ownership.KEEP] = "true" if keep else "false"
    labels.update(
        {
            SNAPSHOT: secrets.token_hex(8),
            SOURCE: source,
            WORKDIR: workdir,
            POLICY_USER: policy_user or "",
            UNTRUSTED: untrusted or "",
            PYTHON: python or "",
        }
    )
    return labels


def snapshot_from_labels(
    backend: str, snapshot_id: str, labels: Mapping[str, str], holds: SnapshotHolds
) -> SandboxSnapshot:
    """The snapshot ``snapshot_id`` of ``backend`` described by the labels stored with it."""
    kept = {str(key): str(value) for key, value in labels.items()}
    return SandboxSnapshot(
        backend=backend,
        id=snapshot_id,
        created=kept.get(ownership.CREATED) or None,
        labels=kept,
        source=kept.get(SOURCE, ""),
        holds=holds,
        workdir=kept.get(WORKDIR, ""),
        policy_user=kept.get(POLICY_USER) or None,
        untrusted=kept.get(UNTRUSTED) or None,
        python=kept.get(PYTHON) or None,
    )


# ---------------------------------------------------------------------- the exit backstop

_HELD: dict[tuple[str, str], tuple[type[Snapshotting], RuntimeConfig, SandboxSnapshot]] = {}
_HELD_LOCK = threading.Lock()


def hold(cls: type[Snapshotting], config: RuntimeConfig, snapshot: SandboxSnapshot) -> None:
    """Remove ``snapshot`` at interpreter exit unless :func:`release` comes first (snapshots
    taken without ``keep``)."""
    with _HELD_LOCK:
        _HELD[(snapshot.backend, snapshot.id)] = (cls, config, snapshot)
    # atexit runs the last registered first: ahead of SDK hooks imported since, and after
    # the runtimes' backstop as long as a fork started after this (lifecycle re-registers).
    atexit.unregister(_remove_leftovers)
    atexit.register(_remove_leftovers)


def release(snapshot: SandboxSnapshot) -> None:
    with _HELD_LOCK:
        _HELD.pop((snapshot.backend, snapshot.id), None)


def held_snapshots() -> list[SandboxSnapshot]:
    """Snapshots this process took (without ``keep``) and has not removed."""
    with _HELD_LOCK:
        return [snapshot for _, _, snapshot in _HELD.values()]


def held_config(snapshot: SandboxSnapshot) -> RuntimeConfig | None:
    """The config of the runtime that took ``snapshot``, while this process holds it."""
    with _HELD_LOCK:
        entry = _HELD.get((snapshot.backend, snapshot.id))
    return None if entry is None else entry[1]


def _remove_leftovers() -> None:
    with _HELD_LOCK:
        leftovers = list(_HELD.values())
        _HELD.clear()
    for cls, config, snapshot in leftovers:
        try:
            cls._destroy_snapshot_at_exit(snapshot, config)
        except Exception:
            log.warning(
                "atexit: could not remove %s (`vf-sandbox cleanup` removes it once this "
                "process is gone)",
                snapshot.describe(),
                exc_info=True,
            )


def __getattr__(name: str) -> Any:
    """``runtimes.snapshot.remove_snapshot``, the path it had before it moved to
    :mod:`runtimes.cleanup` (looked up on use: cleanup imports this module)."""
    if name == "remove_snapshot":
        from .cleanup import remove_snapshot

        return remove_snapshot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
