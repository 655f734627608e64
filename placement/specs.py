"""Agent and judge specs: who runs, with which model, where, under which budget."""

from __future__ import annotations

import importlib
import re
import string
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from harnesses.base import Budget
from harnesses.registry import load_harness_class, resolve_harness_config
from runtimes import RuntimeConfig, resolve_runtime_config
from runtimes.plugins import validation_lines

from .errors import PlacementConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

Placement = Literal["rollout", "fork"] | dict[str, Any]
"""``"rollout"``: inside the rollout's live runtime, after the policy finished. ``"fork"``:
in a fresh sandbox started from a snapshot of the rollout's sandbox, taken once after the
policy ended (its files, none of its processes). A runtime config (dict): a fresh clean-room
sandbox of its own."""

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

    def is_fork(self) -> bool:
        """Whether the agent runs in a fork of the rollout's sandbox (``placement="fork"``)."""
        return self.placement == "fork"

    def runtime_config(self) -> RuntimeConfig | None:
        """The clean-room runtime config, or ``None`` for placement in the rollout (or a
        fork of it)."""
        if not isinstance(self.placement, dict):
            return None
        return resolve_runtime_config(self.placement)

    def needs_runtime(self) -> bool:
        return load_harness_class(resolve_harness_config(self.harness).id).needs_runtime


PROMPT_VARIABLES = ("inputs_dir", "verdict_path", "schema", "task", "transcript")
"""What a ``template=True`` prompt may name as ``$name`` / ``${name}``."""


class JudgeSpec(AgentSpec):
    """A judge: an agent whose output is a verdict validated against ``verdict_schema``.

    ``prompt`` arrives rendered and is used as written: a ``$task`` in it stays ``$task``.
    With ``template=True`` it is a :class:`string.Template` over :data:`PROMPT_VARIABLES`
    (``$inputs_dir``, ``$verdict_path``, ``$schema``, ``$task``, ``$transcript``), ``$$``
    writes one ``$``, and an unknown name or a stray ``$`` is refused when the spec is made.
    ``verdict_schema`` is a pydantic model, an import path (``"pkg.mod:Model"``), or a
    field table (``{"score": {"type": "number", "minimum": 0}}`` or ``{"passed":
    "boolean"}``); see :func:`schema_model`.
    """

    model: str = "grader"
    trainable: bool = False
    prompt: str
    template: bool = False
    verdict_schema: type[BaseModel]
    verdict_max_bytes: int = Field(default=1 << 20, gt=0)

    @model_validator(mode="after")
    def _check_template(self) -> JudgeSpec:
        if self.template:
            check_prompt_template(self.prompt)
        return self

    @field_validator("trainable")
    @classmethod
    def _refuse_trainable(cls, value: bool) -> bool:
        # A judge's calls go to its own endpoint from the model table, never through the
        # trainer's gate: there are no token ids or logprobs of it to train on, and a
        # policy trained on the judge that scores it would learn to please itself.
        if value:
            raise ValueError(
                "judges are not trainable: their model calls do not pass through the "
                "trainer (see docs/sessions.md, 'Provenance'); drop trainable=True"
            )
        return value

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


def check_prompt_template(prompt: str) -> None:
    """Raises ValueError: ``prompt`` is not a valid template over :data:`PROMPT_VARIABLES`."""
    template = string.Template(prompt)
    if not template.is_valid():
        raise ValueError("the prompt template has a stray '$' (write '$$' for a literal '$')")
    unknown = sorted(set(template.get_identifiers()) - set(PROMPT_VARIABLES))
    if unknown:
        raise ValueError(f"the prompt template names {unknown}; it may use {PROMPT_VARIABLES}")


class FieldTableVerdict(BaseModel):
    """Base of the verdict models :func:`schema_model` builds: strict (no coercion), no
    extra fields, and no NaN or Infinity except in the fields named in
    :attr:`non_finite_fields`."""

    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, ser_json_inf_nan="constants"
    )

    non_finite_fields: ClassVar[frozenset[str]] = frozenset()


def schema_model(fields: dict[str, Any], name: str = "Verdict") -> type[BaseModel]:
    """A strict pydantic model from a field table (every field required, no extras).

    Each field is a type name or ``{"type": ..., "minimum": ..., "maximum": ...,
    "description": ..., "allow_inf_nan": bool}``. Values are never coerced (``"yes"`` or
    ``1`` is not a boolean, ``"3"`` not a number); a ``number`` field refuses ``NaN`` and
    ``Infinity`` unless it says ``allow_inf_nan: true``.

    Raises:
        PlacementConfigError: an unknown type or key, or ``allow_inf_nan`` on a field that
            is not a number.
    """
    definitions: dict[str, Any] = {}
    non_finite: set[str] = set()
    for field, spec in fields.items():
        spec = {"type": spec} if isinstance(spec, str) else dict(spec)
        kind = spec.pop("type", None)
        if kind not in _SCHEMA_TYPES:
            raise PlacementConfigError(
                f"verdict field {field!r}: type must be one of {sorted(_SCHEMA_TYPES)}"
            )
        allow_inf_nan = spec.pop("allow_inf_nan", False)
        if allow_inf_nan not in (True, False) or (allow_inf_nan and kind != "number"):
            raise PlacementConfigError(
                f"verdict field {field!r}: allow_inf_nan is true or false, on a number field"
            )
        constraints = {
            "ge": spec.pop("minimum", None),
            "le": spec.pop("maximum", None),
            "description": spec.pop("description", None),
            "allow_inf_nan": True if allow_inf_nan else None,
        }
        if spec:
            raise PlacementConfigError(f"verdict field {field!r}: unknown keys {sorted(spec)}")
        if allow_inf_nan:
            non_finite.add(field)
        definitions[field] = (
            _SCHEMA_TYPES[kind],
            Field(..., **{k: v for k, v in constraints.items() if v is not None}),
        )
    model: type[FieldTableVerdict] = create_model(name, __base__=FieldTableVerdict, **definitions)
    model.non_finite_fields = frozenset(non_finite)
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
            where = "; ".join(validation_lines(exc, JudgeSpec))
            raise PlacementConfigError(f"{source}: judge #{index}: {where}") from None
    names = [j.name for j in judges]
    if len(set(names)) != len(names):
        raise PlacementConfigError(f"{source}: judge names must be unique, got {names}")
    return judges
