"""Which Docker sandboxes a pool may recycle (:class:`~runtimes.capabilities.ResetProof`):
those whose every writable place the runtime made, so that :mod:`runtimes.recycle` can
empty them all and prove it (``docs/pools.md``, Recycling)."""

from __future__ import annotations

from ..capabilities import ResetProof
from .config import DEFAULT_WORKDIR, DockerConfig, is_root_user

WIPED_PLACES = ("/tmp", "/dev/shm", "/dev/mqueue")
"""Beside the workdir, what an unprivileged process can write in a container with a
read-only root file system: the ``/tmp`` volume, and the engine's ``/dev/shm`` (POSIX shared
memory) and ``/dev/mqueue`` (POSIX message queues). ``/dev`` itself and the rest are root's."""


WATCHED_PLACES = ("/dev", "/sys/fs/cgroup")
"""The engine's tmpfs mounts only root can write (the root file system is read-only):
watched, not emptied."""


def recycle_refusal(config: DockerConfig) -> str | None:
    """Why a sandbox of ``config`` cannot be proven clean after use, or ``None``."""
    if config.container is not None:
        return "it borrows an existing container"
    if not config.read_only:
        return (
            "its root file system is writable (anything the policy wrote anywhere would have "
            "to be found): set read_only=True"
        )
    if not is_root_user(config.user):
        return f"its default user {config.user!r} is not root, who must empty what the policy left"
    if config.policy_user is None:
        return (
            "the policy runs as root (policy_user=None): set policy_user to an unprivileged "
            "account the image has ('nobody', say)"
        )
    writable = [m.target for m in config.mounts if not m.read_only]
    if writable:
        return f"the mounts {writable} are writable and outlive the reset: make them read_only"
    if config.network != "none":
        return (
            f"network={config.network!r}: a network's state (neighbours, connections, "
            "caches) is not something the reset can prove gone; use network='none'"
        )
    if config.gpus is not None:
        return "a GPU's memory and state are outside what the reset can prove gone"
    if {"SYS_ADMIN", "ALL"} & {cap.upper().removeprefix("CAP_") for cap in config.cap_add}:
        return "CAP_SYS_ADMIN could remount the read-only root file system writable"
    if "no-new-privileges" not in config.security_opt:
        return "without no-new-privileges a set-uid program could make the policy root"
    return None


class DockerResetProof(ResetProof):
    """:class:`~runtimes.capabilities.ResetProof` for :class:`~.runtime.DockerBackend`,
    which reads the engine's diff (``outside_view``)."""

    config: DockerConfig

    def recycle_refusal(self) -> str | None:
        return recycle_refusal(self.config)

    def wiped_places(self) -> tuple[str, ...]:
        return (self.config.workdir or DEFAULT_WORKDIR, *WIPED_PLACES)

    def watched_places(self) -> tuple[str, ...]:
        return WATCHED_PLACES
