"""``vf-sandbox shell`` for Docker: the ``docker exec`` command line that opens a shell in a
container's workdir (the docker CLI: Debian's ``docker.io``)."""

from __future__ import annotations

import shutil
from typing import Any

from ..errors import SandboxFileNotFoundError, SandboxUnavailableError
from ..models import SandboxInfo
from .client import _blocking, _client_for
from .config import DockerConfig


def docker_cli() -> str:
    """The docker CLI's path.

    Raises:
        SandboxFileNotFoundError: it is not installed.
    """
    found = shutil.which("docker")
    if found is None:
        raise SandboxFileNotFoundError(
            "docker", "the docker CLI is not installed (Debian: apt-get install docker.io)"
        )
    return found


def _inspect_blocking(cfg: DockerConfig, container_id: str) -> dict[str, Any] | None:
    import docker.errors

    try:
        info: dict[str, Any] = _client_for(cfg).api.inspect_container(container_id)
    except docker.errors.NotFound:
        return None
    return info


async def docker_shell_argv(info: SandboxInfo, cfg: DockerConfig, *, tty: bool) -> list[str]:
    """``docker exec -i [-t] -w WORKDIR ID /bin/sh`` for a running container (``-t`` only
    when stdin is a terminal; the container's default user; ``-H`` for a ``base_url``).

    Raises:
        SandboxFileNotFoundError: the docker CLI is not installed.
        SandboxUnavailableError: the container is gone or not running.
        SandboxTransportError: the engine did not answer.
    """
    cli = docker_cli()
    inspected = await _blocking(lambda: _inspect_blocking(cfg, info.id), cfg, idempotent=True)
    if inspected is None:
        raise SandboxUnavailableError(f"docker container {info.id} is gone")
    state = inspected.get("State") or {}
    if not state.get("Running"):
        status = state.get("Status", "not running")
        raise SandboxUnavailableError(
            f"docker container {info.id} is {status}: start it first (docker start {info.id})"
        )
    workdir = (inspected.get("Config") or {}).get("WorkingDir") or "/"
    host = ["-H", cfg.base_url] if cfg.base_url else []
    terminal = ["-t"] if tty else []
    return [cli, *host, "exec", "-i", *terminal, "-w", workdir, info.id, "/bin/sh"]
