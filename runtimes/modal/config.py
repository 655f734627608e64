"""The ``modal`` runtime's config: :class:`ModalConfig`."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from ..config import RuntimeConfig, absolute_workdir
from ..policy import DEFAULT_POLICY_USER, validate_policy_user

__all__ = ["ModalConfig"]


def is_dockerfile(image: str) -> bool:
    name = Path(image).name
    return (
        name == "Dockerfile"
        or name.endswith((".Dockerfile", ".dockerfile"))
        or ("/" in image and Path(image).is_file())
    )


class ModalConfig(RuntimeConfig):
    """Config of the ``modal`` runtime.

    ``image`` is a registry reference (``"python:3.11-slim"``) or the path of a local
    Dockerfile (for example ``images/python/Dockerfile``; its directory is the build
    context). ``timeout`` bounds the sandbox's whole life and ``idle_timeout`` its idle
    time (seconds), so a crashed client never leaves a sandbox billing for a day. ``cpus``
    and ``memory`` (MiB or ``"2GiB"``) are hard limits (Modal's request and limit both);
    ``pids_limit`` and ``disk`` are refused (``docs/resources.md``). ``network`` is
    ``"none"`` (default, no network at all) or ``"default"`` (outbound network);
    ``cidr_allowlist`` opens it to those CIDRs only (the old ``block_network=True/False``
    still works). ``secrets`` are
    names of Modal Secrets injected as environment variables. ``tags`` are added to the
    session labels every sandbox carries as Modal tags. ``max_live`` caps this process's
    live Modal sandboxes and ``creations_per_second`` its creation rate;
    ``create_attempts`` bounds the retries when Modal answers ``ResourceExhaustedError``.
    ``snapshot_timeout`` and ``snapshot_ttl`` bound ``rt.snapshot()`` and how long Modal keeps
    its image (``docs/snapshots.md``).
    """

    enforced_limits: ClassVar[frozenset[str]] = frozenset({"cpus", "memory"})
    unenforced_reason: ClassVar[str] = "Modal has no per-sandbox process limit"
    unenforced_reasons: ClassVar[Mapping[str, str]] = {
        "disk": "Modal's Sandbox.create takes no disk size (the SDK sends no ephemeral disk "
        "request for sandboxes)"
    }

    type: Literal["modal"] = "modal"
    workdir: str | None = "/work"
    image: str = "python:3.11-slim"
    app_name: str = Field(default="vf-sandbox", min_length=1)
    environment: str | None = None
    gpu: str | None = None
    timeout: int = Field(default=3600, ge=10, le=24 * 3600)
    idle_timeout: int | None = Field(default=900, ge=10, le=24 * 3600)
    region: str | list[str] | None = None
    network: Literal["none", "default"] = "none"
    cidr_allowlist: list[str] | None = None
    secrets: list[str] = Field(default_factory=list)
    tags: dict[str, str] = Field(default_factory=dict)
    max_live: int | None = Field(default=None, ge=1)
    creations_per_second: float | None = Field(default=None, gt=0)
    create_attempts: int = Field(default=6, ge=1, le=20)
    create_timeout: float = Field(default=600.0, gt=0)
    policy_user: str | None = DEFAULT_POLICY_USER
    snapshot_timeout: int = Field(
        default=55, ge=1, description="seconds Modal may take to snapshot the filesystem"
    )
    snapshot_ttl: int = Field(
        default=24 * 3600,
        ge=60,
        le=7 * 24 * 3600,
        description="seconds a snapshot's image is kept at most (its record lasts 7 days idle)",
    )
    channel: bool = Field(
        default=True,
        description="run commands and files through a persistent in-sandbox agent (python3)",
    )

    _plain_policy_user = field_validator("policy_user")(validate_policy_user)

    @model_validator(mode="before")
    @classmethod
    def _allowlist_opens_network(cls, data: Any) -> Any:
        """``block_network`` is the old spelling of ``network``; ``cidr_allowlist`` alone
        means "network on, but only to these"."""
        if not isinstance(data, dict):
            return data
        if "block_network" in data:
            data = _network_from_block_network(data)
        if data.get("cidr_allowlist") is not None:
            if data.get("network", "default") != "default":
                raise ValueError("cidr_allowlist needs network='default' (it opens the network)")
            data = {**data, "network": "default"}
        return data

    @property
    def block_network(self) -> bool:
        """The Modal SDK's name: ``network == "none"``."""
        return self.network == "none"

    _absolute_workdir = field_validator("workdir")(absolute_workdir)

    @field_validator("cidr_allowlist")
    @classmethod
    def _valid_cidrs(cls, value: list[str] | None) -> list[str] | None:
        for cidr in value or []:
            ipaddress.ip_network(cidr, strict=False)  # raises ValueError naming the bad one
        return value

    @field_validator("secrets")
    @classmethod
    def _named_secrets(cls, value: list[str]) -> list[str]:
        if any(not name for name in value):
            raise ValueError("secret names must not be empty")
        return value


def _network_from_block_network(data: dict[str, Any]) -> dict[str, Any]:
    """``block_network=True/False`` -> ``network="none"/"default"``."""
    data = dict(data)
    blocked = data.pop("block_network")
    if "network" in data:
        raise ValueError("'block_network' is the old name of 'network': give only 'network'")
    if not isinstance(blocked, bool):
        raise ValueError("block_network must be true or false (or use network='none'/'default')")
    data["network"] = "none" if blocked else "default"
    return data
