"""Every dependency floor pyproject.toml declares is one that was installed and run.

A floor (``name>=X``) is proven one of two ways: pinned as ``name==X`` in tests/floors.txt,
which ``make floors`` (part of ``make test``) installs into a venv of its own and runs a part
of the suite on; or it is the very version the main venv runs the whole suite on. A floor that
is neither (raised code, a new dependency, a newer release on the index) fails here, naming
it. Exact pins (``name==X``) are what the main venv installs, so they need nothing more.
"""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def _declared() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(text) for text in project["dependencies"]]
    for group in project["optional-dependencies"].values():
        found += [Requirement(text) for text in group]
    return [r for r in found if canonicalize_name(r.name) != "vf-sandbox"]


def _floor(requirement: Requirement) -> Version | None:
    floors = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return max(floors) if floors else None


def _pinned() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (ROOT / "tests" / "floors.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line)
            assert match, f"tests/floors.txt: not an exact pin: {line!r}"
            pins[canonicalize_name(match[1])] = Version(match[2])
    return pins


def _installed(name: str) -> Version:
    return Version(Version(importlib.metadata.version(name)).base_version)  # 2.13.0+cpu


def test_every_declared_floor_is_pinned_for_the_floors_run_or_is_what_the_suite_runs() -> None:
    pins = _pinned()
    unproven: list[str] = []
    for requirement in _declared():
        floor = _floor(requirement)
        if floor is None:
            continue
        name = canonicalize_name(requirement.name)
        if name in pins:
            if pins[name] != floor:
                unproven.append(f"{requirement}: tests/floors.txt pins {pins[name]}")
        elif _installed(requirement.name) != floor:
            unproven.append(
                f"{requirement}: neither in tests/floors.txt nor the version installed here "
                f"({_installed(requirement.name)})"
            )
    assert not unproven, "declared floors nobody ran:\n" + "\n".join(unproven)


def test_the_floors_file_pins_only_declared_dependencies() -> None:
    declared = {canonicalize_name(r.name) for r in _declared()}
    stray = sorted(set(_pinned()) - declared)
    assert not stray, f"tests/floors.txt pins what pyproject.toml does not declare: {stray}"
