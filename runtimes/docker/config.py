"""The ``docker`` runtime's config model (:class:`DockerConfig`)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from ..config import RuntimeConfig, absolute_workdir
from ..policy import DEFAULT_POLICY_USER, validate_policy_user

DEFAULT_IMAGE = "vf-sandbox/base:bookworm"
DEFAULT_WORKDIR = "/work"

_MEMORY = re.compile(r"^\d+(\.\d+)?[bkmgBKMG]?$")
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
    (``docs/security.md``). ``cpu`` is in cores, ``memory`` in bytes or with a unit
    (``"512m"``, ``"2g"``). ``network`` is ``"none"`` (default), ``"bridge"``, ``"host"``
    or a network's name. ``base_url`` is ``unix://...``, ``tcp://host:port`` or
    ``ssh://user@host`` (paramiko); unset means ``DOCKER_HOST`` or the local socket.
    ``max_live`` caps the live sandboxes of this process (all docker configs share one
    count), ``creations_per_second`` paces creations; ``None`` disables the pacing.
    """

    type: Literal["docker"] = "docker"
    image: str = DEFAULT_IMAGE
    container: str | None = None
    user: str | None = None
    policy_user: str | None = DEFAULT_POLICY_USER
    cpu: float | None = Field(default=None, gt=0)
    memory: int | str | None = None
    pids_limit: int | None = Field(default=None, gt=0)
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

    _absolute_workdir = field_validator("workdir")(absolute_workdir)
    _plain_policy_user = field_validator("policy_user")(validate_policy_user)

    @field_validator("memory")
    @classmethod
    def _memory_size(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value <= 0:
            raise ValueError("memory must be > 0 bytes")
        if isinstance(value, str) and not _MEMORY.match(value):
            raise ValueError(f"memory must be bytes or a size like '512m' or '2g', got {value!r}")
        return value

    @field_validator("base_url")
    @classmethod
    def _known_scheme(cls, value: str | None) -> str | None:
        if value is not None and not _BASE_URL.match(value):
            raise ValueError(f"base_url must start with unix://, tcp:// or ssh://, got {value!r}")
        return value

    def is_local(self) -> bool:
        """Only ``network="host"`` shares the host's network namespace (and loopback)."""
        return self.network == "host"
