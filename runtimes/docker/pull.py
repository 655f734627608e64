"""Pulling the image of an owned sandbox (``pull="missing"`` or ``"always"``).

The pull is one ``POST /images/create`` whose progress stream is read in a worker thread:
the caller stops waiting after ``pull_timeout`` seconds, and the connection is closed
(the engine then abandons the pull) at the next progress event or when a read has waited
``api_timeout`` seconds. An ``error`` in the stream is the registry's refusal. Every
failure is :class:`ProvisioningError`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import ProvisioningError, SandboxTransportError
from .build import how_to_get
from .client import engine_call, engine_name
from .config import DockerConfig
from .sdk_errors import Refusal, engine_answers

if TYPE_CHECKING:
    import docker


class _PullStopped(Exception):
    """The pull outlasted its deadline or its caller went away."""


def _split_reference(image: str) -> tuple[str, str]:
    """``repo[:tag][@digest]`` as the engine's ``fromImage`` and ``tag`` (``latest`` if none)."""
    from docker.utils import parse_repository_tag

    repo, tag = parse_repository_tag(image)
    return repo, tag or "latest"


def _pull_failed(cfg: DockerConfig, reason: str) -> str:
    """A failed pull's message; the project's own images are in no registry: how to build."""
    message = f"pulling {cfg.image!r} failed: {reason}"
    if cfg.image.startswith("vf-sandbox/"):
        message += f"; {how_to_get(cfg.image)}"
    return message


def _pull_blocking(
    client: docker.DockerClient, cfg: DockerConfig, deadline: float, stop: threading.Event
) -> None:
    import docker.auth
    import docker.errors

    api: Any = client.api  # private helpers: the SDK's pull() has no read timeout
    repo, tag = _split_reference(cfg.image)
    registry, _ = docker.auth.resolve_repository_name(repo)
    headers = {}
    auth = docker.auth.get_config_header(api, registry)
    if auth:
        headers["X-Registry-Auth"] = auth
    response = api._post(
        api._url("/images/create"),
        params={"fromImage": repo, "tag": tag},
        headers=headers,
        stream=True,
        timeout=cfg.api_timeout,
    )
    try:
        with engine_answers(Refusal(lambda message: ProvisioningError(_pull_failed(cfg, message)))):
            api._raise_for_status(response)
            for event in api._stream_helper(response, decode=True):
                if "error" in event:
                    detail = event.get("errorDetail") or {}
                    raise ProvisioningError(
                        _pull_failed(cfg, str(detail.get("message") or event["error"]))
                    )
                if stop.is_set() or time.monotonic() > deadline:
                    raise _PullStopped
    finally:
        with contextlib.suppress(Exception):
            response.close()


async def pull_image(client: docker.DockerClient, cfg: DockerConfig) -> None:
    """Pull ``cfg.image`` onto the engine, within ``cfg.pull_timeout`` seconds.

    Raises:
        ProvisioningError: the registry refused or lacks the image, it did not answer, or
            the pull did not finish in time.
    """
    stop = threading.Event()
    deadline = time.monotonic() + cfg.pull_timeout
    try:
        # An abandoned thread closes the connection (ending the engine's pull) once it
        # sees ``stop``: at its next progress event, or when its read times out.
        with anyio.fail_after(cfg.pull_timeout):
            await engine_call(
                lambda: _pull_blocking(client, cfg, deadline, stop), cfg, abandon_on_cancel=True
            )
    except (_PullStopped, TimeoutError):
        raise ProvisioningError(
            f"pulling {cfg.image!r} onto {engine_name(cfg)} did not finish within "
            f"{cfg.pull_timeout:g}s (pull_timeout)"
        ) from None
    except SandboxTransportError as exc:
        raise ProvisioningError(
            f"pulling {cfg.image!r} failed: no progress within {cfg.api_timeout:g}s "
            f"(api_timeout; the engine or the registry is not answering): {exc}"
        ) from exc
    finally:
        stop.set()
