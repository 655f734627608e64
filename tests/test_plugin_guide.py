"""The plugin guide (docs/plugins.md) is complete: a plugin built only from its code blocks
passes the whole conformance kit, and `ls`/`cleanup` see and remove its sandboxes.

The blocks titled with a file name (```python title="pkg/mod.py"```) are put together, in the
guide's order, into a package in a temporary directory. It is used without being installed: a
``.dist-info`` directory beside it carries the entry point the guide's ``pyproject.toml`` declares,
so the registry finds it through ``sys.path`` (``PYTHONPATH`` for the subprocesses) exactly as it
finds an installed plugin.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from xml.etree import ElementTree

import anyio
import pytest

from runtimes import (
    Runtime,
    RuntimeConfigError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInfo,
    SandboxNotADirectoryError,
    ownership,
)
from runtimes.cleanup import cleanup_sandboxes
from runtimes.registry import RUNTIMES, available_runtimes, load_runtime_class, open_runtime
from runtimes.testing import CHECKS
from tests.nonroot import conformance_as_nobody

pytest_plugins = ["pytester"]

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
_TITLED_BLOCK = re.compile(r'^```(\w+) title="([^"]+)"\n(.*?)^```$', re.MULTILINE | re.DOTALL)
ENTRY_POINT_GROUP = "vf_sandbox.runtimes"
ROOT_SKIPS = {"unreadable_file", "unwritable_directory"}
"""The checks the kit skips inside a root sandbox (nothing is unreadable for root)."""
CLI_SELECTION = {
    *ROOT_SKIPS,
    "stdout_exact",
    "write_overwrites",
    "stdin_iterable_answers_line_by_line",
    "stream_order_within_stream",
    "shell_state_persists",
}


def guide_files() -> dict[str, str]:
    """Each file the guide's titled blocks make, its parts joined in the guide's order."""
    parts: dict[str, list[str]] = {}
    for _lang, name, body in _TITLED_BLOCK.findall(GUIDE.read_text()):
        parts.setdefault(name, []).append(body)
    return {name: _join(bodies) for name, bodies in parts.items()}


def _join(bodies: list[str]) -> str:
    """One file from its parts: a part that goes on inside a class (indented) follows after one
    blank line, a top-level one after two, as the file would be laid out."""
    text = bodies[0]
    for body in bodies[1:]:
        text += ("\n" if body.startswith(" ") else "\n\n") + body
    return text


def _write_dist_info(project: Path, pyproject: str) -> tuple[str, dict[str, str]]:
    """A ``.dist-info`` for the guide's ``pyproject.toml``: what ``pip install`` would record."""
    meta = tomllib.loads(pyproject)["project"]
    entry_points: dict[str, str] = meta["entry-points"][ENTRY_POINT_GROUP]
    dist_info = project / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
    )
    lines = [f"[{ENTRY_POINT_GROUP}]", *(f"{k} = {v}" for k, v in entry_points.items())]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return meta["name"], entry_points


@pytest.fixture(scope="module")
def guide_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The guide's package, written out with its dist-info (not installed)."""
    project = tmp_path_factory.mktemp("guide-plugin")
    files = guide_files()
    assert {"pyproject.toml", "tests/test_tinybox.py"} <= set(files), sorted(files)
    for name, text in files.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    _dist, entry_points = _write_dist_info(project, files["pyproject.toml"])
    assert entry_points == {"tinybox": "vf_sandbox_tinybox:TinyboxBackend"}
    return project


@pytest.fixture
def tinybox(guide_project: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Runtime]]:
    """The guide's runtime class, loaded through the registry in this process."""
    monkeypatch.syspath_prepend(str(guide_project))
    RUNTIMES.clear_cache()
    try:
        yield load_runtime_class("tinybox")
    finally:
        RUNTIMES.clear_cache()
        for name in [m for m in sys.modules if m.split(".")[0] == "vf_sandbox_tinybox"]:
            del sys.modules[name]


