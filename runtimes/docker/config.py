"""The ``docker`` runtime's config model (:class:`DockerConfig`)."""

from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import (
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..config import RuntimeConfig, absolute_workdir
from ..policy import DEFAULT_POLICY_USER, validate_policy_user
from ..resources import LIMIT_FIELDS, DiskMiB, MemoryMiB, format_mib
from .build_context import BuildSpec, is_dockerfile_path, spec_from_dockerfile
from .mounts import MountSpec, check_mounts
from .ports import PortSpec, check_ports, parse_port

DEFAULT_IMAGE = "vf-sandbox/base:bookworm"
DEFAULT_WORKDIR = "/work"

_BASE_URL = re.compile(r"^(unix|tcp|ssh|http|https|npipe)://")

DEFAULT_MEMORY_MIB = 2048
"""The hardened default ``memory`` (2 GiB, no swap): ~10x the largest measured workload."""
DEFAULT_PIDS_LIMIT = 1024
"""The hardened default ``pids_limit``: ~40x the largest measured workload's processes and
threads; a fork bomb still reaches it in under a second."""
DEFAULT_CAPABILITIES = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "KILL", "SETGID", "SETUID")
"""What an owned sandbox keeps of the engine's capabilities with ``capabilities="hardened"``
(``docs/docker.md``, Hardened defaults): the policy account's handoff and the non-root
workdir (CHOWN), root's access to the policy's files (DAC_OVERRIDE, FOWNER), killing another
user's processes (KILL) and switching users (SETGID, SETUID)."""
DEFAULT_SECURITY_OPT = ("no-new-privileges",)
TMPFS_HEADROOM_MIB = 512
"""Memory left to processes when the workdir and /tmp (tmpfs, counted against ``memory``)
are full: ``2 * disk + TMPFS_HEADROOM_MIB <= memory``."""

