"""Runtimes as the command line names them: ``--runtime TYPE`` or ``--runtime '{JSON}'``."""

from __future__ import annotations

import json
from typing import Any

from runtimes import RuntimeConfig, RuntimeConfigError, resolve_runtime_config


def parse_runtime_target(text: str) -> str | dict[str, Any]:
    """A runtime given on the command line, unvalidated: a bare type name or a JSON object.

    Raises:
        RuntimeConfigError: the text starts like JSON but is not a JSON object.
    """
    stripped = text.strip()
    if not stripped.startswith("{"):
        return stripped
    try:
        data: dict[str, Any] = json.loads(stripped)  # starts with "{": an object or invalid
    except json.JSONDecodeError as exc:
        raise RuntimeConfigError(f"--runtime is not valid JSON: {exc}") from None
    return data


def parse_runtime(text: str) -> RuntimeConfig:
    """A runtime given on the command line, validated.

    Raises:
        RuntimeConfigError, UnknownRuntimeError, RuntimePluginError: as
            :func:`runtimes.resolve_runtime_config`.
    """
    return resolve_runtime_config(parse_runtime_target(text))


def runtime_targets(runtimes: list[str] | None) -> list[RuntimeConfig | str] | None:
    """A repeatable ``--runtime``'s values: a bare name stays a name (the backend's default
    config), a JSON object becomes its validated config; ``None`` when none was given.

    Raises:
        RuntimeConfigError, UnknownRuntimeError, RuntimePluginError: as :func:`parse_runtime`.
    """
    if not runtimes:
        return None
    return [
        r if isinstance(r, str) else resolve_runtime_config(r)
        for r in map(parse_runtime_target, runtimes)
    ]
