"""Making the container of an owned sandbox, finding the one to attach to, and listing or
removing the labelled containers on an engine (``vf-sandbox ls`` / ``cleanup``).

An owned sandbox is a container from ``image`` with a keep-alive command
(``scripts/keep_alive.sh``), vf-sandbox labels (:mod:`runtimes.ownership`), no network by
default, ``docker-init`` as PID 1 when the engine has it, and the workdir, plus the
configured published ports (:mod:`.ports`), mounts (:mod:`.mounts`) and GPU requests. Images
are pulled only as the ``pull`` policy says (:mod:`.pull`).

It is hardened as the config says (``docs/docker.md``, Hardened defaults): memory without
swap, a pids limit, no-new-privileges, a minimal capability set; with ``read_only`` or
``disk`` the workdir and ``/tmp`` are anonymous volumes (tmpfs of ``disk`` MiB with a quota,
the engine's disk without), removed with the container. They are volumes, not the engine's
``tmpfs`` mounts, because the archive API (``put_archive``, ``get_archive``) sees volumes
and not ``tmpfs`` mounts.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import ownership
from ..errors import ProvisioningError, SandboxTransportError
from ..models import SandboxInfo
from ..resources import MIB
from ..scripts import load
from ..snapshot import UNTRUSTED, SandboxSnapshot
from .build import ensure_built, how_to_get
from .client import (
    client_for,
    engine_call,
    engine_has_init,
    engine_name,
    list_labelled_blocking,
    remove_container_blocking,
)
from .config import DEFAULT_CAPABILITIES, DEFAULT_WORKDIR, DockerConfig, is_root_user
from .mounts import VOLUME_LABEL, engine_mounts
from .ports import port_bindings
from .process import RunOwn, own_request
from .pull import pull_image
from .sdk_errors import Refusal, engine_answers, refused
from .snapshots import snapshot_image_config

if TYPE_CHECKING:
    import docker

_KEEP_ALIVE = ["sh", "-c", load("keep_alive", "runtimes.docker.scripts")]


@dataclass(frozen=True)
class Creation:
    """What an owned sandbox's container is created from."""

    config: DockerConfig
    """The runtime's config, or a copy naming the image built from ``build`` or, for a fork,
    its snapshot's image (never pulled)."""
    image_user: str
    """The image's configured user ("" for root)."""
    untrusted: str | None = None
    """Why a fork's image may hold an interpreter that is not the original image's (the
    snapshot's :data:`~runtimes.snapshot.UNTRUSTED` label), or ``None``."""


async def creation_config(
    client: docker.DockerClient, config: DockerConfig, snapshot: SandboxSnapshot | None
) -> Creation:
    """What to create the container from, once the engine showed the image is there
    (pulled as ``pull`` says, built from ``build``, or the ``snapshot``'s).

    Raises:
        ProvisioningError: the image is missing (see ``check_image``), or building it
            from ``build`` failed (see ``ensure_built``).
        BuildContextError: ``build``'s context is refused.
        SnapshotNotFoundError: the snapshot's image is gone.
    """
    if snapshot is None and config.build is not None:
        built = await ensure_built(client, config)
        cfg = config.model_copy(update={"image": built})
        return Creation(cfg, await check_image(client, cfg))
    if snapshot is None:
        return Creation(config, await check_image(client, config))
    settings = await snapshot_image_config(client, snapshot, config)
    labels = settings.get("Labels") or {}
    cfg = config.model_copy(update={"image": snapshot.id, "pull": "never"})
    return Creation(cfg, str(settings.get("User") or ""), labels.get(UNTRUSTED) or None)


