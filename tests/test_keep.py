"""``keep=True`` / ``exec --keep``: a sandbox left running for debugging, spared by every sweep
but ``cleanup --kept``, and ``vf-sandbox shell ID`` to get into it.

Subprocess sandboxes live under a per-test root; Docker containers are real, and every kept
one a test makes is removed by its finalizer even when the test fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import RuntimeConfigError, SandboxUnavailableError, open_runtime, ownership
from runtimes.cleanup import cleanup_sandboxes
from runtimes.docker import DockerRuntime
from runtimes.keep import runtime_argument
from runtimes.locate import find_sandbox
from runtimes.models import SandboxInfo
from runtimes.reaper import drain_removals
from runtimes.ssh import SSHRuntime
from runtimes.subprocess import SubprocessRuntime
from tests.modal.fake_modal import FakeModalService
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures
from tests.ssh.sshd import SSHServer, image_present

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "placement.cli"]
BACKGROUND = ["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *args],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )


def kept_notice(stderr: str) -> list[str]:
    """The ``vf-sandbox shell ...`` command of the kept-sandbox notice on stderr."""
    line = next(line for line in stderr.splitlines() if line.startswith("vf-sandbox: kept "))
    return shlex.split(line.split("get in with `", 1)[1].split("`", 1)[0])


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


# ---------------------------------------------------------------------- subprocess


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A private subprocess root; whatever is left in it (kept sandboxes, their processes)
    is destroyed at the end."""
    root = tmp_path / "root"
    yield root

    async def destroy_all() -> None:
        config = SubprocessRuntime.config_model(root=str(root))
        for info in await SubprocessRuntime.list_sandboxes(config):
            await SubprocessRuntime.destroy_sandbox(info, config)

    anyio.run(destroy_all)


@pytest.mark.anyio
async def test_subprocess_keep_leaves_workdir_and_processes_until_cleanup_kept(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"type": "subprocess", "root": str(root), "keep": True}
    with caplog.at_level(logging.WARNING, logger="runtimes.keep"):
        async with open_runtime(config) as rt:
            await rt.write("f", "kept data")
            sleeper = int((await rt.exec(BACKGROUND)).stdout)
            workdir, sandbox_id = Path(rt.workdir), rt.sandbox_id
    assert rt.closed
    assert (workdir / "f").read_text() == "kept data"
    assert pid_alive(sleeper)
    notice = " ".join(r.getMessage() for r in caplog.records if r.name == "runtimes.keep")
    assert sandbox_id is not None and f"vf-sandbox shell {sandbox_id}" in notice

    swept = {r.info.id: r for r in await cleanup_sandboxes([config])}
    assert swept[sandbox_id].action == "kept" and workdir.is_dir()
    removed = {r.info.id: r for r in await cleanup_sandboxes([config], kept=True)}
    assert removed[sandbox_id].action == "removed"
    assert not workdir.exists()
    assert not pid_alive(sleeper)  # the removal's sweep waits for its kills


@pytest.mark.anyio
async def test_subprocess_without_keep_still_vanishes(root: Path) -> None:
    async with open_runtime({"type": "subprocess", "root": str(root)}) as rt:
        sleeper = int((await rt.exec(BACKGROUND)).stdout)
        workdir = Path(rt.workdir)
    assert not workdir.exists()
    assert not pid_alive(sleeper)
    assert await SubprocessRuntime.list_sandboxes(rt.config) == []