LINUX_CAPABILITIES = frozenset(
    {
        "AUDIT_CONTROL", "AUDIT_READ", "AUDIT_WRITE", "BLOCK_SUSPEND", "BPF",
        "CHECKPOINT_RESTORE", "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID",
        "IPC_LOCK", "IPC_OWNER", "KILL", "LEASE", "LINUX_IMMUTABLE", "MAC_ADMIN",
        "MAC_OVERRIDE", "MKNOD", "NET_ADMIN", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_RAW",
        "PERFMON", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_ADMIN", "SYS_BOOT",
        "SYS_CHROOT", "SYS_MODULE", "SYS_NICE", "SYS_PACCT", "SYS_PTRACE", "SYS_RAWIO",
        "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "SYSLOG", "WAKE_ALARM",
    }
)  # fmt: skip
_SECURITY_OPTS = ("no-new-privileges", "seccomp", "apparmor", "label", "systempaths")
_OCI_RUNTIME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_HARDENING_FIELDS = (
    "security_opt", "capabilities", "cap_add", "memory_swap", "read_only", "runtime"
)  # fmt: skip
"""Create options of owned sandboxes beyond the common limits: refused with ``container=``."""


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
    ``"512m"``), ``pids_limit`` and ``disk`` are the common limits (``docs/resources.md``).
    ``network``
    is ``"none"`` (default), ``"default"``/``"bridge"`` (the engine's outbound network),
    ``"host"`` or a network's name. ``base_url`` is ``unix://...``, ``tcp://host:port`` or
    ``ssh://user@host`` (paramiko); unset means ``DOCKER_HOST`` or the local socket.
    ``max_live`` caps the live sandboxes of this process (all docker configs share one
    count), ``creations_per_second`` paces creations; ``None`` disables the pacing.
    ``ports`` (published on ``127.0.0.1`` by default; needs a network), ``mounts`` (bind
    mounts, volumes), ``gpus`` and ``pull`` (``never``/``missing``/``always``, bounded by
    ``pull_timeout``) apply to owned sandboxes (``docs/docker.md``). ``build`` (a
    :class:`~.build_context.BuildSpec`: ``{"context": "dir", "dockerfile": "Dockerfile",
    "args": {...}}``) builds the image from a Dockerfile instead, cached by content and never
    pulling; ``image="dir/Dockerfile"`` is short for ``build={"context": "dir"}`` (as on
    Modal). ``snapshot_timeout``
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
    build: BuildSpec | None = Field(
        default=None, description="build the image from a Dockerfile (context, dockerfile, args)"
    )
    snapshot_timeout: float = Field(
        default=600.0, gt=0, description="seconds the engine may take to commit a snapshot"
    )
    memory: MemoryMiB | None = Field(
        default=DEFAULT_MEMORY_MIB, description="MiB, or '512MiB', '2GiB'; None: no limit"
    )
    pids_limit: int | None = Field(
        default=DEFAULT_PIDS_LIMIT, gt=0, description="processes and threads; None: no limit"
    )
    memory_swap: MemoryMiB | None = Field(
        default=None, description="memory plus swap; None: equal to memory (no swap)"
    )
    security_opt: tuple[str, ...] = Field(
        default=DEFAULT_SECURITY_OPT, description="the engine's SecurityOpt entries"
    )
    capabilities: Literal["hardened", "engine"] = Field(
        default="hardened",
        description="'hardened': drop all but DEFAULT_CAPABILITIES; 'engine': its default set",
    )
    cap_add: tuple[str, ...] = Field(
        default=(), description="capabilities added on top (NET_RAW, SYS_PTRACE, ...)"
    )
    read_only: bool = Field(
        default=False, description="read-only root filesystem; workdir and /tmp stay writable"
    )
    disk: DiskMiB | None = Field(
        default=None, description="size bound of the workdir and of /tmp (each; tmpfs volumes)"
    )
    runtime: str | None = Field(
        default=None, description="the engine's OCI runtime ('runsc', 'crun'); None: its default"
    )

    _absolute_workdir = field_validator("workdir")(absolute_workdir)
    _plain_policy_user = field_validator("policy_user")(validate_policy_user)

    @model_validator(mode="before")
    @classmethod
    def _attached_has_no_default_limits(cls, data: Any) -> Any:
        """An attached container keeps its own limits: the hardened limit defaults are for
        containers this runtime creates."""
        if isinstance(data, dict) and data.get("container"):
            data = {"memory": None, "pids_limit": None, **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _dockerfile_image(cls, data: Any) -> Any:
        """``image="dir/Dockerfile"`` (Modal's spelling) builds it: ``build={"context": "dir"}``;
        ``image`` and ``build`` together are refused (the build makes the image)."""
        if not isinstance(data, dict):
            return data
        image = data.get("image")
        if data.get("build") is not None and image is not None:
            raise ValueError(
                "image and build exclude each other: build makes the sandbox's image "
                f"(tagged vf-sandbox/build:<content hash>); drop image={image!r}"
            )
        if isinstance(image, str) and is_dockerfile_path(image):
            data = {**data, "build": spec_from_dockerfile(image)}
            del data["image"]
        return data

    @field_validator("build")
    @classmethod
    def _build_offline(cls, value: BuildSpec | None, info: ValidationInfo) -> BuildSpec | None:
        if value is not None and info.data.get("pull", "never") != "never":
            raise ValueError(
                "build never pulls (its FROM images must be on the engine): drop pull="
                f"{info.data.get('pull')!r}"
            )
        return value

    @field_validator("cap_add", mode="before")
    @classmethod
    def _capability_names(cls, value: object) -> object:
        if isinstance(value, str):
            raise ValueError("cap_add is a list of capability names, like ['NET_RAW']")
        if not isinstance(value, list | tuple):
            return value
        names = []
        for entry in value:
            if not isinstance(entry, str):
                raise ValueError(f"cap_add: {entry!r} is not a capability name")
            name = entry.strip().upper().removeprefix("CAP_")
            if name == "ALL":
                raise ValueError(
                    "cap_add: 'ALL' gives the sandbox every capability of the host's root; "
                    "name the capabilities the workload needs"
                )
            if name not in LINUX_CAPABILITIES:
                raise ValueError(
                    f"cap_add: {entry!r} is not a Linux capability (CHOWN, NET_RAW, SYS_PTRACE, "
                    "...; see capabilities(7))"
                )
            if name not in names:
                names.append(name)
        return tuple(names)

    @field_validator("security_opt", mode="before")
    @classmethod
    def _known_security_opts(cls, value: object) -> object:
        if isinstance(value, str):
            raise ValueError("security_opt is a list, like ['no-new-privileges']")
        if isinstance(value, list | tuple):
            for entry in value:
                key = re.split(r"[=:]", entry, maxsplit=1)[0] if isinstance(entry, str) else ""
                if key not in _SECURITY_OPTS:
                    raise ValueError(
                        f"security_opt: {entry!r} is not one the engine takes "
                        f"({', '.join(_SECURITY_OPTS)}, as 'name' or 'name=value')"
                    )
        return value

    @field_validator("runtime")
    @classmethod
    def _runtime_name(cls, value: str | None) -> str | None:
        if value is not None and not _OCI_RUNTIME.match(value):
            raise ValueError(f"runtime is the name of an OCI runtime (runc, runsc), got {value!r}")
        return value

    @field_validator("ports", mode="before")
    @classmethod
    def _port_shorthands(cls, value: object) -> object:
        if isinstance(value, list | tuple):
            return tuple(parse_port(entry) for entry in value)
        return value

    @field_validator("ports", "mounts", "gpus", "pull", "build")
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

    @model_validator(mode="after")
    def _hardening_on_owned_only(self) -> DockerConfig:
        """An attached container keeps the settings it was started with."""
        fields = type(self).model_fields
        changed = [n for n in _HARDENING_FIELDS if getattr(self, n) != fields[n].default]
        if self.container and changed:
            raise ValueError(
                f"{', '.join(changed)}: these apply to sandboxes this runtime creates, not to an "
                "attached container (container=...), which keeps its own"
            )
        return self

    @model_validator(mode="after")
    def _swap_fits_memory(self) -> DockerConfig:
        """The engine takes memory plus swap only with a memory limit, and not below it."""
        if self.memory_swap is None:
            return self
        if self.memory is None:
            raise ValueError("memory_swap (memory plus swap) needs a memory limit: set memory")
        if self.memory_swap < self.memory:
            raise ValueError(
                f"memory_swap is memory plus swap: {format_mib(self.memory_swap)} is below "
                f"memory ({format_mib(self.memory)})"
            )
        return self

    @model_validator(mode="after")
    def _disk_fits_memory(self) -> DockerConfig:
        """The workdir and /tmp of a ``disk`` quota are tmpfs, whose pages count against the
        memory limit and cannot be reclaimed without swap: both full, with too little memory
        left, every command would be killed by the memory limit."""
        if self.disk is None or self.memory is None:
            return self
        needed = 2 * self.disk + TMPFS_HEADROOM_MIB
        if self.memory < needed:
            raise ValueError(
                f"disk={format_mib(self.disk)} bounds the workdir and /tmp each, in memory "
                f"(tmpfs) that counts against memory={format_mib(self.memory)}: memory must be "
                f"at least 2 x disk + {TMPFS_HEADROOM_MIB}MiB ({format_mib(needed)}); raise "
                "memory or lower disk"
            )
        return self

    @model_validator(mode="after")
    def _read_only_policy_account(self) -> DockerConfig:
        """The default policy account is added to ``/etc/passwd`` on first use, which a
        read-only root filesystem refuses; an account named explicitly is taken to be in
        the image (made only if missing). A non-root ``user`` has no policy account."""
        implicit = "policy_user" not in self.model_fields_set
        root = self.user is None or self.user.split(":", 1)[0] in ("root", "0")
        if self.read_only and implicit and root and self.policy_user == DEFAULT_POLICY_USER:
            raise ValueError(
                f"read_only=True: the policy account {DEFAULT_POLICY_USER!r} cannot be added to "
                "a read-only /etc; set policy_user to an account the image has ('nobody', say), "
                "or policy_user=None to run the policy as the default user"
            )
        return self

    def is_local(self) -> bool:
        """Only ``network="host"`` shares the host's network namespace (and loopback)."""
        return self.network == "host"


def as_docker_config(config: RuntimeConfig | None) -> DockerConfig:
    """``config`` if it is a docker one, else the defaults (the class-level calls that
    list and remove what the engine holds take any config)."""
    return config if isinstance(config, DockerConfig) else DockerConfig()


def is_root_user(user: str | None) -> bool:
    """Whether ``user`` (a name or uid, maybe ``user:group``; none: the container's own,
    root) is root."""
    if not user:
        return True
    name = user.split(":", 1)[0]
    return name in ("root", "0")