async def create_container(
    client: docker.DockerClient,
    made: Creation,
    backend: str,
    *,
    fork: bool,
    record: Callable[[str | None], None],
) -> tuple[Any, bool]:
    """Create and start the container; return the SDK's container (not yet confirmed
    running: see ``confirm_running_blocking``) and whether docker-init is its PID 1.
    ``record`` is told the container's id as soon as the engine made it.

    Raises:
        ProvisioningError: the engine refused or did not answer.
    """
    cfg = made.config
    try:
        init = cfg.init
        if init is None:
            init = await engine_call(lambda: engine_has_init(client), cfg, idempotent=True)
        options = container_options(cfg, backend, init, fork=fork)
        if not is_root_user(made.image_user):
            # Under no-new-privileges a root exec gains no capability from a container
            # started as another user (root could not even chown the workdir): the
            # keep-alive runs as root, commands as the image's user (``ContainerRef.user``).
            options["user"] = "0"
        container = await engine_call(
            lambda: create_and_start_blocking(client, cfg, options, record), cfg
        )
    except SandboxTransportError as exc:
        raise ProvisioningError(f"cannot create a container from {cfg.image!r}: {exc}") from exc
    return container, bool(init)


async def check_image(client: docker.DockerClient, cfg: DockerConfig) -> str:
    """The image's configured user ("" for root), after pulling it as ``cfg.pull`` says:
    ``"always"`` pulls first, ``"missing"`` only if the engine lacks it, ``"never"`` never.

    Raises:
        ProvisioningError: the image is not on the engine (and not pulled), the pull
            failed or timed out, or the image could not be inspected.
    """
    if cfg.pull == "always":
        await pull_image(client, cfg)
    image = await _find_image(client, cfg)
    if image is None and cfg.pull == "missing":
        await pull_image(client, cfg)
        image = await _find_image(client, cfg)
    if image is None and cfg.pull == "never":
        raise ProvisioningError(
            f"docker image {cfg.image!r} is not present on {engine_name(cfg)} "
            f"(pull='never'): {how_to_get(cfg.image)}"
        )
    if image is None:
        raise ProvisioningError(
            f"docker image {cfg.image!r} is not present on {engine_name(cfg)} after pulling it"
        )
    settings = image.attrs.get("Config") or {}
    return str(settings.get("User") or "")


async def _find_image(client: docker.DockerClient, cfg: DockerConfig) -> Any | None:
    """The engine's image ``cfg.image``, or ``None``.

    Raises:
        ProvisioningError: the image could not be inspected.
    """
    import docker.errors

    def find() -> Any | None:
        try:
            return client.images.get(cfg.image)
        except docker.errors.ImageNotFound:
            return None

    refusal = refused(f"cannot inspect image {cfg.image!r}", error=ProvisioningError)
    try:
        return await engine_call(find, cfg, idempotent=True, refusal=refusal)
    except SandboxTransportError as exc:
        raise ProvisioningError(f"cannot inspect image {cfg.image!r}: {exc}") from exc


def container_options(
    cfg: DockerConfig, backend: str, init: bool, *, fork: bool = False
) -> dict[str, Any]:
    """The engine's create options for an owned sandbox (``fork``: from a snapshot's image,
    whose labels the container inherits under its own)."""
    name = f"{cfg.name_prefix}-{uuid.uuid4().hex[:12]}"
    labels = ownership.ownership_labels(backend, cfg.labels, keep=cfg.keep)
    if fork:  # never kept because its snapshot was
        labels[ownership.KEEP] = "true" if cfg.keep else "false"
    options: dict[str, Any] = {
        "command": _KEEP_ALIVE,
        "detach": True,
        "labels": labels,
        "network_mode": cfg.network,
        "working_dir": cfg.workdir or DEFAULT_WORKDIR,
        "name": name,
        "init": init or None,
    }
    if cfg.hostname:
        options["hostname"] = cfg.hostname
    if cfg.cpus is not None:
        options["nano_cpus"] = int(cfg.cpus * 1e9)
    if cfg.memory is not None:
        options["mem_limit"] = cfg.memory * MIB
        options["memswap_limit"] = (cfg.memory_swap or cfg.memory) * MIB
    if cfg.pids_limit is not None:
        options["pids_limit"] = cfg.pids_limit
    if cfg.ports:
        options["ports"] = port_bindings(cfg.ports)
    mounts = writable_mounts(cfg)
    if cfg.mounts:
        mounts += engine_mounts(cfg.mounts, {**options["labels"], VOLUME_LABEL: name})
    if mounts:
        options["mounts"] = mounts
    if cfg.gpus is not None:
        options["device_requests"] = [gpu_request(cfg.gpus)]
    options.update(hardening_options(cfg))
    return options


