"""Making the container of an owned sandbox, or finding the one to attach to.

An owned sandbox is a container from ``image`` with a keep-alive command
(``scripts/keep_alive.sh``), vf-sandbox labels (:mod:`runtimes.ownership`), no network by
default, ``docker-init`` as PID 1 when the engine has it, and the workdir. Images are never
pulled.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import ownership
from ..errors import ProvisioningError, SandboxTransportError
from ..scripts import load
from .client import _api_message, _blocking, _engine_name
from .config import DEFAULT_WORKDIR, DockerConfig

if TYPE_CHECKING:
    import docker

_KEEP_ALIVE = ["sh", "-c", load("keep_alive", "runtimes.docker.scripts")]


async def check_image(client: docker.DockerClient, cfg: DockerConfig) -> str:
    """The image's configured user ("" for root); never pulls.

    Raises:
        ProvisioningError: the image is not on the engine, or could not be inspected.
    """
    import docker.errors

    try:
        image = await _blocking(lambda: client.images.get(cfg.image), cfg, idempotent=True)
    except docker.errors.ImageNotFound:
        raise ProvisioningError(
            f"docker image {cfg.image!r} is not present on {_engine_name(cfg)} "
            "(images are never pulled: build or load it first)"
        ) from None
    except docker.errors.APIError as exc:
        raise ProvisioningError(f"cannot inspect image {cfg.image!r}: {_api_message(exc)}") from exc
    except SandboxTransportError as exc:
        raise ProvisioningError(f"cannot inspect image {cfg.image!r}: {exc}") from exc
    settings = image.attrs.get("Config") or {}
    return str(settings.get("User") or "")


def container_options(cfg: DockerConfig, backend: str, init: bool) -> dict[str, Any]:
    """The engine's create options for an owned sandbox."""
    options: dict[str, Any] = {
        "command": _KEEP_ALIVE,
        "detach": True,
        "labels": ownership.session_labels(backend, cfg.labels),
        "network_mode": cfg.network,
        "working_dir": cfg.workdir or DEFAULT_WORKDIR,
        "name": f"{cfg.name_prefix}-{uuid.uuid4().hex[:12]}",
        "init": init or None,
    }
    if cfg.hostname:
        options["hostname"] = cfg.hostname
    if cfg.cpu is not None:
        options["nano_cpus"] = int(cfg.cpu * 1e9)
    if cfg.memory is not None:
        options["mem_limit"] = cfg.memory
    if cfg.pids_limit is not None:
        options["pids_limit"] = cfg.pids_limit
    return options


def create_and_start_blocking(
    client: docker.DockerClient,
    cfg: DockerConfig,
    options: dict[str, Any],
    record: Callable[[str | None], None],
) -> Any:
    """Create then start; ``record`` gets the id before start, so close() can remove it.

    Raises:
        ProvisioningError: the image is missing, or the engine refused.
    """
    import docker.errors

    try:
        container = client.containers.create(cfg.image, **options)
        record(container.id)
        container.start()
    except docker.errors.ImageNotFound:
        raise ProvisioningError(
            f"docker image {cfg.image!r} is not present (never pulled)"
        ) from None
    except docker.errors.APIError as exc:
        raise ProvisioningError(
            f"the engine refused to run a container from {cfg.image!r}: {_api_message(exc)}"
        ) from exc
    return container


def confirm_running_blocking(container: Any, image: str) -> None:
    """A container whose command exited at once (an ENTRYPOINT that ignores its
    arguments, say) is a ProvisioningError carrying its last log lines."""
    import docker.errors

    try:
        container.reload()
    except docker.errors.APIError as exc:
        raise ProvisioningError(
            f"the container from {image!r} vanished after start: {_api_message(exc)}"
        ) from exc
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
    try:
        info: dict[str, Any] = await _blocking(
            lambda: api.inspect_container(name), cfg, idempotent=True
        )
    except docker.errors.NotFound:
        raise ProvisioningError(f"no docker container {cfg.container!r} to attach to") from None
    except (docker.errors.APIError, SandboxTransportError) as exc:
        raise ProvisioningError(
            f"cannot inspect docker container {cfg.container!r}: {exc}"
        ) from exc
    state = info.get("State") or {}
    if not state.get("Running") or state.get("Paused"):
        raise ProvisioningError(
            f"docker container {name!r} is not running ({state.get('Status', '?')})"
        )
    return info
