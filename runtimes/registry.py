"""Finding backends: the ``vf_sandbox.runtimes`` entry-point group.

Built-in backends register through the same group as third-party ones (see
``pyproject.toml``). A plugin that fails to import never breaks the others: listing
reports it as broken, and only using it raises :class:`RuntimePluginError`, naming the
distribution that ships it.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from .backend import Backend
from .base import Runtime
from .composed import BackendRuntime, runtime_class
from .config import RuntimeConfig, RuntimeConfigError, config_error_from_validation
from .errors import SandboxError
from .plugins import Plugin, PluginGroup
from .snapshot import SandboxSnapshot

ENTRY_POINT_GROUP = "vf_sandbox.runtimes"


class RuntimePluginError(SandboxError, ImportError):
    """A runtime plugin could not be loaded, or does not provide a valid backend."""


class UnknownRuntimeError(RuntimeConfigError):
    """No backend is registered under the requested ``type``."""


RuntimePlugin = Plugin

RUNTIMES: PluginGroup[Runtime] = PluginGroup(
    ENTRY_POINT_GROUP,
    "runtime type",
    Runtime,
    unknown_error=UnknownRuntimeError,
    plugin_error=RuntimePluginError,
    adapt=(Backend, runtime_class),
)


def available_runtimes() -> dict[str, Plugin]:
    """Every registered backend, loaded or not (cheap: imports nothing)."""
    return RUNTIMES.available()


def load_runtime_class(type_name: str) -> type[Runtime]:
    """The :class:`Runtime` subclass registered under ``type_name``.

    Raises:
        UnknownRuntimeError: nothing is registered under that name.
        RuntimePluginError: the plugin raised on import or is neither a Runtime nor a
            :class:`~runtimes.backend.Backend` subclass (whose runtime is composed:
            :func:`~runtimes.composed.runtime_class`); the message names its distribution.

    A plugin that subclasses :class:`Runtime` itself (the older seam) still loads, with a
    :class:`DeprecationWarning`.
    """
    loaded = RUNTIMES.load(type_name)
    if not issubclass(loaded, BackendRuntime) and not loaded.forwards_host_side:
        warnings.warn(
            f"the {type_name!r} runtime plugin subclasses runtimes.Runtime and fills in its "
            "private hooks: that seam is deprecated and goes in a later release; make it a "
            "runtimes.Backend (docs/plugins.md)",
            DeprecationWarning,
            stacklevel=2,
        )
    return loaded


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
        raise config_error_from_validation(type_name, exc, model) from None


def runtime_is_local(config: RuntimeConfig | Mapping[str, Any] | str) -> bool:
    """Whether the sandbox shares the host's network namespace (decides model routing)."""
    return resolve_runtime_config(config).is_local()


def open_runtime(
    config: RuntimeConfig | Mapping[str, Any] | str, *, snapshot: SandboxSnapshot | None = None
) -> Runtime:
    """A runtime for ``config``, not yet started: use it as ``async with open_runtime(...) as rt``.

    With ``snapshot`` (from :meth:`Runtime.snapshot`), the sandbox's files start as the
    snapshot's (``docs/snapshots.md``); nothing runs in it yet.

    Raises:
        RuntimeConfigError, UnknownRuntimeError, RuntimePluginError: as
            :func:`resolve_runtime_config`.
        SnapshotUnsupportedError: ``snapshot`` given to a backend that cannot open one.
        SandboxInvalidArgumentError: ``snapshot`` is of another backend, or the config
            cannot start from one (see :meth:`Runtime.fork_from`). A snapshot that is gone
            is found by ``start()``: :class:`~runtimes.snapshot.SnapshotNotFoundError`.
    """
    resolved = resolve_runtime_config(config)
    runtime = load_runtime_class(resolved.type)(resolved)
    return runtime if snapshot is None else runtime.fork_from(snapshot)