@pytest.fixture
def box_root() -> Iterator[Path]:
    """A sandbox root any user may write (pytest's tmp_path is root-only)."""
    root = Path(tempfile.mkdtemp(prefix="vf-tinybox-test-"))
    root.chmod(0o777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _subprocess_env(guide_project: Path, tmp: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(guide_project), "TMPDIR": str(tmp)}


def test_registry_finds_the_guide_plugin(tinybox: type[Runtime], guide_project: Path) -> None:
    found = available_runtimes()["tinybox"]
    assert (found.value, found.distribution) == (
        "vf_sandbox_tinybox:TinyboxBackend",
        "vf-sandbox-tinybox",
    )
    assert tinybox.__module__ == "vf_sandbox_tinybox"
    assert Path(sys.modules["vf_sandbox_tinybox"].__file__ or "").is_relative_to(guide_project)


def test_guide_plugin_passes_vf_sandbox_check(guide_project: Path, tmp_path: Path) -> None:
    """`vf-sandbox check --runtime tinybox`, as the guide says to run it: nothing fails. The
    whole kit runs on the guide's plugin in test_guide_pytest_suite_passes (asyncio and trio);
    here the command, on one check of each module plus the two a root sandbox skips."""
    selection = [arg for name in sorted(CLI_SELECTION) for arg in ("--select", name)]
    result = subprocess.run(
        [
            sys.executable,
            *("-m", "placement.cli", "check", "--runtime", '{"type": "tinybox"}'),
            *selection,
        ],
        capture_output=True,
        text=True,
        env=_subprocess_env(guide_project, tmp_path),
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[:1]]
    statuses = {row[0]: row[1] for row in rows if len(row) > 1 and row[0] in _check_names()}
    assert set(statuses) == CLI_SELECTION, result.stdout
    expected_skips = ROOT_SKIPS if os.geteuid() == 0 else set()
    assert {n for n, s in statuses.items() if s != "PASS"} == expected_skips, result.stdout
    assert {n for n, s in statuses.items() if s == "SKIP"} == expected_skips, result.stdout
    assert list(tmp_path.glob("vf-tinybox/box-*")) == [], "a check left its sandbox behind"


def test_guide_pytest_suite_passes(guide_project: Path, pytester: pytest.Pytester) -> None:
    """The guide's `RuntimeConformance` test module, run by pytest in a user's project: every
    check is one test, under asyncio and trio. Its checks mostly wait (timeouts, sleeps), so
    the module runs as two pytest processes side by side, each given every other check."""
    pytester.makepyfile(test_tinybox=(guide_project / "tests" / "test_tinybox.py").read_text())
    env = _subprocess_env(guide_project, pytester.path)
    ids = [f"test_tinybox.py::TestTinybox::test_conformance[{c.name}]" for c in CHECKS]
    halves = [_start_pytest(pytester.path, f"half{i}", ids[i::2], env) for i in range(2)]
    try:
        reports = [_finish_pytest(pytester.path, name, proc) for name, proc in halves]
    finally:
        for _name, proc in halves:
            proc.kill()  # only one still running after a failure
    outcomes = {case: outcome for report in reports for case, outcome in report.items()}
    assert sorted(outcomes) == sorted(c.name for c in CHECKS)
    failed = {
        name: outcome for name, outcome in outcomes.items() if outcome not in ("passed", "skipped")
    }
    assert not failed, failed
    expected_skips = ROOT_SKIPS if os.geteuid() == 0 else set()
    assert {n for n, outcome in outcomes.items() if outcome == "skipped"} == expected_skips


def _start_pytest(
    cwd: Path, name: str, ids: list[str], env: dict[str, str]
) -> tuple[str, subprocess.Popen[bytes]]:
    """pytest on ``ids`` in ``cwd``, as a user would run it, with a JUnit report ``name``.xml."""
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-ra"]
    argv += [f"--basetemp={cwd / f'basetemp-{name}'}", f"--junitxml={cwd / f'{name}.xml'}", *ids]
    with (cwd / f"{name}.log").open("wb") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return name, proc


def _finish_pytest(cwd: Path, name: str, proc: subprocess.Popen[bytes]) -> dict[str, str]:
    """Each check's outcome (passed, skipped, failure, error) in the finished run ``name``."""
    proc.wait(timeout=900)
    output = (cwd / f"{name}.log").read_text(errors="replace")
    assert proc.returncode == 0, output
    outcomes = {}
    for case in ElementTree.parse(cwd / f"{name}.xml").iter("testcase"):
        check = re.fullmatch(r"test_conformance\[(\w+)\]", case.get("name", ""))
        assert check is not None, (case.attrib, output)
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[check.group(1)] = kinds[0] if kinds else "passed"
    return outcomes


def test_guide_plugin_root_skipped_checks_as_non_root(
    tinybox: type[Runtime], box_root: Path
) -> None:
    """The checks a root sandbox skips, and the non-root side of `user=`, run as `nobody`."""
    if os.geteuid() != 0:
        pytest.fail("needs root to drop to another user (run `make test` as root, as CI does)")
    outcomes = conformance_as_nobody(
        {"type": "tinybox", "root": str(box_root)},
        [*sorted(ROOT_SKIPS), "user", "read_missing"],
    )
    assert outcomes == {name: ("pass", "") for name in [*ROOT_SKIPS, "user", "read_missing"]}


def test_guide_plugin_is_listed_and_swept(tinybox: type[Runtime], box_root: Path) -> None:
    """`ls` sees an open sandbox under the id errors name; `cleanup` removes a leaked one."""
    config = {"type": "tinybox", "root": str(box_root)}
    token = "300.1618033"

    async def body() -> None:
        async with open_runtime(config) as rt:
            await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 &"])
            [info] = await tinybox.list_sandboxes(rt.config)
            assert info.id == rt.sandbox_id and info.id in rt.describe()
            assert info.backend == "tinybox"
            assert info.labels[ownership.CREATOR] == ownership.CREATOR_ID
            assert info.created == info.labels[ownership.CREATED]
            # this session's sandbox is kept by a plain cleanup, removed by --all
            kept = await cleanup_sandboxes([config])
            assert [(r.info.id, r.action) for r in kept] == [(info.id, "kept")]
            removed = await cleanup_sandboxes([config], all_sessions=True)
            assert [(r.info.id, r.action) for r in removed] == [(info.id, "removed")]
            assert await tinybox.list_sandboxes(rt.config) == []
            assert not await rt.alive()
            await tinybox.destroy_sandbox(info, rt.config)  # gone already is fine

    try:
        anyio.run(body)
    finally:
        # tinybox has no process boundary: destroy_sandbox removes only the directory (the
        # guide says so), so the background process is this test's to end.
        subprocess.run(["pkill", "-f", f"sleep {token}"], check=False)
    assert list(box_root.iterdir()) == []


def test_guide_plugin_close_ends_background_processes(
    tinybox: type[Runtime], box_root: Path
) -> None:
    token = "417.2718281"

    async def body() -> None:
        async with open_runtime({"type": "tinybox", "root": str(box_root)}) as rt:
            await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 &"])
            assert _running(token)

    anyio.run(body)
    assert _gone_soon(token)


def test_guide_plugin_refuses_what_it_cannot_do(tinybox: type[Runtime]) -> None:
    """A field it cannot honour is a config error naming it; an id it could not have made is
    refused by destroy_sandbox."""
    with pytest.raises(RuntimeConfigError, match="workdir"):
        open_runtime({"type": "tinybox", "workdir": "/srv"})
    with pytest.raises(SandboxError, match="not a tinybox sandbox"):
        anyio.run(tinybox.destroy_sandbox, SandboxInfo("tinybox", "../etc", {}))


def _running(token: str) -> bool:
    """Whether a process with ``token`` in its command line runs."""
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return any(token in line for line in out.splitlines())


def _gone_soon(token: str) -> bool:
    """Whether the processes with ``token`` are gone within a few seconds (a killed process
    may take a moment to be reaped)."""
    for _ in range(50):
        if not _running(token):
            return True
        time.sleep(0.05)
    return False


def _check_names() -> set[str]:
    return {c.name for c in CHECKS}


def test_guide_typed_error_examples_are_true() -> None:
    """The guide's typed-errors block: what each constructor call prints, and that the builtin
    argument order is a TypeError."""
    text = GUIDE.read_text()
    examples = {
        SandboxFileNotFoundError("/w/x"): '("/w/x")',
        SandboxNotADirectoryError(
            "/w/a/b", "a parent is a file"
        ): '("/w/a/b", "a parent is a file")',
    }
    for error, call in examples.items():
        assert f"{call}\n# {error}\n" in text, (call, str(error))
    assert (
        'SandboxFileNotFoundError(2, "No such file or directory", "/w/x")   # WRONG: TypeError'
        in text
    )
    with pytest.raises(TypeError):
        SandboxFileNotFoundError(2, "No such file or directory", "/w/x")  # type: ignore[arg-type, call-arg]


def test_guide_plugin_keeps_a_sandbox_on_request(tinybox: type[Runtime], box_root: Path) -> None:
    """`keep=True`: close() leaves the sandbox and its files, labelled as kept; destroy_sandbox
    (what `cleanup --kept` calls) removes it."""
    config = {"type": "tinybox", "root": str(box_root), "keep": True}

    async def body() -> None:
        rt = open_runtime(config)
        async with rt:
            await rt.write("notes.txt", b"look at me")
            box_id = rt.sandbox_id
        [info] = await tinybox.list_sandboxes(rt.config)
        assert info.id == box_id and ownership.is_kept(info.labels)
        assert (box_root / info.id / "work" / "notes.txt").read_bytes() == b"look at me"
        await tinybox.destroy_sandbox(info, rt.config)
        assert await tinybox.list_sandboxes(rt.config) == []

    anyio.run(body)


_HOLDER = """
import os, signal, sys, anyio
from runtimes import open_runtime

async def main():
    rt = open_runtime({"type": "tinybox", "root": sys.argv[1]})
    await rt.start()
    print(rt.sandbox_id, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: the sandbox leaks

anyio.run(main)
"""


def test_guide_plugin_leak_of_a_killed_session_is_swept(
    tinybox: type[Runtime], guide_project: Path, box_root: Path, tmp_path: Path
) -> None:
    """A process SIGKILLed with a sandbox open: a plain `cleanup` (no --all) finds its session
    dead by the guide's labels and removes the sandbox."""
    holder = subprocess.run(
        [sys.executable, "-c", _HOLDER, str(box_root)],
        capture_output=True,
        text=True,
        env=_subprocess_env(guide_project, tmp_path),
        timeout=120,
    )
    leaked = holder.stdout.strip()
    assert leaked.startswith("box-") and (box_root / leaked).is_dir(), holder

    config = {"type": "tinybox", "root": str(box_root)}
    results = anyio.run(lambda: cleanup_sandboxes([config]))
    assert [(r.info.id, r.action, r.reason) for r in results] == [
        (leaked, "removed", "session is dead")
    ]
    assert not (box_root / leaked).exists()
