"""An SSH sandbox's sweeps and removal never follow a ``work/`` link the policy planted.

The sweeps of an SSH sandbox (``stop_processes``, close, and ``vf-sandbox cleanup`` of a dead
session) kill, besides what carries the runtime's mark, every process whose working directory
is the sandbox's ``work/``. A policy that may replace ``work/`` (it runs as the login user)
plants ``work -> /srv/...`` (or ``work -> /``): a sweep that followed the link would kill
processes that are not the sandbox's (another sandbox's, a judge's, the host's services,
sshd itself), and the removal must not touch what the link leads to.
"""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from runtimes import open_runtime
from runtimes.cleanup import cleanup_sandboxes
from runtimes.ssh import SSHConfig
from tests.security.conftest import Hostile
from tests.ssh.sshd import SSHServer

# The policy runs as the login user (root here), so it may replace ``work/`` itself.
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.parametrize("hostile", ["ssh-root"], indirect=True),
]

REPO = Path(__file__).parents[2]

_CHILD = textwrap.dedent(
    """
    import os, sys, anyio
    from runtimes.ssh import SSHConfig, SSHRuntime

    config = SSHConfig.model_validate_json(sys.argv[1])

    async def main():
        rt = SSHRuntime(config)
        await rt.start()
        result = await rt.exec(["sh", "-c", sys.argv[2]])
        assert result.exit_code == 0, result
        print(rt.sandbox_id, flush=True)
        os._exit(1)  # no close, no atexit: a killed process; cleanup finds it dead

    anyio.run(main)
    """
)


def _token() -> str:
    return f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"


def _processes(server: SSHServer, token: str) -> list[str]:
    out = server.docker_exec("ps -eo pid,args")
    return [line for line in out.splitlines() if token in line]


def _innocent(server: SSHServer, token: str) -> str:
    """A directory outside any sandbox, a locked file in it, and a process working there
    that is no sandbox's (no mark in its environment)."""
    place = f"/srv/innocent.{token}"
    server.docker_exec(
        f"mkdir -p {place} && echo host > {place}/secret && chmod 000 {place}/secret && "
        f"cd {place} && env -i nohup sleep {token} >/dev/null 2>&1 &"
    )
    assert _processes(server, token)
    return place


def _assert_untouched(server: SSHServer, place: str, token: str) -> None:
    assert _processes(server, token), "a process outside the sandbox was killed"
    mode = server.docker_exec(f"stat -c %a {place}/secret").strip()
    assert mode == "0", f"the removal changed a file outside the sandbox (mode {mode})"
    assert server.docker_exec(f"cat {place}/secret").strip() == "host"
    pids = " ".join(line.split()[0] for line in _processes(server, token))
    server.docker_exec(f"kill {pids}; rm -rf {place}")


def _plant(place: str, leftover: str) -> str:
    """The policy's command: a leftover of its own, then ``work/`` replaced by a link."""
    return (
        f"nohup sleep {leftover} >/dev/null 2>&1 & "
        f'w=$(pwd -P) && cd .. && rm -rf "$w" && ln -s {place} "$w"'
    )


def _dead_session(config: SSHConfig, command: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, config.model_dump_json(), command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    directory = done.stdout.strip()
    assert directory.startswith("/tmp/vf-sandbox."), done
    return directory


@pytest.mark.attack(6)
async def test_cleanup_of_a_dead_session_does_not_follow_a_planted_work_link(
    sshd: SSHServer, hostile: Hostile
) -> None:
    token, leftover = _token(), _token()
    place = _innocent(sshd, token)
    config = hostile.config
    dead = await anyio.to_thread.run_sync(_dead_session, config, _plant(place, leftover))
    # Control: the link is there and leads to the innocent process's directory.
    assert sshd.docker_exec(f"readlink {dead}/work").strip() == place
    assert _processes(sshd, leftover)

    results = {r.info.id: r for r in await cleanup_sandboxes([config])}
    assert results[dead].action == "removed", results[dead]
    assert sshd.docker_exec(f"test -e {dead} && echo yes || echo no").strip() == "no"
    assert _processes(sshd, leftover) == []  # the sandbox's own leftover: by its mark
    _assert_untouched(sshd, place, token)


@pytest.mark.attack(6)
async def test_stop_processes_and_close_do_not_follow_a_planted_work_link(
    sshd: SSHServer, hostile: Hostile
) -> None:
    token, leftover = _token(), _token()
    place = _innocent(sshd, token)
    async with open_runtime(hostile.config) as rt:
        assert (await rt.exec(["sh", "-c", _plant(place, leftover)])).exit_code == 0
        assert sshd.docker_exec(f"readlink {rt.workdir}").strip() == place
        await rt.stop_processes()
        assert _processes(sshd, leftover) == []
        assert _processes(sshd, token), "stop_processes killed a process outside the sandbox"
    _assert_untouched(sshd, place, token)


@pytest.mark.attack(6)
async def test_the_sandbox_s_own_workdir_still_counts(sshd: SSHServer, hostile: Hostile) -> None:
    """Control: a leftover that scrubbed its environment but works in the real ``work/`` is
    still the sandbox's."""
    token = _token()
    async with open_runtime(hostile.config) as rt:
        command = f"env -i nohup sleep {token} >/dev/null 2>&1 &"
        assert (await rt.exec(["sh", "-c", command])).exit_code == 0
        assert _processes(sshd, token)
        assert await rt.stop_processes() >= 1
        assert _processes(sshd, token) == []


@pytest.mark.attack(8)
async def test_close_does_not_follow_a_link_planted_at_the_sandbox_directory(
    sshd: SSHServer, hostile: Hostile
) -> None:
    """The policy moves its sandbox directory away and plants a link at its name, to a tree
    with a ``work/`` where a process that is not the sandbox's works: the sweep leaves that
    process alone, and the removal takes the link, not the tree's permissions or files."""
    token, leftover, inner = _token(), _token(), _token()
    place = _innocent(sshd, token)
    sshd.docker_exec(
        f"mkdir {place}/work && echo host > {place}/work/secret && "
        f"chmod 000 {place}/work/secret && "
        f"cd {place}/work && env -i nohup sleep {inner} >/dev/null 2>&1 &"
    )
    async with open_runtime(hostile.config) as rt:
        sandbox = rt.sandbox_id
        assert sandbox is not None
        swap = (
            f"nohup sleep {leftover} >/dev/null 2>&1 & "
            f"mv {sandbox} {place}.moved && ln -s {place} {sandbox}"
        )
        assert (await rt.exec(["sh", "-c", swap], cwd="/")).exit_code == 0
        assert sshd.docker_exec(f"readlink {sandbox}").strip() == place  # control
        assert _processes(sshd, inner)  # control: still running before the close
    assert (
        sshd.docker_exec(f"test -L {sandbox} || test -e {sandbox} && echo yes || echo no").strip()
        == "no"
    )
    assert _processes(sshd, leftover) == []
    assert _processes(sshd, inner), "a process outside the sandbox was killed"
    assert sshd.docker_exec(f"stat -c %a {place}/work/secret").strip() == "0"
    sshd.docker_exec(f"kill {_processes(sshd, inner)[0].split()[0]}; rm -rf {place}.moved")
    _assert_untouched(sshd, place, token)
