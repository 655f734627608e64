"""The README's Python example, run as it stands.

The code block is read from README.md at test time, so the README and this test cannot
drift: it runs as a script (``python example.py``, its own ``CONFIG``: the subprocess
runtime) and, imported, with the Docker config its ``CONFIG`` comment offers, each from a
fresh current directory holding the ``local_dir`` it uploads.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import ownership
from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, require_docker_image
from runtimes.reaper import drain_removals_blocking

README = Path(__file__).resolve().parent.parent / "README.md"


def _example() -> str:
    """The README's first ``python`` code block."""
    match = re.search(r"^```python\n(.*?)^```$", README.read_text(), re.S | re.M)
    assert match, "README.md has no python code block"
    return match.group(1)


def _docker_config(code: str) -> dict[str, Any]:
    """The Docker config offered by the comment on the example's ``CONFIG`` line."""
    match = re.search(r"^CONFIG = .*# or (\{.*\})$", code, re.M)
    assert match, "the example's CONFIG line offers no Docker config in its comment"
    config = ast.literal_eval(match.group(1))
    assert isinstance(config, dict) and config["type"] == "docker"
    return config


def _workspace(tmp_path: Path) -> Path:
    cwd = tmp_path / "cwd"
    (cwd / "local_dir").mkdir(parents=True)
    (cwd / "local_dir" / "hello.txt").write_bytes(b"hi")
    return cwd


def _check_outcome(cwd: Path, stdout: str) -> None:
    """What the example does, as its user sees it: the uploaded file listed, the env
    variable on stderr, the downloaded tree, the typed error printed; and nothing of the
    sandbox's paths created on the host outside ``local_out``."""
    lines = stdout.splitlines()
    assert lines[:2] == ["0 hello.txt", " v"], stdout
    assert lines[-1].startswith("typed error: [Errno 2] No such file or directory"), stdout
    assert "missing.txt" in lines[-1]
    assert sorted(os.listdir(cwd)) == ["local_dir", "local_out"]
    assert sorted(os.listdir(cwd / "local_out")) == ["result.json"]
    assert (cwd / "local_out" / "result.json").read_bytes() == b"{}"


def test_example_uses_only_relative_sandbox_paths() -> None:
    """Absolute paths are backend-specific (``/work`` is Docker's workdir): on the subprocess
    runtime they would land on the host."""
    absolute = [
        node.value
        for node in ast.walk(ast.parse(_example()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        if node.value.startswith("/")
    ]
    assert absolute == []


def test_example_runs_as_a_script_on_the_subprocess_runtime(tmp_path: Path) -> None:
    code = _example()
    assert re.search(r'^CONFIG = \{"type": "subprocess"\}', code, re.M), "CONFIG changed"
    script = tmp_path / "example.py"
    script.write_text(code)
    cwd = _workspace(tmp_path)
    scratch = tmp_path / "tmp"  # the runtime's default root lives under $TMPDIR
    scratch.mkdir()
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=cwd,
        env={**os.environ, "TMPDIR": str(scratch)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    _check_outcome(cwd, result.stdout)
    assert os.listdir(scratch / "vf-sandbox") == []  # the sandbox's directory is gone


@pytest.mark.docker
def test_example_runs_on_docker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import docker

    code = _example()
    config = _docker_config(code)
    require_docker_image(config.get("image", DOCKER_TEST_IMAGE))
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code, f"{README}:example", "exec"), namespace)
    monkeypatch.chdir(_workspace(tmp_path))

    client = docker.from_env()
    label = {"label": f"{ownership.CREATOR}={ownership.CREATOR_ID}"}
    try:
        before = {c.id for c in client.containers.list(all=True, filters=label)}
        anyio.run(namespace["main"], config)
        drain_removals_blocking()  # close() returned once the container was frozen
        left = [c for c in client.containers.list(all=True, filters=label) if c.id not in before]
        for container in left:
            container.remove(force=True)
    finally:
        client.close()
    assert left == [], "the example left its container behind"
    _check_outcome(Path.cwd(), capsys.readouterr().out)


def _streaming_example() -> str:
    """The README's code block under "Streaming, shell sessions, blocking code"."""
    text = README.read_text()
    section = text[text.index("### Streaming, shell sessions, blocking code") :]
    match = re.search(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert match, "the streaming section has no python code block"
    return match.group(1)


def test_streaming_example_runs_as_a_script(tmp_path: Path) -> None:
    """Streaming, a shell session that survives an interrupt, and the blocking facade, as the
    README shows them: the chunks arrive before the command ends, state persists, the timed-out
    `sleep` is interrupted and the same shell answers after it."""
    script = tmp_path / "streaming.py"
    script.write_text(_streaming_example())
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "stdout b'building\\n'", result.stdout  # its own chunk: streamed
    assert lines[1] == "stdout b'built\\n'", result.stdout
    assert lines[2:] == ["/tmp 42", "still 42", "hi"], result.stdout
