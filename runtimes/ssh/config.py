"""The ``ssh`` runtime's config model (:class:`SSHConfig`) and its host key parser."""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from ..config import RuntimeConfig
from ..policy import validate_policy_user


class SSHConfig(RuntimeConfig):
    """Config of the ``ssh`` runtime.

    Authentication (at least one; tried in this order): ``key_file`` (a private key
    path, optionally with ``key_passphrase``), ``key_env`` (the *name* of a host
    environment variable holding a private key in PEM/OpenSSH format), ``use_agent``
    (keys from ``SSH_AUTH_SOCK``), ``password``. Secrets are ``SecretStr``: they never
    appear in reprs, logs, exceptions or validation errors.

    Host keys are checked strictly: against ``host_key`` when given (a pinned
    ``"ssh-ed25519 AAAA..."`` line), else against ``known_hosts``. An unknown key is
    refused unless ``accept_unknown_host_key`` is set; a mismatching key is always
    refused.

    ``workdir``: by default a private directory is created under the remote temp dir
    (``mktemp -d``) and removed on close; a given ``workdir`` is created if missing and
    left in place. ``max_channels`` caps concurrent SSH channels on the connection
    (OpenSSH's ``MaxSessions`` defaults to 10); three are kept for SFTP and control.

    ``policy_user``: an existing account of the host that a rollout's policy runs as
    (``exec(user=rt.policy_user)``), apart from the root login the host's machinery uses;
    it is handed the workdir on first use. ``stop_processes`` kills every process of that
    account, so give each live sandbox an account of its own. Unset (the default), the
    policy runs as the login user (``docs/security.md``). ``judge_user``: another existing
    account (with ``policy_user``) that judges placed in the sandbox run their verdict-writing
    commands as, so that a program a judge runs never gets the root login
    (``docs/security.md``, "Judges' own account"); ``stop_processes`` kills its processes too.
    Unset, judges run as the login.

    Resource limits are per command, set with ``prlimit`` (util-linux) on the remote host:
    ``memory`` is each process's address space (``RLIMIT_AS``, not a total of the sandbox),
    ``pids_limit`` the processes of the account a command runs as (``RLIMIT_NPROC``, which
    root ignores: it needs ``policy_user`` or a non-root login). ``cpus`` and ``disk`` are
    refused: no per-command way bounds them. With a limit set, commands take the plain path
    (no channel agent), each under the limits. ``network`` is always ``"host"``, the remote
    host's own network (``docs/resources.md``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    enforced_limits: ClassVar[frozenset[str]] = frozenset({"memory", "pids_limit"})
    unenforced_reason: ClassVar[str] = (
        "commands run as plain processes of the remote host, outside any per-sandbox cgroup "
        "(run them in a container or VM on that host to limit them)"
    )
    unenforced_reasons: ClassVar[Mapping[str, str]] = {
        "disk": "a process limit bounds the size of each file (RLIMIT_FSIZE), not what the "
        "sandbox writes in total (give the workdir a filesystem with a quota on that host)",
    }

    type: Literal["ssh"] = "ssh"
    host: str = Field(min_length=1)
    port: int = Field(default=22, ge=1, le=65535)
    username: str = Field(min_length=1)
    key_file: str | None = None
    key_env: str | None = None
    key_passphrase: SecretStr | None = None
    use_agent: bool = False
    password: SecretStr | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    host_key: str | None = None
    accept_unknown_host_key: bool = False
    connect_timeout: float = Field(default=10.0, gt=0)
    keepalive_interval: int = Field(
        default=15,
        ge=0,
        description="seconds without traffic before a keepalive asking for an answer; 0: off",
    )
    keepalive_count_max: int = Field(
        default=3,
        ge=1,
        description="keepalives left unanswered before the connection is declared dead",
    )
    io_timeout: float = Field(
        default=120.0,
        gt=0,
        description="seconds without progress before a file or control call fails",
    )
    snapshot_timeout: float = Field(
        default=600.0,
        gt=0,
        description="seconds a workdir copy may take (a snapshot, a sandbox opened from one)",
    )
    max_channels: int = Field(default=10, ge=4)
    policy_user: str | None = None
    judge_user: str | None = None
    network: Literal["host"] = "host"
    channel: bool = Field(
        default=True,
        description="run commands and files through a persistent agent (python3 on the host); "
        "takes one of max_channels, and needs max_channels >= 5",
    )

    @field_validator("host_key")
    @classmethod
    def _check_host_key(cls, value: str | None) -> str | None:
        if value is not None:
            parse_host_key_line(value)
        return value

    _plain_policy_user = field_validator("policy_user", "judge_user")(validate_policy_user)

    @field_validator("network", mode="before")
    @classmethod
    def _host_network(cls, value: object) -> object:
        if value != "host":
            raise ValueError(
                f"the 'ssh' runtime cannot isolate the network (got {value!r}): commands use "
                "the remote host's network; leave network unset ('host')"
            )
        return value

    @model_validator(mode="after")
    def _policy_needs_root(self) -> SSHConfig:
        if self.policy_user is not None and self.username != "root":
            raise ValueError("policy_user needs username 'root' (to switch users with runuser)")
        return self

    @model_validator(mode="after")
    def _judge_needs_a_policy_account(self) -> SSHConfig:
        if self.judge_user is not None and self.policy_user is None:
            raise ValueError("judge_user needs policy_user (without it judges run as the login)")
        if self.judge_user is not None and self.judge_user == self.policy_user:
            raise ValueError("judge_user must be an account other than policy_user")
        return self

    @model_validator(mode="after")
    def _pids_limit_needs_an_account(self) -> SSHConfig:
        """RLIMIT_NPROC counts a user's processes, and root is exempt from it."""
        if self.pids_limit is not None and self.username == "root" and self.policy_user is None:
            raise ValueError(
                "pids_limit bounds the processes of the account commands run as, and root is "
                "exempt: set policy_user (an account of this sandbox's own) or log in as a "
                "non-root user"
            )
        return self

    @model_validator(mode="after")
    def _check_auth(self) -> SSHConfig:
        if not (self.key_file or self.key_env or self.use_agent or self.password is not None):
            raise ValueError(
                "no authentication method: set key_file, key_env, use_agent or password"
            )
        return self

    def is_local(self) -> bool:
        return False

    @property
    def destination(self) -> str:
        """``user@host:port``, for messages."""
        return f"{self.username}@{self.host}:{self.port}"


def parse_host_key_line(line: str) -> tuple[str, bytes]:
    """``"ssh-ed25519 AAAA... [comment]"`` -> (key type, key blob)."""
    fields = line.split()
    if len(fields) < 2:
        raise ValueError("host_key must look like 'ssh-ed25519 AAAA...' (key type, base64 key)")
    try:
        blob = base64.b64decode(fields[1], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("host_key: the key is not valid base64") from None
    return fields[0], blob
