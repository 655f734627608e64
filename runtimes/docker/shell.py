"""``vf-sandbox shell`` for Docker: the ``docker exec`` command line that opens a shell in a
container's workdir (the docker CLI: Debian's ``docker.io``): ``/bin/bash`` when the container
has it, else ``/bin/sh``."""

from __future__ import annotations

import shutil
from typing import Any

from ..errors import SandboxError, SandboxFileNotFoundError, SandboxUnavailableError
from ..machinery import MACHINERY_CWD, MACHINERY_ENV
from ..models import SandboxInfo
from .client import client_for, engine_call
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
        info: dict[str, Any] = client_for(cfg).api.inspect_container(container_id)
    except docker.errors.NotFound:
        return None
    return info


BASH = "/bin/bash"
PROBE_SECONDS = 5.0
"""How long the bash probe may take before the shell falls back to ``/bin/sh``."""


def _has_bash_blocking(cfg: DockerConfig, container_id: str) -> bool:
    import docker.errors

    try:
        api = client_for(cfg).api
        created = api.exec_create(
            container_id,
            ["test", "-x", BASH],
            user="0",
            workdir=MACHINERY_CWD,
            environment=dict(MACHINERY_ENV),
        )
        api.exec_start(str(created["Id"]))
        code = api.exec_inspect(str(created["Id"])).get("ExitCode")
    except docker.errors.DockerException:
        return False
    return code == 0


async def shell_program(cfg: DockerConfig, container_id: str) -> str:
    """``/bin/bash`` when the container has an executable one, else ``/bin/sh``.

    The probe is ``test -x /bin/bash`` run as the machinery runs (root, ``cwd /``, the fixed
    :data:`~runtimes.machinery.MACHINERY_PATH`, no start-up files): nothing a policy put on the
    image's ``PATH`` runs. Any failure of the probe (no ``test``, an engine error, no answer
    within :data:`PROBE_SECONDS`) means ``/bin/sh``; it never raises.
    """
    import anyio

    found = False
    with anyio.move_on_after(PROBE_SECONDS):
        try:
            found = await engine_call(
                lambda: _has_bash_blocking(cfg, container_id), cfg, abandon_on_cancel=True
            )
        except SandboxError:  # the engine did not answer: the shell's own start will say so
            found = False
    return BASH if found else "/bin/sh"


async def docker_shell_argv(info: SandboxInfo, cfg: DockerConfig, *, tty: bool) -> list[str]:
    """``docker exec -i [-t] -w WORKDIR ID SHELL`` for a running container: SHELL is
    ``/bin/bash`` when it has one (:func:`shell_program`), else ``/bin/sh``; ``-t`` only
    when stdin is a terminal; the container's default user; ``-H`` for a ``base_url``.

    Raises:
        SandboxFileNotFoundError: the docker CLI is not installed.
        SandboxUnavailableError: the container is gone or not running.
        SandboxTransportError: the engine did not answer.
    """
    cli = docker_cli()
    inspected = await engine_call(lambda: _inspect_blocking(cfg, info.id), cfg, idempotent=True)
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
    shell = await shell_program(cfg, info.id)
    return [cli, *host, "exec", "-i", *terminal, "-w", workdir, info.id, shell]
