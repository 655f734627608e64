"""Snapshots and forks of a :class:`~runtimes.base.Runtime` (``docs/snapshots.md``): taking
one (``snapshot``), opening a fork from one (``fork_from``), and the hooks a backend that
can take them implements (``_snapshot``, ``list_snapshots``, ``destroy_snapshot``,
``_check_fork_config``). What a snapshot is, its labels and the exit backstop live in
:mod:`.snapshot`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import ClassVar, Self

import anyio
import anyio.lowlevel

from . import snapshot as snapshots
from .accounts import Accounts
from .config import RuntimeConfig
from .errors import SandboxInvalidArgumentError, SandboxUnavailableError
from .lifecycle import State
from .snapshot import SandboxSnapshot, SnapshotHolds, SnapshotUnsupportedError, snapshot_labels

log = logging.getLogger("runtimes")


class Snapshotting(Accounts):
    """Snapshots and forks (see the module)."""

    _snapshot_source: SandboxSnapshot | None

    snapshot_holds: ClassVar[SnapshotHolds | None] = None
    """What this backend's snapshots hold (``"filesystem"`` or ``"workdir"``); ``None``: it
    cannot take snapshots (:meth:`snapshot` and ``open_runtime(snapshot=)`` refuse)."""

    async def snapshot(
        self, *, keep: bool = False, labels: Mapping[str, str] | None = None
    ) -> SandboxSnapshot:
        """Snapshot the sandbox's files (``docs/snapshots.md``); open a fork of it with
        ``open_runtime(config, snapshot=snap)``. Processes are never part of it; the sandbox
        goes on running (Docker pauses it while the engine commits).

        The snapshot carries this session's labels, the config's and ``labels``. Unless
        ``keep``, it is removed at interpreter exit (and by ``vf-sandbox cleanup`` once this
        process is gone); a kept one stays until :func:`runtimes.cleanup.remove_snapshot`
        or ``vf-sandbox cleanup --kept``. Taking it is shielded from cancellation; a
        cancelled caller's snapshot is removed again before the cancellation propagates.

        Raises:
            SnapshotUnsupportedError: this backend cannot take snapshots.
            SandboxUnavailableError: the runtime is closed (or never started), or the sandbox
                is gone.
            SandboxTransportError: the backend could not be reached.
            SandboxError: the backend failed to take it (the cause attached): a workdir the
                copy cannot read (subprocess, SSH), an engine that refused to commit.
        """
        if self.snapshot_holds is None:
            raise SnapshotUnsupportedError(f"the {self.name} backend cannot take snapshots")
        self._check_open()
        tags = snapshot_labels(
            self.name,
            {**self.config.labels, **(labels or {})},
            keep=keep,
            source=str(self.sandbox_id),
            workdir=self.workdir,
            policy_user=self._prepared_policy_user(),
            python=self._channel_supervisor.interpreter
            if self._channel_supervisor is not None
            else None,
        )
        with anyio.CancelScope(shield=True), self._guard("snapshot"):
            taken = await self._snapshot(tags)
            if not keep:
                snapshots.hold(type(self), self.config, taken)
        try:
            await anyio.lowlevel.checkpoint()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._remove_quietly(taken)
            raise
        return taken

    async def _remove_quietly(self, snapshot: SandboxSnapshot) -> None:
        try:
            await type(self).destroy_snapshot(snapshot, self.config)
            snapshots.release(snapshot)
        except Exception:
            log.warning("removing %s again also failed", snapshot.describe(), exc_info=True)

    def fork_from(self, snapshot: SandboxSnapshot) -> Self:
        """Make this runtime, not yet started, start from ``snapshot``: its sandbox's files
        begin as the snapshot's (``open_runtime(config, snapshot=)`` calls this). Whether
        the snapshot still exists is found out by :meth:`start`, which raises
        :class:`~runtimes.snapshot.SnapshotNotFoundError` if it does not.

        Raises:
            SnapshotUnsupportedError: this backend cannot open sandboxes from snapshots.
            SandboxInvalidArgumentError: a snapshot of another backend, or a config that
                cannot start from one (a Docker ``container`` to attach to; a subprocess or
                SSH ``workdir`` of your own: a fork gets a private copy).
            SandboxUnavailableError: the runtime was already started.
        """
        if self.snapshot_holds is None:
            raise SnapshotUnsupportedError(
                f"the {self.name} backend cannot open sandboxes from snapshots"
            )
        if self._state != State.NEW:
            raise SandboxUnavailableError(
                f"{self.describe()} was already started ({self._state.value})"
            )
        if snapshot.backend != self.name:
            raise SandboxInvalidArgumentError(
                f"{snapshot.describe()} cannot open a {self.name} sandbox: open it with a "
                f"{snapshot.backend!r} config"
            )
        self._check_fork_config()
        self._snapshot_source = snapshot
        return self

    @property
    def snapshot_source(self) -> SandboxSnapshot | None:
        """The snapshot this runtime was opened from, if any."""
        return self._snapshot_source

    def _channel_first_interpreter(self) -> str | None:
        """A fork's first agent starts from the interpreter its snapshot's sandbox pinned
        (never through ``sh`` and ``PATH`` in the policy's filesystem)."""
        source = self._snapshot_source
        return source.python if source is not None and source.untrusted is None else None

    def _inherits_policy_account(self) -> bool:
        """Whether the snapshot this sandbox starts from holds the policy's account already
        made, with the workdir handed to it (where this sandbox's workdir is)."""
        snap = self._snapshot_source
        if snap is None or snap.policy_user is None or snap.policy_user != self.policy_user:
            return False
        return snap.holds == "workdir" or snap.workdir == self._workdir

    def _inherit_policy_account(self) -> None:
        """A fork whose snapshot's policy account owns the workdir already skips making it
        again: its first use would ``chown -R`` the workdir and so change the owners of
        files the machinery wrote (``docs/snapshots.md``)."""
        if self._inherits_policy_account():
            self._policy_account.ready = True

    # ------------------------------------------------------------------ backend hooks

    async def _snapshot(self, labels: dict[str, str]) -> SandboxSnapshot:
        """Take the snapshot, storing ``labels`` with it (a backend with ``snapshot_holds``).

        Raises:
            SnapshotUnsupportedError: the default.
        """
        raise SnapshotUnsupportedError(f"the {self.name} backend cannot take snapshots")

    def _check_fork_config(self) -> None:
        """Refuse a config this backend cannot start from a snapshot (raises
        ``SandboxInvalidArgumentError``)."""
        return None

    @classmethod
    async def list_snapshots(cls, config: RuntimeConfig | None = None) -> list[SandboxSnapshot]:
        """Every labelled snapshot of this backend (for ``cleanup``/``ls``): none for a backend
        that cannot take them.

        Raises:
            SandboxTransportError: the backend could not be reached.
        """
        return []

    @classmethod
    async def destroy_snapshot(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None = None
    ) -> None:
        """Remove one snapshot (gone already is fine): :func:`runtimes.cleanup.remove_snapshot`.

        Raises:
            SnapshotUnsupportedError: the default.
        """
        raise SnapshotUnsupportedError(f"the {cls.name} backend cannot take snapshots")

    @classmethod
    def _destroy_snapshot_at_exit(
        cls, snapshot: SandboxSnapshot, config: RuntimeConfig | None
    ) -> None:
        """The exit backstop of a snapshot nobody removed: :meth:`destroy_snapshot` on a
        fresh event loop (a backend whose client cannot run one at exit overrides it)."""
        anyio.run(cls.destroy_snapshot, snapshot, config)
