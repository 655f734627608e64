"""Attack class 13: the inventory of everything the host runs inside a sandbox stays true.

docs/security.md ("What the host runs inside a sandbox") has one row per place in the code
that starts a program in a sandbox: module, function, account, cwd, interpreter, ``PATH``
and what it reads. This test finds those places itself, by an AST scan of ``runtimes/``,
``harnesses/`` and ``placement/`` for the calls that start a program in a sandbox (see
:data:`CALLS`), and compares the two sets both ways: a new call site without its row fails,
and so does a row whose call site is gone. Run it after adding or moving a call, then fill
in the row: who runs it, from where, with which interpreter and ``PATH``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runtimes", "harnesses", "placement")
SKIP = ("runtimes/testing/",)  # the conformance suite: it runs what its caller's test asks

CALLS = frozenset(
    {
        "exec",  # Runtime.exec, the channel's exec, a Modal Sandbox.exec (passed as a callable)
        "shell",  # Runtime.shell: a persistent bash
        "run_machinery",  # runtimes.machinery: the machinery's commands
        "_internal",  # a runtime's bookkeeping request (run by _routed_exec / _exec)
        "bookkeeping_request",  # the same, built for a backend (runtimes.backend)
        "_run_as_machinery",  # the policy/judge account's creation
        "kill_as_root",  # Docker: a kill outside the wrapper
        "exec_create",  # Docker engine API
        "exec_command",  # SSH (paramiko): a command on the login's shell
        "Popen",  # the subprocess backend; the channel agent spawning a command
        "execve",  # the shell driver becoming bash
    }
)
"""Names whose call (or whose bound method handed to a helper) starts a program in a
sandbox."""

QUALIFIED = frozenset({("containers", "create"), ("Sandbox", "create")})
"""``X.create`` calls that start a sandbox's first process (its keep-alive command)."""


def _hit(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in CALLS
    if not isinstance(node, ast.Attribute):
        return False
    if node.attr in CALLS:
        return True
    owner = node.value
    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
    return (name, node.attr) in QUALIFIED


def sites_in(text: str, module: str) -> Iterator[tuple[str, str]]:
    """(module, qualified function) of each call site in one module's source."""

    def visit(node: ast.AST, scope: tuple[str, ...]) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                yield from visit(child, (*scope, child.name))
                continue
            if isinstance(child, ast.Call):
                # a bound method handed to a helper that calls it: `_call(sandbox.exec, ...)`
                handed = [a for a in child.args if isinstance(a, ast.Attribute) and _hit(a)]
                # (``_internal`` only builds the request: its callers are the sites)
                wrapper = bool(scope) and scope[-1] == "_internal"
                if (_hit(child.func) or handed) and not wrapper:
                    yield module, ".".join(scope) or "<module>"
            yield from visit(child, scope)

    if any(name in text for name in CALLS | {"create"}):
        yield from visit(ast.parse(text), ())


def call_sites() -> set[tuple[str, str]]:
    """Every (module, function) of runtimes/, harnesses/, placement/ that starts a program
    in a sandbox."""
    found: set[tuple[str, str]] = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            if relative.startswith(SKIP):
                continue
            module = relative.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            found |= set(sites_in(path.read_text(encoding="utf-8"), module))
    return found


def inventory_rows() -> set[tuple[str, str]]:
    """(module, function) of each row of the inventory table in docs/security.md."""
    text = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    start = text.index("## What the host runs inside a sandbox")
    end = text.index("\n## ", start + 1)
    rows = set()
    for line in text[start:end].splitlines():
        match = re.match(r"\|\s*`([\w.]+)`\s*\|\s*`([\w.<>]+)`\s*\|", line)
        if match:
            rows.add((match.group(1), match.group(2)))
    return rows


@pytest.mark.attack(13)
def test_every_call_site_has_its_row_and_every_row_its_call_site() -> None:
    sites = call_sites()
    rows = inventory_rows()
    assert sites, "the scan found no call site: CALLS no longer names the API"
    missing = sorted(sites - rows)
    stale = sorted(rows - sites)
    assert not missing, (
        "new call sites that run a program in a sandbox, without their row in docs/security.md "
        f"('What the host runs inside a sandbox'): {missing}"
    )
    assert not stale, f"rows of the inventory whose call site is gone: {stale}"


@pytest.mark.attack(13)
def test_the_scan_sees_a_new_call_site() -> None:
    """The scan itself: a call it must find, and a look-alike it must not."""
    source = (
        "class H:\n"
        "    async def probe(self, rt):\n"
        "        await rt.exec(['python3', '-c', 'x'])\n"
        "    async def fine(self, x: 'subprocess.Popen[bytes]') -> 'subprocess.Popen[bytes]':\n"
        "        return x.execute()\n"
        "async def made(sandbox):\n"
        "    def inner():\n"
        "        return call(sandbox.exec, 'sh')\n"
        "    return inner\n"
    )
    assert set(sites_in(source, "m")) == {("m", "H.probe"), ("m", "made.inner")}