def hardening_options(cfg: DockerConfig) -> dict[str, Any]:
    """The create options of ``security_opt``, ``capabilities``/``cap_add``, ``read_only``
    and ``runtime``."""
    options: dict[str, Any] = {}
    if cfg.security_opt:
        options["security_opt"] = list(cfg.security_opt)
    added = list(cfg.cap_add)
    if cfg.capabilities == "hardened":
        options["cap_drop"] = ["ALL"]
        added = [*DEFAULT_CAPABILITIES, *(c for c in added if c not in DEFAULT_CAPABILITIES)]
    if added:
        options["cap_add"] = added
    if cfg.read_only:
        options["read_only"] = True
    if cfg.runtime is not None:
        options["runtime"] = cfg.runtime
    return options


def writable_mounts(cfg: DockerConfig) -> list[Any]:
    """With ``disk``: the workdir and ``/tmp`` as anonymous tmpfs volumes of ``disk`` MiB
    each. With ``read_only`` alone: as anonymous volumes on the engine's disk. Else none."""
    if cfg.disk is None and not cfg.read_only:
        return []
    workdir = cfg.workdir or DEFAULT_WORKDIR
    return [
        _anonymous_volume(workdir, cfg.disk, "0755"),
        _anonymous_volume("/tmp", cfg.disk, "1777"),
    ]


def _anonymous_volume(target: str, size_mib: int | None, mode: str) -> Any:
    """An anonymous volume at ``target`` (removed with the container): tmpfs bounded to
    ``size_mib`` when given (writes past it fail with ENOSPC), else the engine's disk."""
    import docker.types

    if size_mib is None:
        return docker.types.Mount(target, None, type="volume")
    tmpfs = {"type": "tmpfs", "device": "tmpfs", "o": f"size={size_mib}m,mode={mode}"}
    return docker.types.Mount(
        target, None, type="volume", driver_config=docker.types.DriverConfig("local", tmpfs)
    )


def gpu_request(gpus: str | int | tuple[str, ...]) -> Any:
    """The Engine API's ``DeviceRequest`` for ``gpus``: ``"all"``, a count or device ids."""
    import docker.types

    if gpus == "all":
        return docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])
    if isinstance(gpus, int):
        return docker.types.DeviceRequest(count=gpus, capabilities=[["gpu"]])
    return docker.types.DeviceRequest(device_ids=list(gpus), capabilities=[["gpu"]])


def create_and_start_blocking(
    client: docker.DockerClient,
    cfg: DockerConfig,
    options: dict[str, Any],
    record: Callable[[str | None], None],
) -> Any:
    """Create then start; ``record`` gets the id before start, so close() can remove it.

    Raises:
        ProvisioningError: the image is missing, the engine does not offer the OCI
            ``runtime`` asked for (naming the ones it offers), or the engine refused.
        SandboxTransportError: the engine did not answer.
    """
    import docker.errors

    refusal = Refusal(
        lambda message: ProvisioningError(
            f"the engine refused to run a container from {cfg.image!r}: {message}"
            + _gpu_hint(cfg, message)
        )
    )
    with engine_answers(refusal):
        try:
            if cfg.runtime is not None:
                check_oci_runtime(client.api.info(), cfg)
            container = client.containers.create(cfg.image, **options)
            record(container.id)
            container.start()
        except docker.errors.ImageNotFound:
            raise ProvisioningError(
                f"docker image {cfg.image!r} is not present (never pulled): {how_to_get(cfg.image)}"
            ) from None
    return container


def check_oci_runtime(info: dict[str, Any], cfg: DockerConfig) -> None:
    """Refuse ``cfg.runtime`` unless the engine's ``/info`` lists it under ``Runtimes``.

    Raises:
        ProvisioningError: the engine does not offer it; the message names the ones it does.
    """
    offered = sorted(info.get("Runtimes") or {})
    if cfg.runtime in offered:
        return
    default = info.get("DefaultRuntime")
    raise ProvisioningError(
        f"{engine_name(cfg)} offers no OCI runtime {cfg.runtime!r} (runtime=...): it offers "
        f"{', '.join(map(repr, offered)) or 'none'}"
        + (f" (default {default!r})" if default else "")
        + "; install it on the engine's host and register it under 'runtimes' in "
        "/etc/docker/daemon.json, or pick one of these"
    )


