"""Resource limits with one set of names and units across backends (``docs/resources.md``).

:class:`ResourceLimits` holds the fields every runtime config has (through
:class:`~runtimes.config.RuntimeConfig`): ``cpus`` (cores), ``memory`` (MiB, or a size with a
unit), ``pids_limit`` (processes) and ``disk`` (MiB, the same units). A backend lists the
ones it enforces in ``enforced_limits``; setting any other is a config error naming the
field and saying why, so a limit is never silently ignored (third-party backends enforce
none until they say so).

``memory`` is parsed by :func:`memory_mib`, the one validator of sizes: an int is MiB; a string
is a number with an optional unit ``b``, ``k``, ``m``, ``g`` or ``t`` (any case, optionally
followed by ``i`` and/or ``b``: ``"512m"``, ``"512MiB"``, ``"2GiB"``, ``"2g"``), always binary
(1024-based, as Docker reads ``"512m"``); a bare number string is MiB like an int. Byte counts
(``output_limit``, ``read_limit``) take the same strings through :func:`byte_count`, where an
int or a bare number string is bytes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "LIMIT_FIELDS",
    "MIB",
    "MIN_MEMORY_MIB",
    "ByteCount",
    "DiskMiB",
    "MemoryMiB",
    "ResourceLimits",
    "byte_count",
    "disk_mib",
    "format_mib",
    "memory_mib",
    "rename_old_fields",
]

MIB = 1 << 20
MIN_MEMORY_MIB = 6
"""The smallest memory limit: Docker's (the engine refuses less than 6 MB)."""

_BYTES_LIKE_MIB = 1 << 24
"""Ints from here (16 TiB as MiB) are taken for byte counts of the old Docker ``memory``."""

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*(?:([bkmgt])(i?b?))?$", re.IGNORECASE)
_UNIT_BYTES = {"b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

LIMIT_FIELDS = ("cpus", "memory", "pids_limit", "disk")
"""The resource limits of the common config."""


def memory_mib(value: Any) -> Any:
    """A ``memory`` setting as whole MiB (pydantic before-validator: anything that is not an
    int or a size string is left for pydantic to refuse).

    Raises:
        ValueError: not a size, not a whole number of MiB, below :data:`MIN_MEMORY_MIB`, or an
            int so large it is surely a byte count (the old Docker unit).
    """
    if isinstance(value, bool):
        raise ValueError("memory must be MiB (an int) or a size string, not a bool")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        mib = value
    elif isinstance(value, str):
        mib = _parse_size(value)
    else:
        return value
    if mib >= _BYTES_LIKE_MIB:
        raise ValueError(
            f"memory is in MiB: {value!r} looks like a byte count, "
            f"write {format_mib(int(mib) // MIB)!r} for that many bytes"
        )
    if mib < MIN_MEMORY_MIB:
        raise ValueError(f"memory must be at least {MIN_MEMORY_MIB} MiB, got {value!r}")
    return mib


def _parse_size(text: str) -> int:
    try:
        size, unitless = _size_bytes(text)
    except ValueError:
        raise ValueError(
            f"memory must be MiB (an int) or a size with a unit like '512MiB', '2GiB' or "
            f"'512m', got {text!r}"
        ) from None
    if unitless:
        size *= MIB
    if size % MIB:
        raise ValueError(f"memory must be a whole number of MiB, got {text!r}")
    return int(size) // MIB


def _size_bytes(text: str) -> tuple[float, bool]:
    """A size string as bytes (not yet checked to be whole), and whether it had no unit.

    Raises:
        ValueError: not a number with an optional unit.
    """
    match = _SIZE.match(text.strip())
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    number, unit, _suffix = match.groups()
    if unit is None:
        return float(number), True
    return float(number) * _UNIT_BYTES[unit.lower()], False


def byte_count(value: Any) -> Any:
    """A count of bytes (``output_limit``, ``read_limit``, ``exec --output-limit``): an int is
    bytes; a string is a size in the units of ``memory`` (``"1GiB"``, ``"512m"``, ``"64KiB"``,
    binary), a bare number string is bytes like an int (pydantic before-validator: anything
    else is left for pydantic to refuse).

    Raises:
        ValueError: a bool, not a size, or not a whole number of bytes.
    """
    if isinstance(value, bool):
        raise ValueError("a byte count is an int or a size string like '1GiB', not a bool")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, str):
        return value
    try:
        size, _unitless = _size_bytes(value)
    except ValueError:
        raise ValueError(
            f"a byte count is an int (bytes) or a size with a unit like '64KiB', '1GiB' or "
            f"'512m', got {value!r}"
        ) from None
    if not size.is_integer():
        raise ValueError(f"a byte count must be a whole number of bytes, got {value!r}")
    return int(size)


