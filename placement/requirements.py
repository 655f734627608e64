"""``vf-sandbox judge --require EXPR``: conditions every verdict must meet, for CI.

A requirement is parsed from a tiny grammar, never evaluated as code::

    EXPR  := [JUDGE ":"] PATH OP VALUE
    PATH  := KEY ("." KEY)*        KEY: letters, digits, "_" or "-", not starting with a digit
    OP    := "==" | "!=" | ">=" | "<=" | ">" | "<"
    VALUE := a JSON number, true, false, null, a JSON "string", or a bare word (a string)

``passed==true``, ``score>=0.5``, ``test-runner:checks.failed==0``, ``grade!="F"``. Without
``JUDGE:`` it applies to every judge's verdict. Verdicts come from sandboxes and are hostile:
a requirement holds only when the field is there and of the value's kind (numbers with
numbers, ``true``/``false`` with booleans only, strings with strings, ``null`` with null),
finite, and the comparison is true. Anything else — a failed judge (no verdict), a missing
field, another type, NaN or infinity — fails it, ``!=`` included; ``<``/``>``/``<=``/``>=``
take numbers only.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import PlacementConfigError

__all__ = ["Requirement", "parse_requirement"]

_KEY = r"[A-Za-z_][A-Za-z0-9_-]*"
_EXPR = re.compile(
    rf"^\s*(?:(?P<judge>[^:\s=!<>]+)\s*:)?\s*(?P<path>{_KEY}(?:\.{_KEY})*)\s*"
    r"(?P<op>==|!=|>=|<=|>|<)\s*(?P<value>.+?)\s*$"
)
_BARE_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_OPS: Mapping[str, Callable[[Any, Any], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
}
_SHOWN = 60
"""How much of a verdict's value a failure message quotes."""


def _kind(value: object) -> str | None:
    """The kind a value compares as, or ``None`` for one no requirement accepts."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "number"  # exact, however large (never converted to a float)
    if isinstance(value, float):
        return "number" if math.isfinite(value) else None
    if isinstance(value, str):
        return "string"
    return None


@dataclass(frozen=True)
class Requirement:
    """One parsed ``--require`` condition (see the module doc)."""

    text: str
    judge: str | None
    path: tuple[str, ...]
    op: str
    value: bool | int | float | str | None

    def applies_to(self, judge: str) -> bool:
        return self.judge is None or self.judge == judge

    def failure(self, verdict: object) -> str | None:
        """Why ``verdict`` (a judge's, hostile) does not meet this requirement, or ``None``
        when it does. Never raises, whatever the verdict holds."""
        if not isinstance(verdict, Mapping):
            return "no verdict"
        found: object = verdict
        for depth, key in enumerate(self.path):
            if not isinstance(found, Mapping) or key not in found:
                return f"{'.'.join(self.path[: depth + 1])} is missing"
            found = found[key]
        field = ".".join(self.path)
        kind, wanted = _kind(found), _kind(self.value)
        if kind is None or kind != wanted:
            shown = _describe(found)
            return f"{field} is {shown}, not a {wanted} (to compare with {self.op})"
        if _OPS[self.op](found, self.value):
            return None
        return f"{field} is {_describe(found)}"


def _describe(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= _SHOWN else text[: _SHOWN - 1] + "…"


def parse_requirement(text: str) -> Requirement:
    """A ``--require`` expression parsed (the grammar of the module doc).

    Raises:
        PlacementConfigError: not of the grammar; or an ordering operator with a value
            that is not a number.
    """
    match = _EXPR.match(text)
    if match is None:
        raise PlacementConfigError(
            f"--require {text!r}: expected [JUDGE:]FIELD OP VALUE with OP one of "
            "== != >= <= > < (for example 'score>=0.5' or 'passed==true')"
        )
    raw = match["value"]
    value: bool | int | float | str | None
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except ValueError:
        if not _BARE_WORD.match(raw):
            raise PlacementConfigError(
                f"--require {text!r}: the value {raw!r} is not a number, true, false, null, "
                'a "quoted string" or a bare word'
            ) from None
        value = raw
    if _kind(value) is None:
        raise PlacementConfigError(
            f"--require {text!r}: the value must be a number, true, false, null or a string"
        )
    if match["op"] not in ("==", "!=") and _kind(value) != "number":
        raise PlacementConfigError(f"--require {text!r}: {match['op']} compares numbers only")
    path = tuple(match["path"].split("."))
    return Requirement(text.strip(), match["judge"], path, match["op"], value)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a value")
