"""Entry-point plugin groups, shared by the runtime and harness registries.

Listing a group imports nothing. Loading a plugin that raises on import, or that is not
a subclass of the group's base class, raises the group's plugin error naming the
distribution that ships it; the other plugins are unaffected.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Generic, TypeVar, cast

from pydantic import BaseModel, ValidationError

T = TypeVar("T")


@dataclass(frozen=True)
class Plugin:
    """A registered plugin, as its entry point declares it (nothing imported)."""

    name: str
    value: str
    distribution: str

    def describe(self) -> str:
        return f"{self.name} ({self.value}, from {self.distribution})"


class PluginGroup(Generic[T]):
    """The plugins of one entry-point group whose objects are subclasses of ``base``.

    ``kind`` names them in messages ("runtime", "harness"); ``unknown_error`` is raised
    for a name nobody registered, ``plugin_error`` for a plugin that cannot be loaded.
    ``adapt`` is ``(other, convert)``: a subclass of ``other`` is accepted too, as
    ``convert`` makes it into a subclass of ``base`` (the runtime registry composes a
    :class:`runtimes.Runtime` around a :class:`runtimes.Backend`).
    """

    def __init__(
        self,
        group: str,
        kind: str,
        base: type[Any],
        *,
        unknown_error: type[Exception],
        plugin_error: type[Exception],
        adapt: tuple[type[Any], Callable[[Any], type[Any]]] | None = None,
    ):
        self.group = group
        self.kind = kind
        self.base = base
        self._unknown_error = unknown_error
        self._plugin_error = plugin_error
        self._adapt = adapt
        self._loaded: dict[str, type[Any]] = {}
        self._lock = threading.Lock()

    def _entry_points(self) -> dict[str, EntryPoint]:
        found: dict[str, EntryPoint] = {}
        for ep in entry_points(group=self.group):
            found.setdefault(ep.name, ep)
        return found

    def available(self) -> dict[str, Plugin]:
        """Every registered plugin, loaded or not (cheap: imports nothing)."""
        return {
            name: Plugin(name, ep.value, _distribution(ep))
            for name, ep in sorted(self._entry_points().items())
        }

    def load(self, name: str) -> type[T]:
        """The class registered under ``name`` (imported once, then cached).

        Raises:
            unknown_error: nothing is registered under ``name`` (the message lists what is).
            plugin_error: the plugin raised on import or is not a subclass of ``base``;
                the message names its distribution.
        """
        with self._lock:
            if name in self._loaded:
                return cast("type[T]", self._loaded[name])
        eps = self._entry_points()
        ep = eps.get(name)
        if ep is None:
            known = ", ".join(sorted(eps)) or "none"
            raise self._unknown_error(
                f"unknown {self.kind} {name!r}{did_you_mean(name, eps)} (registered: {known})"
            )
        where = f"{self.kind} plugin {name!r} from package {_distribution(ep)!r} ({ep.value})"
        try:
            loaded = ep.load()
        except Exception as exc:
            raise self._plugin_error(
                f"{where} failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        if not (isinstance(loaded, type) and issubclass(loaded, self.base)):
            other, convert = self._adapt or (None, None)
            if other is None or convert is None or not _subclass(loaded, other):
                bases = " or ".join(_qualified(b) for b in (self.base, other) if b is not None)
                raise self._plugin_error(f"{where} is not a {bases} subclass")
            loaded = convert(loaded)
        with self._lock:
            self._loaded[name] = loaded
        return cast("type[T]", loaded)

    def clear_cache(self) -> None:
        """Forget loaded classes (tests that install plugins on the fly use it)."""
        with self._lock:
            self._loaded.clear()


def _subclass(loaded: object, base: type[Any]) -> bool:
    return isinstance(loaded, type) and issubclass(loaded, base)


def _qualified(base: type[Any]) -> str:
    return f"{base.__module__.split('.')[0]}.{base.__name__}"


def _distribution(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist else "unknown distribution"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``"; did you mean a, b?"`` naming up to three of ``known`` close to ``name`` (difflib),
    or ``""`` when none is close: the hint every "unknown name" message of vf-sandbox ends
    with (backend types, config keys, ``check --select``)."""
    close = difflib.get_close_matches(name, list(known), n=3)
    return f"; did you mean {', '.join(close)}?" if close else ""


def validation_lines(exc: ValidationError, model: type[BaseModel] | None = None) -> list[str]:
    """``field.path: message`` for each error, never echoing the input (secrets stay out).

    With ``model`` (the model that was validated), an unknown top-level key (pydantic's
    ``extra_forbidden``) says which of its fields it may be a typo of.
    """
    fields = list(model.model_fields) if model is not None else []
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"]) or "(config)"
        hint = ""
        if err["type"] == "extra_forbidden" and len(err["loc"]) == 1:
            hint = did_you_mean(str(err["loc"][0]), fields)
        lines.append(f"{where}: {err['msg']}{hint}")
    return lines