def format_mib(mib: int) -> str:
    """``2048`` -> ``"2GiB"``, ``100`` -> ``"100MiB"`` (for messages)."""
    return f"{mib >> 10}GiB" if mib and mib % 1024 == 0 else f"{mib}MiB"


MemoryMiB = Annotated[int, BeforeValidator(memory_mib)]

ByteCount = Annotated[int, BeforeValidator(byte_count)]
"""Bytes: an int, or a size string in the units of ``memory`` (:func:`byte_count`)."""


def disk_mib(value: Any) -> Any:
    """A ``disk`` size as whole MiB: the same units as ``memory`` (:func:`memory_mib`).

    Raises:
        ValueError: not a size, not a whole number of MiB, or below 6 MiB.
    """
    try:
        return memory_mib(value)
    except ValueError as exc:
        raise ValueError(str(exc).replace("memory", "disk")) from None


DiskMiB = Annotated[int, BeforeValidator(disk_mib)]


def rename_old_fields(data: Any, renamed: dict[str, str]) -> Any:
    """A config's raw input with old field names moved to their new names (a before-validator
    helper; the old names keep working).

    Raises:
        ValueError: an old name and its new name are both given.
    """
    if not isinstance(data, dict) or not any(old in data for old in renamed):
        return data
    data = dict(data)
    for old, new in renamed.items():
        if old in data:
            if new in data:
                raise ValueError(f"{old!r} is the old name of {new!r}: give only {new!r}")
            data[new] = data.pop(old)
    return data


class ResourceLimits(BaseModel):
    """The resource limit fields (a base of :class:`~runtimes.config.RuntimeConfig`).

    ``cpus``: cores the sandbox may use (fractions allowed). ``memory``: the most memory its
    processes may hold together, in MiB (or a size with a unit); a command the limit kills
    raises :class:`~runtimes.errors.SandboxResourceError` where the backend can tell.
    ``pids_limit``: the most processes (and threads) alive at once. ``disk``: the most the
    workload may write, in MiB (or a size with a unit). ``None``: no limit set by
    vf-sandbox. The old name ``cpu`` still works for ``cpus``. What each backend makes of
    them: ``docs/resources.md``.
    """

    enforced_limits: ClassVar[frozenset[str]] = frozenset()
    """The fields of :data:`LIMIT_FIELDS` this backend enforces; the rest are refused."""
    unenforced_reason: ClassVar[str] = "it has no way to enforce it (docs/resources.md)"
    """Why the others are refused (ends the error message)."""
    unenforced_reasons: ClassVar[Mapping[str, str]] = {}
    """A field's own reason, where it differs from :attr:`unenforced_reason`."""

    cpus: float | None = Field(default=None, gt=0, description="cores")
    memory: MemoryMiB | None = Field(default=None, description="MiB, or '512MiB', '2GiB', '512m'")
    pids_limit: int | None = Field(default=None, gt=0, description="processes and threads")
    disk: DiskMiB | None = Field(default=None, description="MiB, or '512MiB', '2GiB', '512m'")

    @model_validator(mode="before")
    @classmethod
    def _old_limit_names(cls, data: Any) -> Any:
        return rename_old_fields(data, {"cpu": "cpus"})

    @field_validator(*LIMIT_FIELDS)
    @classmethod
    def _enforceable(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None and info.field_name not in cls.enforced_limits:
            kind = getattr(cls.model_fields.get("type"), "default", None) or cls.__name__
            reason = cls.unenforced_reasons.get(info.field_name or "", cls.unenforced_reason)
            raise ValueError(f"the {kind!r} runtime cannot enforce {info.field_name}: {reason}")
        return value
