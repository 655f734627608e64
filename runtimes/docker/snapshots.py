"""Snapshots of Docker sandboxes: the container committed to a labelled image.

:func:`commit_snapshot` commits the container (paused meanwhile; its config — user, working
directory, environment — kept, the snapshot's labels added). The image is tagged
``vf-sandbox-snapshot:<token>`` and carries the session labels of the process that took it,
so ``vf-sandbox ls`` lists it and ``vf-sandbox cleanup`` removes it once that process is gone.

The image holds whatever the sandbox's commands left: that is the point of a fork. What the
runtime's own machinery needs from it is checked. A container whose policy ran under an
account of its own all its life (an owned container with a root default user and a
``policy_user``) can only have had its system files changed by the host's own root commands:
its image is trusted as is. Otherwise (the policy ran as the default user, an attached
container) the engine's diff of the paused container is read before the commit: a changed
``python*`` on the container's ``PATH``, shared library, Python standard library file or
``/etc/ld.so*`` marks the snapshot untrusted (:data:`~runtimes.snapshot.UNTRUSTED`), along the
whole chain of snapshots; a fork's channel then never runs the image's interpreter (it is
distrusted from the start and the plain path serves, as for an attached container).
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from .. import ownership
from ..errors import SandboxError, SandboxInvalidArgumentError
from ..reaper import wait_for_removals, wait_for_removals_blocking
from ..snapshot import (
    SNAPSHOT,
    UNTRUSTED,
    SandboxSnapshot,
    SnapshotNotFoundError,
    SnapshotUnsupportedError,
    snapshot_from_labels,
)
from .agent import untrusted_change
from .client import (
    ContainerRef,
    changed_paths,
    client_for,
    engine_call,
    inspect_container,
)
from .config import DockerConfig
from .sdk_errors import Refusal, api_message, api_status, engine_answers, refused

if TYPE_CHECKING:
    import docker

log = logging.getLogger("runtimes.docker")

REPOSITORY = "vf-sandbox-snapshot"
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def path_dirs(info: Mapping[str, Any]) -> list[str]:
    """The directories of the container's ``PATH`` (its config's environment), absolute
    (the agent starts in ``/``, so a relative entry is under it)."""
    value = _DEFAULT_PATH
    for entry in (info.get("Config") or {}).get("Env") or []:
        if str(entry).startswith("PATH="):
            value = str(entry)[5:]
    return [posixpath.normpath(posixpath.join("/", part or ".")) for part in value.split(":")]


def untrusted_interpreter(changed: Sequence[str], dirs: Sequence[str]) -> str | None:
    """Why a container's changes (the engine's diff) make the ``python3`` a fork would run
    untrustworthy, or ``None``: a system library, the standard library or the loader's
    configuration (as before a channel restart), a ``python*`` in a ``PATH`` directory, or a
    ``PATH`` directory changed itself (replaced by a link, say)."""
    reason = untrusted_change(list(changed), {})
    if reason is not None:
        return reason
    searched = set(dirs)
    parents = {posixpath.dirname(path) for path in changed}
    for path in changed:
        if posixpath.dirname(path) in searched and posixpath.basename(path).startswith("python"):
            return f"{path} changed in the snapshotted container"
        if path in searched and path not in parents:
            return f"{path} (a PATH directory) changed in the snapshotted container"
    return None


async def _pause(ref: ContainerRef) -> bool:
    """Pause the container; ``False`` when it was paused already (by someone else).

    Raises:
        SandboxUnavailableError: the container is gone or stopped.
    """
    import docker.errors

    def pause() -> bool:
        try:
            ref.api.pause(ref.id)
        except docker.errors.APIError as exc:
            if "already paused" in api_message(exc).lower():
                return False
            raise
        return True

    refusal = refused("the engine refused to pause it", subject=ref.describe)
    return await engine_call(pause, ref.config, refusal=refusal)


async def _unpause(ref: ContainerRef) -> None:
    """Unpause the container; unpaused or removed meanwhile is fine.

    Raises:
        SandboxError: the engine refused (the sandbox stays paused: its calls fail as
            unavailable until it is unpaused).
    """
    import docker.errors

    def unpause() -> None:
        try:
            ref.api.unpause(ref.id)
        except docker.errors.APIError as exc:
            if api_status(exc) == 404 or "not paused" in api_message(exc).lower():
                return
            raise

    # No "gone" reading: removed meanwhile is fine (404), and 409 says "not paused".
    refusal = refused(f"{ref.describe}: could not unpause it")
    await engine_call(unpause, ref.config, idempotent=True, refusal=refusal)


async def commit_snapshot(
    ref: ContainerRef, labels: dict[str, str], inherited: str | None, *, check: bool
) -> SandboxSnapshot:
    """Commit the container to a snapshot image (see the module). ``inherited``: the untrusted
    reason of the snapshot the container was opened from; ``check``: read the engine's diff
    (paused, so that the image holds what was read), else commit it as trusted (the engine
    pauses it during the commit all the same).

    Raises:
        SandboxUnavailableError: the container is gone or stopped.
        SandboxTransportError: the engine did not answer.
        SandboxError: the engine refused to commit.
    """
    if inherited is not None or not check:
        return await _commit(ref, {**labels, UNTRUSTED: inherited or ""}, pause=True)
    dirs = path_dirs(await inspect_container(ref))
    paused = await _pause(ref)
    try:
        untrusted = untrusted_interpreter(await changed_paths(ref), dirs)
        snapshot = await _commit(ref, {**labels, UNTRUSTED: untrusted or ""}, pause=False)
    except BaseException:
        if paused:
            with anyio.CancelScope(shield=True):
                await _unpause_quietly(ref)
        raise
    if paused:
        with anyio.CancelScope(shield=True):
            await _unpause(ref)
    return snapshot


async def _commit(ref: ContainerRef, labels: dict[str, str], *, pause: bool) -> SandboxSnapshot:
    """``docker commit`` with the snapshot's tag and labels (its own timeout: a big change
    takes a while to archive).

    Raises:
        SandboxUnavailableError: the container is gone or stopped.
        SandboxError: the engine refused.
    """

    patient = ref.config.model_copy(update={"api_timeout": ref.config.snapshot_timeout})

    def commit() -> str:
        done = client_for(patient).api.commit(
            ref.id,
            repository=REPOSITORY,
            tag=labels[SNAPSHOT],
            pause=pause,
            # A sandbox of a non-root user runs its keep-alive as root (see _create_container):
            # the image records the sandbox's user, for its forks to run as.
            conf={"Labels": labels, **({"User": ref.user} if ref.user else {})},
        )
        return str(done["Id"])

    refusal = refused("the engine refused to commit it", subject=ref.describe)
    image_id = await engine_call(commit, ref.config, refusal=refusal)
    return snapshot_from_labels("docker", image_id, labels, "filesystem")


async def _unpause_quietly(ref: ContainerRef) -> None:
    """Unpause after a failed commit (whose error propagates): a failure is logged."""
    try:
        await _unpause(ref)
    except SandboxError as exc:
        log.warning("%s; unpause it with `docker unpause %s`", exc, ref.id)


async def snapshot_image_config(
    client: docker.DockerClient, snapshot: SandboxSnapshot, cfg: DockerConfig
) -> dict[str, Any]:
    """The ``Config`` of the snapshot's image on the engine (labels, user): a fork's start
    checks it is there.

    Raises:
        SnapshotNotFoundError: no such image, or one that is not a vf-sandbox snapshot.
        SandboxTransportError: the engine did not answer.
    """
    import docker.errors

    api: Any = client.api

    def inspect() -> dict[str, Any] | None:
        try:
            attrs: dict[str, Any] = api.inspect_image(snapshot.id)
        except docker.errors.NotFound:
            return None
        return attrs

    refusal = refused(
        f"cannot inspect the image of {snapshot.describe()}", error=SnapshotNotFoundError
    )
    attrs = await engine_call(inspect, cfg, idempotent=True, refusal=refusal)
    if attrs is None:
        raise SnapshotNotFoundError(
            f"{snapshot.describe()} is gone: no image {snapshot.id} on the engine"
        )
    settings: dict[str, Any] = attrs.get("Config") or {}
    if not (settings.get("Labels") or {}).get(SNAPSHOT):
        raise SnapshotNotFoundError(f"image {snapshot.id} is not a vf-sandbox snapshot")
    return settings


def list_snapshot_images_blocking(api: Any) -> list[SandboxSnapshot]:
    """Every image carrying the ``vf-sandbox.snapshot`` label of the docker backend."""
    found = []
    for entry in api.images(filters={"label": SNAPSHOT}):
        labels = {str(k): str(v) for k, v in (entry.get("Labels") or {}).items()}
        if labels.get(ownership.BACKEND) == "docker" and labels.get(SNAPSHOT):
            found.append(snapshot_from_labels("docker", str(entry["Id"]), labels, "filesystem"))
    return found


def remove_snapshot_image_blocking(api: Any, snapshot: SandboxSnapshot) -> None:
    """Remove a snapshot's image; gone already is fine.

    Raises:
        SandboxInvalidArgumentError: the image is not a vf-sandbox snapshot (left alone).
        SandboxError: the engine refused: a container (a fork) still uses it.
    """
    import docker.errors

    try:
        attrs = api.inspect_image(snapshot.id)
    except docker.errors.NotFound:
        return
    labels = (attrs.get("Config") or {}).get("Labels") or {}
    if not labels.get(SNAPSHOT):
        raise SandboxInvalidArgumentError(f"image {snapshot.id} is not a vf-sandbox snapshot")
    in_use = Refusal(
        lambda message: SandboxError(
            f"could not remove {snapshot.describe()}: {message} (a sandbox opened "
            "from it still uses it: close it first)"
        )
    )
    with engine_answers(in_use), contextlib.suppress(docker.errors.NotFound):
        api.remove_image(snapshot.id)


def check_snapshot_holds_the_workdir(config: DockerConfig, describe: str) -> None:
    """Refuse a snapshot that would silently lose the workdir and ``/tmp``: with ``disk``
    or ``read_only`` they are anonymous volumes, and a commit holds only the container's
    own layer (a fork would start with both empty).

    Raises:
        SnapshotUnsupportedError: the config has ``disk`` or ``read_only``.
    """
    why = [
        name
        for name, on in (("disk", config.disk is not None), ("read_only", config.read_only))
        if on
    ]
    if why:
        raise SnapshotUnsupportedError(
            f"{describe} cannot be snapshotted: with {' and '.join(why)} its "
            "workdir and /tmp are volumes, which the engine's commit leaves out (a fork "
            "would start with both empty); copy what you need with rt.download(), or "
            "run without disk/read_only to snapshot"
        )


async def list_snapshots(config: DockerConfig) -> list[SandboxSnapshot]:
    """Every image carrying the ``vf-sandbox.snapshot`` label on the engine.

    Raises:
        SandboxTransportError: the engine did not answer (after retries).
    """
    return await engine_call(
        lambda: list_snapshot_images_blocking(client_for(config).api), config, idempotent=True
    )


async def destroy_snapshot(snapshot: SandboxSnapshot, config: DockerConfig) -> None:
    """Remove a snapshot's image (gone already is fine), once the forks closed just
    before (their removals in the background) no longer hold it.

    Raises:
        SandboxInvalidArgumentError: the image is not a vf-sandbox snapshot.
        SandboxError: a container (a sandbox opened from it) still uses it.
        SandboxTransportError: the engine did not answer (after retries).
    """
    await wait_for_removals()
    await engine_call(
        lambda: remove_snapshot_image_blocking(client_for(config).api, snapshot),
        config,
        idempotent=True,
    )


def destroy_snapshot_at_exit(snapshot: SandboxSnapshot, config: DockerConfig) -> None:
    """:func:`destroy_snapshot`, blocking (at interpreter exit)."""
    wait_for_removals_blocking()
    remove_snapshot_image_blocking(client_for(config).api, snapshot)
