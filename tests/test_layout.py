"""The shape the packages promise (docs/design.md, "Faces"): every module under 600 lines, no
module reaching into another's private names, and imports going one way (runtimes, then
harnesses, then placement).

These read the source, not the behaviour: they keep the faces that a newcomer reads from eroding
one commit at a time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtimes", "harnesses", "placement")
MAX_LINES = 600
LAYER = {name: rank for rank, name in enumerate(PACKAGES)}


def _modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _imported_modules(tree: ast.Module, path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports, as absolute dotted names, with the line of the import."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    if path.name == "__init__.py":
        package = list(path.relative_to(ROOT).parent.parts)
    found: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                found.append(
                    (".".join([*base, *([node.module] if node.module else [])]), node.lineno)
                )
            elif node.module is not None:
                found.append((node.module, node.lineno))
    return found


def test_the_packages_have_modules_to_check() -> None:
    assert len(_modules()) > 100


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_module_imports_another_modules_private_names() -> None:
    reaching: list[str] = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if _private(alias.name):
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        reaching.append(f"{where} {node.module or '.'}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if any(_private(part) for part in alias.name.split(".")):
                        reaching.append(f"{path.relative_to(ROOT)}:{node.lineno} {alias.name}")
    assert reaching == []


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_go_one_way(package: str) -> None:
    upward: list[str] = []
    for path in (ROOT / package).rglob("*.py"):
        for module, line in _imported_modules(ast.parse(path.read_text()), path):
            top = module.split(".")[0]
            if top in LAYER and LAYER[top] > LAYER[package]:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert upward == []
