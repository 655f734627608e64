"""Building an owned sandbox's image from its config's ``build`` option, on the engine.

:func:`ensure_built` packs the context on the host (:mod:`.build_context`: bounded, no
symlink out of it), looks up the ``FROM`` images on the engine (never pulled: a missing
one is a :class:`ProvisioningError` saying how to build it), derives the tag from the
content, and builds only when the engine lacks that tag. One build per tag at a time in
this process: concurrent opens of one config wait for the first build and reuse it.

The build is one ``POST /build`` (``pull=False``, intermediate containers removed) whose
progress stream is read in a worker thread; only the last :data:`KEPT_LINES` lines (each
cut to :data:`LINE_CHARS` characters) are kept, for the error of a failed step. The caller
stops waiting after ``build.timeout`` seconds; the thread closes the connection at the next
progress event (the engine then cancels the build).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import ProvisioningError, SandboxTransportError
from .build_context import (
    BUILD_LABEL,
    BuildSpec,
    PackedContext,
    build_tag,
    context_label,
    from_images,
    pack_context,
)
from .client import engine_call, engine_name
from .sdk_errors import Refusal, engine_answers, refused

if TYPE_CHECKING:
    import docker

    from .config import DockerConfig

KEPT_LINES = 20
"""Lines of build output kept for a failed build's error."""
LINE_CHARS = 400
"""Characters kept of each such line."""

_locks_guard = threading.Lock()
_locks: dict[str, threading.Lock] = {}
builds_run = 0
"""How many builds this process ran (not cache hits): for tests and diagnostics."""


class _BuildStopped(Exception):
    """The build outlasted its deadline or its caller went away."""


def how_to_get(image: str) -> str:
    """What to do about a missing image: the project's own images are built from
    ``images/``, never pulled (no registry serves them)."""
    if image.startswith("vf-sandbox/build:"):
        return "it is a built image that was removed: opening the config builds it again"
    if image.startswith("vf-sandbox/"):
        return (
            "vf-sandbox's images are built from images/ in a vf-sandbox checkout, never "
            "pulled: run `make images` (the base image alone: `bash images/build-base.sh`), "
            'or build your own at run time with the build option ({"build": {"context": '
            '"dir"}}, a Dockerfile FROM vf-sandbox/base:bookworm)'
        )
    return (
        f"build or load it first (`docker build -t {image} DIR`, `docker load`; or let the "
        'runtime build a Dockerfile: {"build": {"context": "DIR"}}), or set pull=\'missing\' '
        "to pull it from a registry you can reach"
    )


def _lock_for(key: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(key, threading.Lock())


def _image_id(client: docker.DockerClient, image: str) -> str | None:
    import docker.errors

    with engine_answers(refused(f"cannot inspect image {image!r}", error=ProvisioningError)):
        try:
            return str(client.images.get(image).id)
        except docker.errors.ImageNotFound:
            return None


def _base_ids(
    client: docker.DockerClient, cfg: DockerConfig, packed: PackedContext
) -> dict[str, str]:
    spec = _spec(cfg)
    ids = {}
    for image in from_images(packed.dockerfile, spec.args):
        found = _image_id(client, image)
        if found is None:
            raise ProvisioningError(
                f"the build's FROM image {image!r} ({spec.dockerfile} in {spec.context!r}) is "
                f"not on {engine_name(cfg)}, and builds never pull: {how_to_get(image)}"
            )
        ids[image] = found
    return ids


def _spec(cfg: DockerConfig) -> BuildSpec:
    assert cfg.build is not None
    return cfg.build


def _run_build(
    client: docker.DockerClient,
    cfg: DockerConfig,
    packed: PackedContext,
    tag: str,
    deadline: float,
    stop: threading.Event,
) -> None:
    """One ``POST /build`` of ``packed`` tagged ``tag``, its output read (bounded).

    Raises:
        ProvisioningError: the engine refused the build or a step failed (with its last
            lines of output).
        _BuildStopped: past the deadline, or the caller went away.
    """

    global builds_run
    builds_run += 1
    spec = _spec(cfg)
    labels = {
        BUILD_LABEL: tag.rpartition(":")[2],
        f"{BUILD_LABEL}.context": context_label(spec),
    }
    lines: deque[str] = deque(maxlen=KEPT_LINES)
    api: Any = client.api
    refusal = Refusal(
        lambda message: ProvisioningError(_failed(cfg, message[: LINE_CHARS * 2], lines))
    )
    with engine_answers(refusal):
        events = api.build(
            fileobj=packed.archive,
            custom_context=True,
            tag=tag,
            dockerfile=spec.dockerfile,
            buildargs=dict(spec.args),
            target=spec.target,
            labels=labels,
            pull=False,
            rm=True,
            forcerm=True,
            decode=True,
            timeout=spec.timeout,
        )
        try:
            for event in events:
                if not isinstance(event, dict):
                    continue
                text = event.get("stream")
                if isinstance(text, str):
                    lines.extend(line[:LINE_CHARS] for line in text.splitlines() if line.strip())
                if "error" in event:
                    detail = event.get("errorDetail") or {}
                    message = str(detail.get("message") or event["error"])[: LINE_CHARS * 2]
                    raise ProvisioningError(_failed(cfg, message, lines))
                if stop.is_set() or time.monotonic() > deadline:
                    raise _BuildStopped
        finally:
            with contextlib.suppress(Exception):
                events.close()


def _failed(cfg: DockerConfig, message: str, lines: deque[str]) -> str:
    spec = _spec(cfg)
    tail = "\n".join(f"  | {line}" for line in lines)
    shown = f"; its last lines of output:\n{tail}" if tail else ""
    return f"building {spec.dockerfile} in {spec.context!r} failed: {message}{shown}"


def _ensure_built_blocking(
    client: docker.DockerClient, cfg: DockerConfig, deadline: float, stop: threading.Event
) -> str:
    packed = pack_context(_spec(cfg))
    try:
        tag = build_tag(packed, _spec(cfg), _base_ids(client, cfg, packed))
        with _lock_for(f"{engine_name(cfg)} {tag}"):
            if _image_id(client, tag) is not None:
                return tag
            _run_build(client, cfg, packed, tag, deadline, stop)
            if _image_id(client, tag) is None:
                raise ProvisioningError(
                    f"the engine reported building {tag!r}, but has no such image"
                )
            return tag
    finally:
        packed.close()


async def ensure_built(client: docker.DockerClient, cfg: DockerConfig) -> str:
    """The tag of the image built from ``cfg.build`` (built now unless the engine has it).

    Raises:
        BuildContextError: the context is refused (see :func:`.build_context.pack_context`).
        ProvisioningError: a ``FROM`` image is missing, a step failed (its last lines
            quoted), the engine refused or did not answer, or the build outlasted
            ``build.timeout``.
    """
    spec = _spec(cfg)
    stop = threading.Event()
    deadline = time.monotonic() + spec.timeout
    try:
        with anyio.fail_after(spec.timeout):
            return await engine_call(
                lambda: _ensure_built_blocking(client, cfg, deadline, stop),
                cfg,
                abandon_on_cancel=True,
            )
    except (_BuildStopped, TimeoutError):
        raise ProvisioningError(
            f"building {spec.dockerfile} in {spec.context!r} on {engine_name(cfg)} did not "
            f"finish within {spec.timeout:g}s (build.timeout)"
        ) from None
    except SandboxTransportError as exc:
        raise ProvisioningError(
            f"building {spec.dockerfile} in {spec.context!r} failed: the engine did not answer "
            f"within {cfg.api_timeout:g}s (api_timeout): {exc}"
        ) from exc
    finally:
        stop.set()
