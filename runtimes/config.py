"""Runtime configuration: pydantic models with a ``type`` discriminator.

Each backend declares its own config model (a subclass of :class:`RuntimeConfig` whose
``type`` is a ``Literal``) in its own module. :func:`resolve_runtime_config` finds the
model through the plugin registry, so third-party backends validate the same way.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from .errors import SandboxInvalidArgumentError
from .models import DEFAULT_OUTPUT_LIMIT, DEFAULT_READ_LIMIT
from .plugins import validation_lines
from .resources import ByteCount, ResourceLimits


class RuntimeConfig(ResourceLimits):
    """Fields every backend understands (the resource limits ``cpus``, ``memory`` and
    ``pids_limit`` from :class:`~runtimes.resources.ResourceLimits`, refused by a backend that
    cannot enforce them; ``docs/resources.md``).

    ``workdir`` is the sandbox's working directory: relative paths resolve against it and
    it is the default ``cwd``. ``None`` lets the backend choose (a private directory).
    ``keep`` (for debugging): ``close()`` releases everything host-side but leaves the sandbox,
    and what runs in it, for ``vf-sandbox shell ID``; ``vf-sandbox cleanup --kept`` removes it.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    workdir: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    output_limit: ByteCount = Field(
        default=DEFAULT_OUTPUT_LIMIT, gt=0, description="bytes, or a size like '1GiB'"
    )
    read_limit: ByteCount = Field(
        default=DEFAULT_READ_LIMIT, gt=0, description="bytes, or a size like '1GiB'"
    )
    keep: bool = Field(default=False, description="leave the sandbox running after close()")

    def __hash__(self) -> int:
        # frozen, so hashable, but pydantic's default hash fails on the dict fields; equal
        # configs dump to the same sorted JSON (inspect uses configs as dict keys)
        return hash((type(self), json.dumps(self.model_dump(mode="json"), sort_keys=True)))

    def is_local(self) -> bool:
        """Whether the sandbox shares the host's network namespace (and so its loopback)."""
        return False


class RuntimeConfigError(SandboxInvalidArgumentError):
    """A runtime config could not be validated; the message names every bad field."""

    def __init__(self, message: str, errors: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.errors = errors or []


def config_error_from_validation(
    type_name: str, exc: ValidationError, model: type[RuntimeConfig] | None = None
) -> RuntimeConfigError:
    return RuntimeConfigError(
        f"invalid {type_name!r} runtime config:\n"
        + "\n".join(f"  {line}" for line in validation_lines(exc, model)),
        [dict(e) for e in exc.errors(include_url=False, include_input=False)],
    )


def absolute_workdir(value: str | None) -> str | None:
    """Field validator of backends whose ``workdir`` lives in the sandbox (reused with
    ``field_validator("workdir")(absolute_workdir)``)."""
    if value is not None and not value.startswith("/"):
        raise ValueError(f"workdir must be an absolute path, got {value!r}")
    return value
