"""Snapshots of subprocess sandboxes: a copy of the workdir in a directory of the runtime's
root (``<root>/snap-XXXXXXXX/``: ``snapshot.json``, the labels, and ``tree/``, the copy).

Copies are made by :func:`.tree_copy.copy_tree`, which walks by descriptor: a symbolic link is
copied as a link, never followed, wherever it points (a policy may plant ``evil ->
/etc/shadow``), and a directory a leftover process swaps for a link *while* the copy runs is
never read through; modes, times, owners (when the host process is root), hard links within
the tree and FIFOs are kept, as ``cp -a`` keeps them; on a filesystem with reflinks (btrfs,
XFS) the data is shared until written. ``snapshot.json`` is written before the copy starts, so
a holder killed mid-copy leaves a labelled directory that ``vf-sandbox cleanup`` removes.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path

from ..errors import ProvisioningError, SandboxError, SandboxInvalidArgumentError
from ..snapshot import SandboxSnapshot, SnapshotNotFoundError, snapshot_from_labels
from . import tree_copy
from .files import remove_sandbox_dir

SNAPSHOT_PREFIX = "snap-"
SNAPSHOT_META = "snapshot.json"
TREE = "tree"


def copy_tree(source: Path, target: Path) -> None:
    """Copy the directory ``source`` to ``target`` (which must not exist), links as links,
    never reading through a link, even one swapped in during the copy.

    Raises:
        SandboxError: the copy failed (the reason attached): an unreadable file, a full disk,
            an entry that kept changing, a tree deeper than ``tree_copy.MAX_DEPTH``.
    """
    try:
        tree_copy.copy_tree(str(source), str(target))
    except OSError as exc:
        raise SandboxError(f"copying {source} to {target} failed: {exc}") from exc


def _real_directory(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def take_snapshot(root: Path, workdir: Path, labels: dict[str, str]) -> Path:
    """Copy ``workdir`` into a new snapshot directory under ``root``; return the directory.

    Raises:
        SandboxError: the workdir is not a directory any more (replaced by a link), the
            directory could not be made, or the copy failed (the directory is removed).
    """
    if not _real_directory(workdir):
        raise SandboxError(f"cannot snapshot {workdir}: not a directory (or replaced by a link)")
    try:
        root.mkdir(parents=True, exist_ok=True)
        directory = Path(tempfile.mkdtemp(prefix=SNAPSHOT_PREFIX, dir=root))
    except OSError as exc:
        raise SandboxError(f"cannot make a snapshot directory under {root}: {exc}") from exc
    try:
        (directory / SNAPSHOT_META).write_text(json.dumps({"labels": labels}))
        copy_tree(workdir, directory / TREE)
    except BaseException:
        remove_sandbox_dir(directory, None)
        raise
    return directory


def check_snapshot_path(snapshot: SandboxSnapshot) -> Path:
    """The snapshot's directory, if ``snapshot.id`` names one in the form this backend makes.

    Raises:
        SandboxInvalidArgumentError: not an absolute path to a ``snap-*`` directory.
    """
    path = Path(snapshot.id)
    if not path.is_absolute() or not path.name.startswith(SNAPSHOT_PREFIX) or ".." in path.parts:
        raise SandboxInvalidArgumentError(f"not a subprocess snapshot directory: {snapshot.id!r}")
    return path


def copy_snapshot_into(snapshot: SandboxSnapshot, workdir: Path) -> None:
    """Make ``workdir`` (not existing yet) a copy of the snapshot's tree.

    Raises:
        SnapshotNotFoundError: the snapshot's directory (or its tree) is gone.
        ProvisioningError: the copy failed.
    """
    tree = check_snapshot_path(snapshot) / TREE
    if not _real_directory(tree):
        raise SnapshotNotFoundError(f"{snapshot.describe()} is gone ({tree} is not there)")
    try:
        copy_tree(tree, workdir)
    except SandboxError as exc:
        raise ProvisioningError(f"cannot open a sandbox from {snapshot.describe()}: {exc}") from exc
    if not _real_directory(workdir):
        raise ProvisioningError(f"the copy of {snapshot.describe()} is not a directory")


def _read_labels(directory: Path) -> dict[str, str] | None:
    """The labels of a snapshot directory's ``snapshot.json`` (read without following a
    link), or ``None`` when it has none or it is not this user's."""
    try:
        fd = os.open(directory / SNAPSHOT_META, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            if os.fstat(fh.fileno()).st_uid != os.geteuid():
                return None
            meta = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return None
    labels = meta.get("labels") if isinstance(meta, dict) else None
    if not isinstance(labels, dict):
        return None
    return {str(key): str(value) for key, value in labels.items()}


def scan_snapshots(root: Path) -> list[SandboxSnapshot]:
    """Every snapshot directory under ``root`` with a ``snapshot.json`` of this user's."""
    found: list[SandboxSnapshot] = []
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        if not entry.name.startswith(SNAPSHOT_PREFIX) or not _real_directory(entry):
            continue
        labels = _read_labels(entry)
        if labels is not None:
            found.append(snapshot_from_labels("subprocess", str(entry), labels, "workdir"))
    return found


def destroy_snapshot_dir(snapshot: SandboxSnapshot) -> None:
    """Remove a snapshot's directory without following a link; gone already is fine.

    Raises:
        SandboxInvalidArgumentError: the path is not a snapshot directory of this user's (no
            ``snapshot.json`` of its own): it is left alone.
    """
    path = check_snapshot_path(snapshot)
    try:
        os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno != errno.ENOTDIR:
            raise SandboxError(f"cannot remove {snapshot.describe()}: {exc}") from exc
        return
    if _real_directory(path) and _read_labels(path) is None:
        raise SandboxInvalidArgumentError(
            f"{path} holds no snapshot.json of this user's: not removed"
        )
    remove_sandbox_dir(path, None)
