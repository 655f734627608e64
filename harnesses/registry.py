"""Finding harnesses: the ``vf_sandbox.harnesses`` entry-point group.

The built-in harnesses (``null``, ``bash``, ``mini-swe-agent``) register through the same
group as third-party ones (see ``pyproject.toml``). A plugin that fails to import never
breaks the others: listing imports nothing, and only using a broken plugin raises
:class:`~harnesses.errors.HarnessPluginError`, naming the distribution that ships it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from runtimes.plugins import Plugin, PluginGroup, validation_lines

from .base import Harness, HarnessConfig
from .errors import HarnessConfigError, HarnessPluginError, UnknownHarnessError

__all__ = [
    "ENTRY_POINT_GROUP",
    "HARNESSES",
    "HarnessPlugin",
    "available_harnesses",
    "load_harness_class",
    "open_harness",
    "resolve_harness_config",
]

ENTRY_POINT_GROUP = "vf_sandbox.harnesses"

HarnessPlugin = Plugin

HARNESSES: PluginGroup[Harness] = PluginGroup(
    ENTRY_POINT_GROUP,
    "harness id",
    Harness,
    unknown_error=UnknownHarnessError,
    plugin_error=HarnessPluginError,
)


def available_harnesses() -> dict[str, Plugin]:
    """Every registered harness, loaded or not (cheap: imports nothing)."""
    return HARNESSES.available()


def load_harness_class(harness_id: str) -> type[Harness]:
    """The :class:`Harness` subclass registered under ``harness_id``.

    Raises:
        UnknownHarnessError: nothing is registered under that id (the message lists
            what is).
        HarnessPluginError: the plugin raised on import or is not a Harness subclass;
            the message names the plugin's distribution.
    """
    return HARNESSES.load(harness_id)


def resolve_harness_config(config: HarnessConfig | Mapping[str, Any] | str) -> HarnessConfig:
    """Validate a config given as a model, a dict with ``id``, or a bare id, narrowed to
    the harness's own config model.

    Raises:
        HarnessConfigError: missing ``id`` or invalid fields (each named in the message).
        UnknownHarnessError: no harness registered under ``id``.
        HarnessPluginError: the harness's plugin is broken.
    """
    if isinstance(config, HarnessConfig):
        data: dict[str, Any] = config.model_dump()
    elif isinstance(config, str):
        data = {"id": config}
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise HarnessConfigError(
            f"a harness config is a config model, a dict or an id, not {type(config).__name__}"
        )
    harness_id = data.get("id")
    if not isinstance(harness_id, str) or not harness_id:
        raise HarnessConfigError("harness config has no 'id' (for example 'null' or 'bash')")
    model = load_harness_class(harness_id).config_model
    if isinstance(config, model):
        return config
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise HarnessConfigError(
            f"invalid {harness_id!r} harness config:\n"
            + "\n".join(f"  {line}" for line in validation_lines(exc, model))
        ) from None


def open_harness(config: HarnessConfig | Mapping[str, Any] | str) -> Harness:
    """A harness for ``config``.

    Raises:
        HarnessConfigError, UnknownHarnessError, HarnessPluginError: as
            :func:`resolve_harness_config`.
    """
    resolved = resolve_harness_config(config)
    return load_harness_class(resolved.id)(resolved)
