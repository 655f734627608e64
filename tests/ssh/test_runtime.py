"""Behaviour specific to the ssh runtime: the exec wrapper, users, channels, the sandbox
directory's life (close, atexit, sweeps of dead sessions)."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from runtimes import (
    ProvisioningError,
    SandboxInvalidArgumentError,
    SandboxUnavailableError,
    open_runtime,
    ownership,
)
from runtimes.cleanup import cleanup_sandboxes
from runtimes.ssh import SSHConfig, SSHRuntime
from runtimes.ssh.control import directory_mark, setup_script
from runtimes.sweep import MARK_VAR
from tests.ssh.sshd import SSHServer

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]


def _token() -> str:
    return f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"


def _remote_processes(server: SSHServer, token: str) -> list[str]:
    out = server.docker_exec("ps -eo pid,args")
    return [line for line in out.splitlines() if token in line]


def _remote_exists(server: SSHServer, path: str) -> bool:
    return server.docker_exec(f"test -e '{path}' && echo yes || echo no").strip() == "yes"


# ---------------------------------------------------------------------- exec wrapper


async def test_killed_wrapper_reports_signal_exit_code(sshd: SSHServer) -> None:
    """sshd sends exit-signal (no exit-status) when the wrapper itself dies: 128 + N, not -1.

    The plain exec path (through the channel, $PPID is the channel agent: see
    tests/channel/test_agent_faults.py)."""
    async with open_runtime(sshd.config(channel=False)) as rt:
        # "after" is written right after the kill: exec takes what comes within EXIT_GRACE
        # of the exit, and a sleep here as long as the grace failed on a busy machine.
        result = await rt.exec(["sh", "-c", "kill -KILL $PPID; echo after"], timeout=30)
        assert result.exit_code == 128 + 9, result
        assert result.stdout == "after\n", result


async def test_program_exiting_127_is_a_result_not_a_missing_program(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config()) as rt:
        assert (await rt.exec(["sh", "-c", "exit 127"])).exit_code == 127
        assert (await rt.exec(["sh", "-c", "exit 126"])).exit_code == 126


async def test_user_switch_as_root_keeps_env_and_cwd(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config()) as rt:
        result = await rt.exec(
            ["sh", "-c", 'printf "%s %s %s" "$(id -un)" "$VF_X" "$(pwd)"'],
            user="sandbox",
            env={"VF_X": "kept"},
            cwd="/tmp",
        )
        assert result.stdout == "sandbox kept /tmp", result
        with pytest.raises(SandboxInvalidArgumentError, match="no-such-user"):
            await rt.exec(["id"], user="no-such-user")


async def test_env_names_that_are_not_shell_identifiers(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config()) as rt:
        result = await rt.exec(["env"], env={"weird.name": "a b", "_OK1": "$HOME"})
        lines = result.stdout.splitlines()
        assert "weird.name=a b" in lines and "_OK1=$HOME" in lines, result


async def test_env_cannot_derail_the_wrapper(sshd: SSHServer) -> None:
    """Caller env names that a naive wrapper would use itself (n, d, IFS, PATH...)."""
    env = {"n": "N", "d": "D", "p": "P", "IFS": "z", "__vf_n": "X", "h": "H"}
    async with open_runtime(sshd.config()) as rt:
        result = await rt.exec(["env"], env=env)
        lines = result.stdout.splitlines()
        assert all(f"{k}={v}" in lines for k, v in env.items()), result
        await rt.write("/opt/vf-bin/hello", b"#!/bin/sh\necho hello from my PATH\n")
        await rt.exec(["chmod", "755", "/opt/vf-bin/hello"])
        mine = await rt.exec(["hello"], env={"PATH": "/opt/vf-bin:/usr/bin:/bin"})
        assert mine.stdout == "hello from my PATH\n", mine
        with pytest.raises(FileNotFoundError):
            await rt.exec(["hello"])  # not on the default PATH
        # setsid is found by absolute path, whatever the caller's PATH says
        bare = await rt.exec(["/opt/vf-bin/hello"], env={"PATH": "/nowhere"})
        assert bare.stdout == "hello from my PATH\n", bare
        await rt.remove("/opt/vf-bin")


async def test_large_env_goes_through_an_uploaded_script(sshd: SSHServer) -> None:
    """A wrapper too big for the exec request is uploaded, run, and removed."""
    async with open_runtime(sshd.config()) as rt:
        value = "v" * 120_000
        result = await rt.exec(["sh", "-c", 'printf %s "$BIG" | wc -c'], env={"BIG": value})
        assert result.stdout.strip() == "120000", result
        assert rt.sandbox_id is not None
        leftovers = sshd.docker_exec(f"ls -A '{rt.sandbox_id}/x'").split()
        assert leftovers == [], leftovers


async def test_argv_over_the_kernel_limit_is_refused(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config()) as rt:
        with pytest.raises(SandboxInvalidArgumentError, match="stdin or a file"):
            await rt.exec(["true", *(["x" * 100_000] * 25)])
        with pytest.raises(SandboxInvalidArgumentError, match="128 KiB"):
            await rt.exec(["true", "y" * 200_000])


async def test_more_concurrent_execs_than_channels(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config(max_channels=4)) as rt:
        outputs: dict[int, str] = {}

        async def one(i: int) -> None:
            outputs[i] = (await rt.exec(["sh", "-c", f"sleep 0.05; echo {i}"], timeout=60)).stdout

        async with anyio.create_task_group() as tg:
            for i in range(25):
                tg.start_soon(one, i)
        assert outputs == {i: f"{i}\n" for i in range(25)}


async def test_login_shell_noise_on_stderr_is_not_command_output(sshd: SSHServer) -> None:
    """bash sources ~/.bashrc for sshd commands; what it prints before the wrapper is dropped."""
    bashrc = "/home/sandbox/.bashrc"
    sshd.docker_exec(f"cp {bashrc} {bashrc}.orig && echo 'echo rc-noise >&2' >> {bashrc}")
    try:
        async with open_runtime(sshd.password_config()) as rt:
            result = await rt.exec(["sh", "-c", "echo out; echo err >&2"])
            assert result.stdout_bytes == b"out\n" and result.stderr_bytes == b"err\n", result
    finally:
        sshd.docker_exec(f"mv {bashrc}.orig {bashrc}")


# ---------------------------------------------------------------------- the sandbox directory


async def test_close_kills_leftovers_and_removes_the_directory(sshd: SSHServer) -> None:
    token = _token()
    async with open_runtime(sshd.config()) as rt:
        await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 &"])
        await rt.exec(["sh", "-c", f"setsid sh -c 'sleep {token}' >/dev/null 2>&1 &"])
        directory = rt.sandbox_id
        assert directory is not None and _remote_exists(sshd, directory)
        assert len(_remote_processes(sshd, token)) >= 2
    assert not _remote_exists(sshd, directory)
    assert _remote_processes(sshd, token) == []


async def test_given_workdir_is_created_and_kept(sshd: SSHServer) -> None:
    wanted = f"/srv/vf-test-{_token()}/work dir"
    async with open_runtime(sshd.config(workdir=wanted)) as rt:
        assert rt.workdir == wanted
        await rt.write("kept.txt", b"kept")
        assert (await rt.exec(["pwd"])).stdout == wanted + "\n"
    assert _remote_exists(sshd, f"{wanted}/kept.txt")
    sshd.docker_exec(f"rm -rf '{Path(wanted).parent}'")


async def test_describe_and_id(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config()) as rt:
        assert rt.sandbox_id is not None and rt.sandbox_id.startswith("/tmp/vf-sandbox.")
        assert f"root@{sshd.host}:{sshd.port}" in rt.describe()
        assert rt.workdir == f"{rt.sandbox_id}/work"
    with pytest.raises(SandboxUnavailableError):
        await rt.exec(["true"])


_CHILD = textwrap.dedent(
    """
    import os, sys, anyio
    from runtimes.ssh import SSHConfig, SSHRuntime

    config = SSHConfig.model_validate_json(sys.argv[1])
    mode, token = sys.argv[2], sys.argv[3]

    async def main():
        rt = SSHRuntime(config)
        await rt.start()
        await rt.exec(["sh", "-c", f"nohup sleep {token} >/dev/null 2>&1 &"])
        print(rt.sandbox_id, flush=True)
        if mode == "crash":
            os._exit(1)  # no close, no atexit: a killed process

    anyio.run(main)  # mode "exit": ends without close(); the atexit backstop cleans up
    """
)


def _run_child(config: SSHConfig, mode: str, token: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, config.model_dump_json(), mode, token],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    directory = done.stdout.strip()
    assert directory.startswith("/tmp/vf-sandbox."), done
    return directory


async def test_atexit_backstop_cleans_up(sshd: SSHServer) -> None:
    token = _token()
    directory = await anyio.to_thread.run_sync(_run_child, sshd.config(), "exit", token)
    assert not _remote_exists(sshd, directory)
    assert _remote_processes(sshd, token) == []


async def test_sweep_removes_dead_sessions_only(sshd: SSHServer) -> None:
    token = _token()
    config = sshd.config()
    dead = await anyio.to_thread.run_sync(_run_child, config, "crash", token)
    assert _remote_exists(sshd, dead) and _remote_processes(sshd, token)

    async with open_runtime(config) as live:
        listed = {info.id: info for info in await SSHRuntime.list_sandboxes(config)}
        assert dead in listed and live.sandbox_id in listed
        assert listed[live.sandbox_id].labels[ownership.CREATOR] == ownership.CREATOR_ID
        assert listed[dead].labels[ownership.BACKEND] == "ssh"

        results = {r.info.id: r for r in await cleanup_sandboxes([config])}
        assert results[dead].action == "removed", results[dead]
        assert results[live.sandbox_id].action == "kept"
        assert not _remote_exists(sshd, dead)
        assert _remote_processes(sshd, token) == []
        assert await live.alive()


async def test_destroy_refuses_foreign_paths(sshd: SSHServer) -> None:
    from runtimes.models import SandboxInfo

    for bad in ("/", "/etc", "/tmp/vf-sandbox.x/../..", "relative/vf-sandbox.x"):
        with pytest.raises(SandboxInvalidArgumentError):
            await SSHRuntime.destroy_sandbox(SandboxInfo("ssh", bad, {}), sshd.config())


# ---------------------------------------------------------------------- the mark


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "plain"])
async def test_one_mark_names_the_directory_and_marks_every_command(
    sshd: SSHServer, channel: bool
) -> None:
    """Issue 33: one environment mark. Every command carries ``VF_SANDBOX_RUNTIME`` with the
    runtime's mark, which also names the sandbox directory; the pre-33 ``VF_SANDBOX_ID`` is
    gone."""
    async with open_runtime(sshd.config(channel=channel)) as rt:
        assert isinstance(rt, SSHRuntime)
        mark = rt._mark
        assert rt.sandbox_id == f"/tmp/vf-sandbox.{mark}"
        env = (await rt.exec(["env"])).stdout.splitlines()
        assert f"{MARK_VAR}={mark}" in env
        assert not any(line.startswith("VF_SANDBOX_ID=") for line in env), env
        mode = (await rt.exec(["stat", "-c", "%a", rt.sandbox_id])).stdout.strip()
        assert mode == "700"


@pytest.mark.parametrize("release", ["current", "older"])
async def test_cleanup_sweeps_a_dead_session_by_its_mark(sshd: SSHServer, release: str) -> None:
    """A leftover that left the workdir is found by the mark alone: the one the directory's
    name gives, or, for a sandbox of a release before issue 33 (``vf-sandbox.`` and mktemp's
    ten characters), the ``VF_SANDBOX_ID`` it carried."""
    config = sshd.config()
    dead = await anyio.to_thread.run_sync(_run_child, config, "crash", _token())
    if release == "older":
        name = f"vf-sandbox.Old{random.randint(10**6, 10**7 - 1)}"
        sshd.docker_exec(f"mv '{dead}' '/tmp/{name}'")
        dead, entry = f"/tmp/{name}", f"VF_SANDBOX_ID={name}"
    else:
        entry = f"{MARK_VAR}={dead.removeprefix('/tmp/vf-sandbox.')}"
    token = _token()
    sshd.docker_exec(f"cd / && env '{entry}' nohup sleep {token} >/dev/null 2>&1 &")
    assert _remote_processes(sshd, token)

    results = {r.info.id: r for r in await cleanup_sandboxes([config])}
    assert results[dead].action == "removed", results[dead]
    assert not _remote_exists(sshd, dead)
    assert _remote_processes(sshd, token) == []


def test_directory_mark() -> None:
    mark = "0123456789abcdef0123456789abcdef"
    assert directory_mark(f"/tmp/vf-sandbox.{mark}") == f"{MARK_VAR}={mark}"
    assert directory_mark("/tmp/vf-sandbox.AbCdEfGhIj") == "VF_SANDBOX_ID=vf-sandbox.AbCdEfGhIj"
    assert setup_script(mark, None).args[0] == f"vf-sandbox.{mark}"
    for bad in ("", "../../etc", "x" * 32, mark.upper(), mark + "/"):
        with pytest.raises(SandboxInvalidArgumentError):
            setup_script(bad, None)


async def test_a_squatted_directory_name_is_refused_not_adopted(sshd: SSHServer) -> None:
    """The directory is made by ``mkdir``, which fails on a name already taken: a squatter
    (here a symlink to a directory it owns) never becomes the sandbox, nor is it removed. (The
    mark is random and first leaves the runtime in the set-up command: the test reads it.)"""
    rt = SSHRuntime(sshd.config())
    name, target = f"/tmp/vf-sandbox.{rt._mark}", f"/tmp/vf-squat-{_token()}"
    sshd.docker_exec(f"mkdir '{target}' && ln -s '{target}' '{name}'")
    try:
        with pytest.raises(ProvisioningError, match="File exists"):
            await rt.start()
        assert sshd.docker_exec(f"ls -A '{target}'; readlink '{name}'").split() == [target]
    finally:
        sshd.docker_exec(f"rm -rf '{target}' '{name}'")