def _gpu_hint(cfg: DockerConfig, message: str) -> str:
    """What to do when the engine cannot give the requested GPUs."""
    if cfg.gpus is None or ("device driver" not in message and "gpu" not in message.lower()):
        return ""
    return (
        f" (gpus={cfg.gpus!r}: the engine has no GPU runtime or not the GPUs asked for; "
        "install the NVIDIA Container Toolkit on the engine's host, or drop gpus)"
    )


def confirm_running_blocking(container: Any, image: str) -> None:
    """A container whose command exited at once (an ENTRYPOINT that ignores its
    arguments, say) is a ProvisioningError carrying its last log lines."""
    with engine_answers(
        refused(f"the container from {image!r} vanished after start", error=ProvisioningError)
    ):
        container.reload()
    if container.status != "running":
        logs = container.logs(tail=20).decode("utf-8", "replace").strip()
        raise ProvisioningError(
            f"the container from {image!r} did not keep running "
            f"({container.status}): {logs or 'no output'}"
        )


async def inspect_attached(client: docker.DockerClient, cfg: DockerConfig) -> dict[str, Any]:
    """The engine's inspection of the running container ``cfg.container``.

    Raises:
        ProvisioningError: no such container, it is not running, or it could not be inspected.
    """
    import docker.errors

    api = client.api
    name = cfg.container
    assert name is not None

    def inspect() -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = api.inspect_container(name)
        except docker.errors.NotFound:
            return None
        return found

    doing = f"cannot inspect docker container {cfg.container!r}"
    try:
        info = await engine_call(
            inspect, cfg, idempotent=True, refusal=refused(doing, error=ProvisioningError)
        )
    except SandboxTransportError as exc:
        raise ProvisioningError(f"{doing}: {exc}") from exc
    if info is None:
        raise ProvisioningError(f"no docker container {cfg.container!r} to attach to")
    state = info.get("State") or {}
    if not state.get("Running") or state.get("Paused"):
        raise ProvisioningError(
            f"docker container {name!r} is not running ({state.get('Status', '?')})"
        )
    return info


async def list_sandboxes(config: DockerConfig, backend: str) -> list[SandboxInfo]:
    """Every container carrying the ``vf-sandbox.session`` label on the engine.

    Raises:
        SandboxTransportError: the engine did not answer (after retries).
    """
    return await engine_call(
        lambda: list_labelled_blocking(client_for(config).api, backend), config, idempotent=True
    )


async def destroy_sandbox(info: SandboxInfo, config: DockerConfig) -> None:
    """Force-remove one container :func:`list_sandboxes` found (gone already is fine).

    Raises:
        SandboxTransportError: the engine did not answer (after retries).
        SandboxError: the engine refused to remove it.
    """
    await engine_call(
        lambda: remove_container_blocking(
            client_for(config).api, info.id, f"docker container {info.id}"
        ),
        config,
        idempotent=True,
    )


_MKDIRS = load("mkdirs", "runtimes.docker.scripts")


async def prepare_workdir(
    run: RunOwn, workdir: str, owner: str, need_dir: bool, where: str
) -> None:
    """One root exec (through ``run``) that creates ``workdir`` owned by ``owner`` ("":
    root) when ``need_dir``, and otherwise only proves that exec works.

    Raises:
        ProvisioningError: the exec failed.
    """
    argv = ["sh", "-c", _MKDIRS, "sh", workdir, owner] if need_dir else ["true"]
    request, sink = own_request(argv, user="0")
    code = await run(request, sink)
    if code != 0:
        raise ProvisioningError(
            f"{where}: preparing {workdir!r} failed ({code}): "
            f"{bytes(sink.stderr).decode('utf-8', 'replace').strip()}"
        )
