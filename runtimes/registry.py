"""Finding backends: the ``vf_sandbox.runtimes`` entry-point group.

Built-in backends register through the same group as third-party ones (see
``pyproject.toml``). A plugin that fails to import never breaks the others: listing
reports it as broken, and only using it raises :class:`RuntimePluginError`, naming the
distribution that ships it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from pydantic import ValidationError

from .base import Runtime
from .config import RuntimeConfig, RuntimeConfigError, config_error_from_validation
from .errors import SandboxError

ENTRY_POINT_GROUP = "vf_sandbox.runtimes"


class RuntimePluginError(SandboxError, ImportError):
    """A runtime plugin could not be loaded, or does not provide a valid backend."""


class UnknownRuntimeError(RuntimeConfigError):
    """No backend is registered under the requested ``type``."""


@dataclass(frozen=True)
class RuntimePlugin:
    name: str
    value: str
    distribution: str

    def describe(self) -> str:
        return f"{self.name} ({self.value}, from {self.distribution})"


def _entry_points() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def available_runtimes() -> dict[str, RuntimePlugin]:
    """Every registered backend, loaded or not (cheap: imports nothing)."""
    return {
        name: RuntimePlugin(name, ep.value, ep.dist.name if ep.dist else "unknown distribution")
        for name, ep in sorted(_entry_points().items())
    }


@functools.cache
def load_runtime_class(type_name: str) -> type[Runtime]:
    """The :class:`Runtime` subclass registered under ``type_name``.

    Raises:
        UnknownRuntimeError: nothing is registered under that name.
        RuntimePluginError: the plugin raised on import or is not a Runtime subclass;
            the message names the plugin's distribution.
    """
    eps = _entry_points()
    ep = eps.get(type_name)
    if ep is None:
        known = ", ".join(sorted(eps)) or "none"
        raise UnknownRuntimeError(f"unknown runtime type {type_name!r} (registered: {known})")
    dist = ep.dist.name if ep.dist else "unknown distribution"
    try:
        cls = ep.load()
    except Exception as exc:
        raise RuntimePluginError(
            f"runtime plugin {type_name!r} from package {dist!r} ({ep.value}) failed to import: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Runtime)):
        raise RuntimePluginError(
            f"runtime plugin {type_name!r} from package {dist!r} ({ep.value}) "
            f"is not a runtimes.Runtime subclass"
        )
    return cls


def resolve_runtime_config(config: RuntimeConfig | Mapping[str, Any] | str) -> RuntimeConfig:
    """Validate a config given as a model, a dict with ``type``, or a bare type name.

    Raises:
        RuntimeConfigError: missing ``type`` or invalid fields (each named in the message).
        UnknownRuntimeError: no backend registered for ``type``.
        RuntimePluginError: the backend's plugin is broken.
    """
    if isinstance(config, RuntimeConfig):
        return config
    if isinstance(config, str):
        data: dict[str, Any] = {"type": config}
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise RuntimeConfigError(
            "a runtime config is a config model, a dict or a type name, "
            f"not {type(config).__name__}"
        )
    type_name = data.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise RuntimeConfigError(
            "runtime config has no 'type' (for example 'subprocess' or 'docker')"
        )
    model = load_runtime_class(type_name).config_model
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise config_error_from_validation(type_name, exc) from None


def runtime_is_local(config: RuntimeConfig | Mapping[str, Any] | str) -> bool:
    """Whether the sandbox shares the host's network namespace (decides model routing)."""
    return resolve_runtime_config(config).is_local()


def open_runtime(config: RuntimeConfig | Mapping[str, Any] | str) -> Runtime:
    """A runtime for ``config``, not yet started: use it as ``async with open_runtime(...) as rt``.

    Raises:
        RuntimeConfigError, UnknownRuntimeError, RuntimePluginError: as
            :func:`resolve_runtime_config`.
    """
    resolved = resolve_runtime_config(config)
    return load_runtime_class(resolved.type)(resolved)
