"""The ``docker`` runtime's config model (:class:`DockerConfig`)."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..config import RuntimeConfig, absolute_workdir
from ..policy import DEFAULT_POLICY_USER, validate_policy_user
from ..resources import LIMIT_FIELDS
from .mounts import MountSpec, check_mounts
from .ports import PortSpec, check_ports, parse_port

DEFAULT_IMAGE = "vf-sandbox/base:bookworm"
DEFAULT_WORKDIR = "/work"

_BASE_URL = re.compile(r"^(unix|tcp|ssh|http|https|npipe)://")


class DockerConfig(RuntimeConfig):
    """Config of the ``docker`` runtime.

    Owned sandboxes (no ``container``): a fresh container from ``image`` per runtime,
    removed on close. Attach mode (``container`` = a running container's id or name):
    the runtime borrows it and leaves it running on close.

    ``workdir`` defaults to ``/work`` (created) for owned sandboxes; in attach mode to the
    container's ``WorkingDir``, else ``/``. ``user`` is the default user of commands (and
    of file operations): the host's machinery runs as it. ``policy_user`` is the account a
    rollout's policy runs as (``exec(user=rt.policy_user)``), made on first use in an owned
    container whose default user is root; ``None`` runs the policy as the default user
    (``docs/security.md``). ``cpus``, ``memory`` (MiB or ``"512MiB"``, ``"2GiB"``,
    ``"512m"``) and ``pids_limit`` are the common limits (``docs/resources.md``). ``network``
    is ``"none"`` (default), ``"default"``/``"bridge"`` (the engine's outbound network),
    ``"host"`` or a network's name. ``base_url`` is ``unix://...``, ``tcp://host:port`` or
    ``ssh://user@host`` (paramiko); unset means ``DOCKER_HOST`` or the local socket.
    ``max_live`` caps the live sandboxes of this process (all docker configs share one
    count), ``creations_per_second`` paces creations; ``None`` disables the pacing.
    ``ports`` (published on ``127.0.0.1`` by default; needs a network), ``mounts`` (bind
    mounts, volumes), ``gpus`` and ``pull`` (``never``/``missing``/``always``, bounded by
    ``pull_timeout``) apply to owned sandboxes (``docs/docker.md``). ``snapshot_timeout``
    bounds the engine's commit of ``rt.snapshot()`` (``docs/snapshots.md``).
    """

    enforced_limits: ClassVar[frozenset[str]] = frozenset(LIMIT_FIELDS)

    type: Literal["docker"] = "docker"
    image: str = DEFAULT_IMAGE
    container: str | None = None
    user: str | None = None
    policy_user: str | None = DEFAULT_POLICY_USER
    network: str = "none"
    hostname: str | None = None
    init: bool | None = Field(
        default=None, description="docker-init as PID 1; None: if the engine has it"
    )
    base_url: str | None = None
    api_timeout: float = Field(default=60.0, gt=0, description="seconds for one Engine API call")
    start_timeout: float = Field(default=60.0, gt=0)
    retries: int = Field(default=3, ge=0, description="extra attempts of idempotent calls")
    max_live: int = Field(default=64, ge=1)
    creations_per_second: float | None = Field(default=10.0, gt=0)
    name_prefix: str = "vf-sandbox"
    channel: bool = Field(
        default=True,
        description="run commands and files through a persistent in-sandbox agent (python3)",
    )
    ports: tuple[PortSpec, ...] = Field(
        default=(), description="container ports to publish (host side: 127.0.0.1, any port)"
    )
    mounts: tuple[MountSpec, ...] = Field(default=(), description="bind mounts and volumes")
    gpus: Literal["all"] | int | tuple[str, ...] | None = Field(
        default=None, description="GPUs to request: 'all', a count or device ids"
    )
    pull: Literal["never", "missing", "always"] = Field(
        default="never", description="when to pull image from its registry"
    )
    pull_timeout: float = Field(default=600.0, gt=0, description="seconds one pull may take")
    snapshot_timeout: float = Field(
        default=600.0, gt=0, description="seconds the engine may take to commit a snapshot"
    )

    _absolute_workdir = field_validator("workdir")(absolute_workdir)
    _plain_policy_user = field_validator("policy_user")(validate_policy_user)

    @field_validator("ports", mode="before")
    @classmethod
    def _port_shorthands(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            return tuple(parse_port(entry) for entry in value)
        return value

    @field_validator("ports", "mounts", "gpus", "pull")
    @classmethod
    def _owned_only(cls, value: object, info: ValidationInfo) -> object:
        if info.data.get("container") and value not in ((), None, "never"):
            raise ValueError(
                f"{info.field_name} applies to sandboxes this runtime creates, not to an "
                "attached container (container=...)"
            )
        return value

    @field_validator("ports")
    @classmethod
    def _publishable(
        cls, value: tuple[PortSpec, ...], info: ValidationInfo
    ) -> tuple[PortSpec, ...]:
        check_ports(value, info.data.get("network"))
        return value

    @field_validator("mounts")
    @classmethod
    def _mountable(
        cls, value: tuple[MountSpec, ...], info: ValidationInfo
    ) -> tuple[MountSpec, ...]:
        base_url = info.data.get("base_url")
        local = base_url is None or str(base_url).startswith("unix://")
        workdir = info.data.get("workdir") or DEFAULT_WORKDIR
        check_mounts(value, workdir, info.data.get("policy_user"), local)
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpu_request(cls, value: object) -> object:
        if isinstance(value, bool) or (isinstance(value, int) and value < 1):
            raise ValueError(f"gpus is 'all', a count >= 1 or a list of device ids, got {value!r}")
        if isinstance(value, str) and value != "all":
            raise ValueError(f"gpus is 'all', a count or a list of device ids, got {value!r}")
        if isinstance(value, list | tuple) and (
            not value or not all(isinstance(v, str) and v for v in value)
        ):
            raise ValueError("gpus as device ids is a non-empty list of non-empty strings")
        return value

    @field_validator("base_url")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and not _BASE_URL.match(value):
            raise ValueError(f"base_url must start with unix://, tcp:// or ssh://, got {value!r}")
        return value

    @model_validator(mode="after")
    def _limits_on_owned_only(self) -> DockerConfig:
        """An attached container keeps the limits it was started with: a limit set here
        would be silently ignored."""
        given = [name for name in LIMIT_FIELDS if getattr(self, name) is not None]
        if self.container and given:
            raise ValueError(
                f"{', '.join(given)}: limits apply to sandboxes this runtime creates, not to an "
                "attached container (container=...), which keeps its own"
            )
        return self

    def is_local(self) -> bool:
        """Only ``network="host"`` shares the host's network namespace (and loopback)."""
        return self.network == "host"