def test_keep_survives_the_exit_backstop(root: Path) -> None:
    # A process that exits without closing: the atexit backstop spares a kept sandbox.
    child = textwrap.dedent(
        f"""
        import anyio
        from runtimes import open_runtime

        async def main():
            rt = open_runtime({{"type": "subprocess", "root": {str(root)!r}, "keep": True}})
            await rt.start()
            await rt.write("f", "left at exit")
            print(rt.sandbox_id, flush=True)

        anyio.run(main)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    sandbox_id = done.stdout.strip()
    assert (root / sandbox_id / "work" / "f").read_text() == "left at exit"
    assert f"kept subprocess sandbox {sandbox_id}" in done.stderr


def test_cli_exec_keep_then_shell_then_cleanup_kept(root: Path) -> None:
    runtime = json.dumps({"type": "subprocess", "root": str(root)})
    ran = cli("exec", "--keep", "--runtime", runtime, "--", "sh", "-c", "echo from-exec > f")
    assert ran.returncode == 0, ran.stderr
    command = kept_notice(ran.stderr)
    assert command[:2] == ["vf-sandbox", "shell"]
    sandbox_id = command[2]
    assert (root / sandbox_id / "work" / "f").exists()

    # The notice's own command line gets in (stdin piped: the shell reads it as commands).
    inside = cli(*command[1:], stdin="cat f\npwd\nexit 7\n")
    assert inside.returncode == 7, inside.stderr
    assert inside.stdout.splitlines() == ["from-exec", str(root / sandbox_id / "work")]

    listed = json.loads(cli("ls", "--json", "--runtime", runtime).stdout)
    (row,) = [s for s in listed["sandboxes"] if s["id"] == sandbox_id]
    assert row["kept"] is True and row["session"] == "dead"

    spared = cli("cleanup", "--runtime", runtime)
    assert spared.returncode == 0 and (root / sandbox_id).is_dir()
    removed = cli("cleanup", "--kept", "--runtime", runtime)
    assert removed.returncode == 0, removed.stderr
    assert not (root / sandbox_id).exists()


def test_cli_exec_without_keep_leaves_nothing(root: Path) -> None:
    runtime = json.dumps({"type": "subprocess", "root": str(root)})
    ran = cli("exec", "--runtime", runtime, "--", "true")
    assert ran.returncode == 0 and "kept" not in ran.stderr
    assert not root.exists() or not list(root.iterdir())


def test_shell_unknown_id_is_one_line_and_exit_1(root: Path) -> None:
    runtime = json.dumps({"type": "subprocess", "root": str(root)})
    result = cli("shell", "sbx-nosuch", "--runtime", runtime, stdin="echo never\n")
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "SandboxUnavailableError" in result.stderr and "sbx-nosuch" in result.stderr


@pytest.mark.anyio
async def test_shell_of_a_removed_workdir_is_unavailable(root: Path) -> None:
    config = SubprocessRuntime.config_model(root=str(root), keep=True)
    async with SubprocessRuntime(config) as rt:
        sandbox_id = rt.sandbox_id
    (root / str(sandbox_id) / "work").rmdir()
    _, _, info = await find_sandbox(str(sandbox_id), [config])
    with pytest.raises(SandboxUnavailableError, match="workdir"):
        await SubprocessRuntime.shell_argv(info, config, tty=False)


def test_runtime_argument_names_what_locates_and_never_secrets() -> None:
    from runtimes.ssh import SSHConfig

    assert runtime_argument(DockerRuntime.config_model(keep=True, env={"A": "1"})) == "docker"
    ssh = SSHConfig(host="h", username="u", password="hunter2", keep=True)
    assert json.loads(runtime_argument(ssh)) == {"type": "ssh", "host": "h", "username": "u"}


# ---------------------------------------------------------------------- docker


@pytest.fixture
def kept_containers() -> Iterator[list[str]]:
    """Ids of containers a test kept: force-removed at the end, whatever happened."""
    import docker

    from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, require_docker_image

    require_docker_image(DOCKER_TEST_IMAGE)
    ids: list[str] = []
    yield ids
    client = docker.from_env()
    try:
        for container_id in ids:
            with contextlib.suppress(docker.errors.NotFound):
                client.api.remove_container(container_id, force=True, v=True)
    finally:
        client.close()


def container_state(container_id: str) -> dict[str, Any] | None:
    import docker

    client = docker.from_env()
    try:
        return dict(client.api.inspect_container(container_id)["State"])
    except docker.errors.NotFound:
        return None
    finally:
        client.close()


@pytest.mark.docker
@pytest.mark.anyio
async def test_docker_keep_leaves_the_container_running_until_cleanup_kept(
    kept_containers: list[str],
) -> None:
    async with open_runtime({"type": "docker", "keep": True}) as rt:
        assert rt.sandbox_id is not None
        kept_containers.append(rt.sandbox_id)
        await rt.write("f", "written before close\n")
        sleeper = int((await rt.exec(BACKGROUND)).stdout)
    container_id = rt.sandbox_id
    state = container_state(container_id)
    assert state is not None and state["Running"]
    look = await anyio.run_process(
        ["docker", "exec", container_id, "sh", "-c", f"cat /work/f; kill -0 {sleeper} && echo up"]
    )
    assert look.stdout.decode().splitlines() == ["written before close", "up"]

    swept = {r.info.id: r for r in await cleanup_sandboxes(["docker"], dry_run=True)}
    assert swept[container_id].action == "kept"
    assert swept[container_id].reason == "kept (keep=True)"
    removed = {r.info.id: r for r in await cleanup_sandboxes(["docker"], kept=True)}
    assert removed[container_id].action == "removed"
    assert container_state(container_id) is None


@pytest.mark.docker
@pytest.mark.anyio
async def test_docker_without_keep_still_vanishes() -> None:
    async with open_runtime({"type": "docker"}) as rt:
        container_id = rt.sandbox_id
    await drain_removals()
    assert container_id is not None and container_state(container_id) is None


@pytest.mark.docker
def test_docker_cli_exec_keep_shell_and_dead_session(kept_containers: list[str]) -> None:
    ran = cli("exec", "--keep", "--runtime", "docker", "--", "sh", "-c", "echo in-docker > f")
    assert ran.returncode == 0, ran.stderr
    command = kept_notice(ran.stderr)
    container_id = command[2]
    kept_containers.append(container_id)

    # `vf-sandbox shell ID` with no --runtime finds it; a prefix of the id is enough.
    inside = cli("shell", container_id[:12], stdin="cat f\npwd\nexit\n")
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.splitlines() == ["in-docker", "/work"]

    # Its session (the exec process) is dead, yet the default sweep spares it.
    async def sweep() -> dict[str, Any]:
        return {r.info.id: r for r in await cleanup_sandboxes(["docker"], dry_run=True)}

    swept = anyio.run(sweep)
    assert ownership.creator_is_dead(swept[container_id].info.labels) is True
    assert swept[container_id].action == "kept"
    listed = json.loads(cli("ls", "--json", "--runtime", "docker").stdout)
    assert [s["kept"] for s in listed["sandboxes"] if s["id"] == container_id] == [True]


@pytest.mark.docker
@pytest.mark.anyio
async def test_docker_shell_of_a_stopped_container_says_so(kept_containers: list[str]) -> None:
    async with open_runtime({"type": "docker", "keep": True}) as rt:
        assert rt.sandbox_id is not None
        kept_containers.append(rt.sandbox_id)
    await anyio.run_process(["docker", "stop", "-t", "0", rt.sandbox_id])
    info = SandboxInfo(backend="docker", id=rt.sandbox_id, labels={})
    with pytest.raises(SandboxUnavailableError, match="docker start"):
        await DockerRuntime.shell_argv(info, tty=False)


@pytest.mark.docker
def test_docker_shell_argv_asks_for_a_terminal_only_on_a_tty(kept_containers: list[str]) -> None:
    async def argvs() -> tuple[list[str], list[str]]:
        async with open_runtime({"type": "docker", "keep": True, "workdir": "/srv/w"}) as rt:
            assert rt.sandbox_id is not None
            kept_containers.append(rt.sandbox_id)
        info = SandboxInfo(backend="docker", id=rt.sandbox_id, labels={})
        return (
            await DockerRuntime.shell_argv(info, tty=True),
            await DockerRuntime.shell_argv(info, tty=False),
        )

    on_tty, piped = anyio.run(argvs)
    # The default image has bash: the shell is bash (/bin/sh without it: tests/security).
    assert on_tty[1:] == ["exec", "-i", "-t", "-w", "/srv/w", kept_containers[0], "/bin/bash"]
    assert piped[1:] == ["exec", "-i", "-w", "/srv/w", kept_containers[0], "/bin/bash"]


def test_shell_without_the_docker_cli_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    info = SandboxInfo(backend="docker", id="0" * 64, labels={})
    from runtimes.errors import SandboxFileNotFoundError

    with pytest.raises(SandboxFileNotFoundError) as caught:
        anyio.run(lambda: DockerRuntime.shell_argv(info, tty=False))
    assert caught.value.filename == "docker" and "docker.io" in str(caught.value)


# ---------------------------------------------------------------------- ssh


@pytest.mark.ssh
@pytest.mark.docker
@pytest.mark.anyio
async def test_ssh_keep_and_shell(tmp_path: Path) -> None:
    if not image_present():
        pytest.fail("the sshd test image is missing: build it with `make images`")
    with SSHServer(tmp_path / "sshd") as server:
        config = server.config(keep=True)
        async with SSHRuntime(config) as rt:
            await rt.write("f", "over ssh\n")
            sandbox_id = rt.sandbox_id
        assert sandbox_id is not None
        try:
            swept = {r.info.id: r for r in await cleanup_sandboxes([config], dry_run=True)}
            assert swept[sandbox_id].action == "kept"
            _, _, info = await find_sandbox(sandbox_id, [config])
            argv = await SSHRuntime.shell_argv(info, config, tty=False)
            inside = await anyio.run_process(argv, input=b"cat f\npwd\n")
            lines = inside.stdout.decode().splitlines()
            assert lines == ["over ssh", f"{sandbox_id}/work"]
        finally:
            removed = {r.info.id: r for r in await cleanup_sandboxes([config], kept=True)}
        assert removed[sandbox_id].action == "removed"
        assert await SSHRuntime.list_sandboxes(config) == []


def test_modal_shell_is_refused_with_modals_own_command() -> None:
    from runtimes.errors import SandboxInvalidArgumentError
    from runtimes.modal import ModalRuntime

    info = SandboxInfo(backend="modal", id="sb-abc123", labels={})
    with pytest.raises(SandboxInvalidArgumentError, match="modal shell sb-abc123"):
        anyio.run(lambda: ModalRuntime.shell_argv(info, tty=False))


def test_keep_is_not_the_default() -> None:
    assert SubprocessRuntime.config_model().keep is False
    assert ownership.KEEP not in ownership.ownership_labels("x")
    assert ownership.is_kept(ownership.ownership_labels("x", keep=True))


# ---------------------------------------------------------------------- modal (the fake)


def test_modal_keep_leaves_the_sandbox_running_until_cleanup_kept(
    fake_service: FakeModalService,  # noqa: F811 - the fixture imported above
    fake_modal: types.ModuleType,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def open_and_close() -> str:
        async with open_runtime(fake_config(keep=True)) as rt:
            await rt.write("f", "on modal\n")
            assert rt.sandbox_id is not None
            return rt.sandbox_id

    with caplog.at_level(logging.WARNING, logger="runtimes.keep"):
        sandbox_id = anyio.run(open_and_close)
    assert fake_service.load(sandbox_id).status is None  # still running
    assert f"get in with `modal shell {sandbox_id}`" in caplog.text

    async def sweep(**how: bool) -> dict[str, Any]:
        return {r.info.id: r for r in await cleanup_sandboxes([fake_config()], **how)}

    assert anyio.run(lambda: sweep(dry_run=True))[sandbox_id].action == "kept"
    assert anyio.run(lambda: sweep(kept=True))[sandbox_id].action == "removed"
    assert fake_service.load(sandbox_id).status == "terminated"


def test_a_backend_that_cannot_keep_refuses_keep_naming_the_field() -> None:
    # The echo test plugin's close() knows nothing of keep: it must refuse, not pretend.
    with pytest.raises(RuntimeConfigError, match="keep") as caught:
        open_runtime({"type": "echo", "keep": True})
    assert caught.value.errors[0]["loc"] == ("keep",)
