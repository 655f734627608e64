"""Reading a verdict: bytes from the sandbox (or a model's reply) to a validated dict.

Every verdict a judge produced is hostile input. Whatever it holds, reading it ends in
exactly one of two ways: the verdict validated against the judge's schema, or
:class:`~placement.errors.VerdictInvalid`. The JSON must be strict UTF-8 with no
byte-order mark, with no repeated key in an object (parsers disagree on which one wins)
and no integer longer than Python will parse; nesting too deep for the parser, and NaN
or Infinity (``1e999`` included) where the schema does not allow them, are invalid too.
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ValidationError

from harnesses.base import Trace
from harnesses.null import parse_reply_json

from .errors import (
    JudgeAgentFailed,
    JudgeBudgetExceeded,
    JudgeModelFailed,
    JudgeSandboxLost,
    JudgeSetupFailed,
    VerdictInvalid,
)
from .guard import VerdictGuard
from .specs import FieldTableVerdict, JudgeSpec

__all__ = ["load_verdict_json", "read_file_verdict", "read_reply_verdict", "validate_verdict"]

_BOM = "\ufeff"


class _DuplicateKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(f"the key {json.dumps(key)[:80]} appears twice in one object")
        result[key] = value
    return result


def load_verdict_json(text: str) -> Any:
    """The JSON value of ``text``, strictly.

    Raises:
        ValueError: not JSON, a byte-order mark, an unpaired surrogate, a repeated key,
            an integer over Python's digit limit, or nesting too deep to parse (the
            message says which; it never echoes more than a few bytes of ``text``).
    """
    if text.startswith(_BOM):
        raise ValueError("it starts with a byte-order mark")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("it is not valid UTF-8") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError("it is nested too deeply to parse") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"it is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except _DuplicateKey as exc:
        raise ValueError(str(exc)) from None
    except ValueError as exc:  # int digits over sys.get_int_max_str_digits(), ...
        raise ValueError(f"it is not JSON Python can read: {str(exc)[:200]}") from None


def read_file_verdict(spec: JudgeSpec, raw: bytes, trace: Trace, path: str) -> dict[str, Any]:
    """The verdict in ``raw`` (the bytes of ``path``), validated.

    Raises:
        VerdictInvalid: not strict UTF-8 JSON, or not what the schema allows.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"{path} is not JSON: it is not UTF-8 (byte {exc.start})"
        raise VerdictInvalid(spec.name, message, trace) from None
    try:
        data = load_verdict_json(text)
    except ValueError as exc:
        raise VerdictInvalid(spec.name, f"{path} is not a valid verdict: {exc}", trace) from None
    return validate_verdict(spec, data, trace)


def read_reply_verdict(spec: JudgeSpec, reply: str | None, trace: Trace) -> dict[str, Any]:
    """The verdict a tool-less judge replied (bare JSON or one fenced ```json block),
    validated.

    Raises:
        VerdictInvalid: over the size cap, not in one of the two forms, not strict JSON,
            or not what the schema allows.
    """
    size = len((reply or "").encode("utf-8", "surrogateescape"))
    if size > spec.verdict_max_bytes:
        raise VerdictInvalid(
            spec.name, f"the reply is larger than {spec.verdict_max_bytes} bytes", trace
        )
    try:
        parse_reply_json(reply)  # the form: bare JSON, or exactly one ```json block
        body = (reply or "").strip()
        if body.startswith("```"):  # parse_reply_json matched the whole fenced block
            body = body[body.index("\n") + 1 : -3]
        data = load_verdict_json(body)
    except ValueError as exc:
        raise VerdictInvalid(spec.name, str(exc), trace) from None
    return validate_verdict(spec, data, trace)


def validate_verdict(spec: JudgeSpec, data: Any, trace: Trace) -> dict[str, Any]:
    """The verdict validated in pydantic's strict JSON mode (no coercion: ``"yes"`` and
    ``1`` are not booleans), with no NaN or Infinity outside the fields that allow them.

    Raises:
        VerdictInvalid: it does not match the schema.
    """
    schema = spec.verdict_schema
    non_finite = [p for p in _non_finite_paths(data) if not _allows_non_finite(schema, p)]
    if non_finite:
        where = ", ".join(".".join(str(k) for k in p) or "(verdict)" for p in non_finite[:5])
        message = f"verdict has NaN or Infinity where the schema does not allow it: {where}"
        raise VerdictInvalid(spec.name, message, trace)
    try:
        text = json.dumps(data)
        return schema.model_validate_json(text, strict=True).model_dump(mode="json")
    except RecursionError:
        raise VerdictInvalid(spec.name, "the verdict is nested too deeply", trace) from None
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(verdict)'}: {e['msg']}"
            for e in exc.errors(include_url=False, include_input=False)[:10]
        )
        message = f"verdict does not match the schema: {problems}"
        raise VerdictInvalid(spec.name, message, trace) from None
    except ValueError as exc:  # an integer too long to write out, ...
        message = f"the verdict cannot be validated: {str(exc)[:200]}"
        raise VerdictInvalid(spec.name, message, trace) from None


def _allows_non_finite(schema: type[BaseModel], path: tuple[str | int, ...]) -> bool:
    """A field table allows NaN/Infinity in its ``allow_inf_nan`` number fields; any other
    pydantic model only when its config sets ``allow_inf_nan=True`` explicitly."""
    if issubclass(schema, FieldTableVerdict):
        return len(path) == 1 and path[0] in schema.non_finite_fields
    return schema.model_config.get("allow_inf_nan") is True


def _non_finite_paths(data: Any) -> list[tuple[str | int, ...]]:
    """Where ``data`` (parsed JSON) holds NaN or +-Infinity (iteratively: no depth limit)."""
    found: list[tuple[str | int, ...]] = []
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            found.append(path)
        elif isinstance(value, dict):
            stack.extend(((*path, str(k)), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in enumerate(value))
    return sorted(found, key=str)


async def collect_verdict(
    spec: JudgeSpec, trace: Trace, guard: VerdictGuard | None
) -> dict[str, Any]:
    """The verdict of a judge whose run ended: its trace's failure as the typed
    :class:`~placement.errors.JudgeError`, else its reply's or its file's verdict, validated.

    Raises:
        JudgeBudgetExceeded / JudgeSandboxLost / JudgeSetupFailed / JudgeAgentFailed /
            JudgeModelFailed: the run failed, for that cause.
        VerdictMissing / VerdictInvalid / JudgeInputsTampered: the verdict is not the
            judge's valid own.
        SandboxError: the sandbox failed while the verdict was collected.
    """
    if trace.error is not None:
        kind, message = trace.error.kind, trace.error.message
        if kind.startswith("budget_"):
            raise JudgeBudgetExceeded(spec.name, message, trace)
        if kind == "sandbox_error":
            raise JudgeSandboxLost(spec.name, message, trace)
        if kind == "install_error":
            raise JudgeSetupFailed(spec.name, message, trace)
        if kind == "agent_error":
            raise JudgeAgentFailed(spec.name, message, trace)
        raise JudgeModelFailed(spec.name, f"{kind}: {message}", trace)
    if spec.verdict_source() == "reply":
        return read_reply_verdict(spec, trace.output, trace)
    assert guard is not None
    raw = await guard.collect(trace)
    return read_file_verdict(spec, raw, trace, guard.path)
