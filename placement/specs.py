"""Agent and judge specs: who runs, with which model, where, under which budget."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from harnesses.base import Budget
from harnesses.registry import load_harness_class, resolve_harness_config
from runtimes import RuntimeConfig, resolve_runtime_config
from runtimes.plugins import validation_lines

from .errors import PlacementConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

Placement = Literal["rollout"] | dict[str, Any]
"""``"rollout"``: inside the rollout's live runtime, after the policy finished. A runtime
config (dict): a fresh clean-room sandbox of its own."""

_SCHEMA_TYPES: dict[str, Any] = {
    "number": float,
    "integer": int,
    "string": str,
    "boolean": bool,
    "object": dict[str, Any],
    "array": list[Any],
}


class AgentSpec(BaseModel):
    """An agent: a harness plus a model, placed somewhere, under a budget."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    name: str
    harness: dict[str, Any] = Field(default_factory=lambda: {"id": "null"})
    model: str = "policy"
    placement: Placement = "rollout"
    budget: Budget = Field(default_factory=Budget)
    trainable: bool = True

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.fullmatch(value):
            raise ValueError("names are 1-63 letters, digits, '_', '.', '-', starting alnum")
        return value

    @field_validator("harness", mode="before")
    @classmethod
    def _harness_by_id(cls, value: Any) -> Any:
        return {"id": value} if isinstance(value, str) else value

    @field_validator("placement")
    @classmethod
    def _check_placement(cls, value: Placement) -> Placement:
        if isinstance(value, dict):
            resolve_runtime_config(value)  # fail early, naming the field
        return value

    def runtime_config(self) -> RuntimeConfig | None:
        """The clean-room runtime config, or ``None`` for placement in the rollout."""
        if not isinstance(self.placement, dict):
            return None
        return resolve_runtime_config(self.placement)

    def needs_runtime(self) -> bool:
        return load_harness_class(resolve_harness_config(self.harness).id).needs_runtime


class JudgeSpec(AgentSpec):
    """A judge: an agent whose output is a verdict validated against ``verdict_schema``.

    ``prompt`` may use ``$inputs_dir``, ``$verdict_path``, ``$schema``, ``$task`` and
    ``$transcript``. ``verdict_schema`` is a pydantic model, an import path
    (``"pkg.mod:Model"``), or a field table (``{"score": {"type": "number", "minimum": 0}}``
    or ``{"passed": "boolean"}``).
    """

    model: str = "grader"
    trainable: bool = False
    prompt: str
    verdict_schema: type[BaseModel]
    verdict_max_bytes: int = Field(default=1 << 20, gt=0)

    @field_validator("verdict_schema", mode="before")
    @classmethod
    def _schema_model(cls, value: Any) -> Any:
        if isinstance(value, str):
            return _import_model(value)
        if isinstance(value, dict):
            return schema_model(value)
        return value

    def verdict_source(self) -> Literal["reply", "file"]:
        """A tool-less harness answers in its reply; a tools harness writes verdict.json."""
        return "file" if self.needs_runtime() else "reply"


def schema_model(fields: dict[str, Any], name: str = "Verdict") -> type[BaseModel]:
    """A strict pydantic model from a field table (every field required, no extras)."""
    definitions: dict[str, Any] = {}
    for field, spec in fields.items():
        spec = {"type": spec} if isinstance(spec, str) else dict(spec)
        kind = spec.pop("type", None)
        if kind not in _SCHEMA_TYPES:
            raise PlacementConfigError(
                f"verdict field {field!r}: type must be one of {sorted(_SCHEMA_TYPES)}"
            )
        constraints = {
            "ge": spec.pop("minimum", None),
            "le": spec.pop("maximum", None),
            "description": spec.pop("description", None),
        }
        if spec:
            raise PlacementConfigError(f"verdict field {field!r}: unknown keys {sorted(spec)}")
        definitions[field] = (
            _SCHEMA_TYPES[kind],
            Field(..., **{k: v for k, v in constraints.items() if v is not None}),
        )
    model: type[BaseModel] = create_model(
        name, __config__=ConfigDict(extra="forbid", strict=False), **definitions
    )
    return model


def _import_model(path: str) -> type[BaseModel]:
    module_name, _, attr = path.partition(":")
    try:
        value = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PlacementConfigError(f"cannot import verdict schema {path!r}: {exc}") from exc
    if not (isinstance(value, type) and issubclass(value, BaseModel)):
        raise PlacementConfigError(f"verdict schema {path!r} is not a pydantic model")
    return value


def load_judges(path: str | Path) -> list[JudgeSpec]:
    """Judges from a YAML/JSON file: ``{"judges": [{...}, ...]}`` or a bare list.

    Raises:
        PlacementConfigError: unreadable, malformed, or an invalid judge (field named).
    """
    source = Path(path)
    try:
        data = yaml.safe_load(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, RecursionError, yaml.YAMLError) as exc:
        raise PlacementConfigError(f"cannot read judges file {source}: {exc}") from exc
    items = data.get("judges") if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise PlacementConfigError(f"{source}: expected a non-empty list of judges")
    judges = []
    for index, item in enumerate(items):
        try:
            judges.append(JudgeSpec.model_validate(item))
        except ValidationError as exc:
            where = "; ".join(validation_lines(exc))
            raise PlacementConfigError(f"{source}: judge #{index}: {where}") from None
    names = [j.name for j in judges]
    if len(set(names)) != len(names):
        raise PlacementConfigError(f"{source}: judge names must be unique, got {names}")
    return judges
