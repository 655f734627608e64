"""The common resource limits on SSH (``docs/resources.md``): ``memory`` and ``pids_limit``
set per command with ``prlimit`` on the remote host, against a real sshd container.

Every loop is bounded and every command has a timeout: a broken limit fails the test, it
never hangs the machine."""

from __future__ import annotations

import textwrap

import pytest

from runtimes import ProvisioningError, open_runtime
from tests.ssh.sshd import SSHServer

pytestmark = pytest.mark.anyio

POLICY = "sandbox"
"""The image's unprivileged account (RLIMIT_NPROC does not bind root)."""

ALLOCATE = textwrap.dedent(
    """
    import sys
    try:
        block = bytearray(int(sys.argv[1]) << 20)
    except MemoryError:
        print("MemoryError", flush=True)
        sys.exit(3)
    print("allocated", len(block) >> 20, flush=True)
    """
)

FORK_LOOP = textwrap.dedent(
    """
    import os, sys
    read_end, write_end = os.pipe()
    children = 0
    for _ in range(int(sys.argv[1])):
        try:
            pid = os.fork()
        except BlockingIOError:  # EAGAIN: the process limit
            print("EAGAIN after", children, flush=True)
            break
        if pid == 0:
            os.close(write_end)
            os.read(read_end, 1)  # until the parent closes its end
            os._exit(0)
        children += 1
    else:
        print("no limit after", children, flush=True)
    os.close(write_end)
    for _ in range(children):
        os.wait()
    """
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_command_over_the_memory_limit_fails_and_one_under_it_runs(
    sshd: SSHServer,
) -> None:
    async with open_runtime(sshd.config(memory=128)) as rt:
        limits = await rt.exec(["cat", "/proc/self/limits"], timeout=30)
        line = next(x for x in limits.stdout.splitlines() if x.startswith("Max address space"))
        assert line.split()[3:5] == [str(128 << 20)] * 2, line  # soft and hard alike

        small = await rt.exec(["python3", "-c", ALLOCATE, "16"], timeout=60)
        assert small.exit_code == 0 and small.stdout == "allocated 16\n", small

        big = await rt.exec(["python3", "-c", ALLOCATE, "512"], timeout=60)
        assert big.exit_code == 3 and big.stdout == "MemoryError\n", big


async def test_the_policy_cannot_raise_its_memory_limit(sshd: SSHServer) -> None:
    raise_it = "import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))"
    async with open_runtime(sshd.config(memory=256, policy_user=POLICY)) as rt:
        result = await rt.exec(["python3", "-c", raise_it], user=rt.policy_user, timeout=60)
        assert result.exit_code != 0 and "ValueError" in result.stderr, result


async def test_a_fork_loop_over_the_process_limit_gets_eagain(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config(pids_limit=20, policy_user=POLICY)) as rt:
        result = await rt.exec(
            ["python3", "-c", FORK_LOOP, "200"], user=rt.policy_user, timeout=120
        )
        assert result.exit_code == 0, result
        words = result.stdout.split()
        assert words[:2] == ["EAGAIN", "after"], result
        assert 0 < int(words[2]) < 20, result  # the account's other processes count too


async def test_without_limits_the_same_fork_loop_is_not_stopped(sshd: SSHServer) -> None:
    """The control of the test above: 30 children fit when no pids_limit is set."""
    async with open_runtime(sshd.config(policy_user=POLICY)) as rt:
        result = await rt.exec(["python3", "-c", FORK_LOOP, "30"], user=rt.policy_user, timeout=120)
        assert result.stdout == "no limit after 30\n", result


async def test_limits_without_prlimit_on_the_host_fail_to_open(own_sshd: SSHServer) -> None:
    own_sshd.docker_exec("mv /usr/bin/prlimit /usr/bin/prlimit.gone")
    before = own_sshd.docker_exec("ls -a /tmp")
    with pytest.raises(ProvisioningError, match="prlimit"):
        async with open_runtime(own_sshd.config(memory=256)):
            pass
    assert own_sshd.docker_exec("ls -a /tmp") == before, "the sandbox directory is removed"
    async with open_runtime(own_sshd.config()) as rt:  # no limits: no prlimit needed
        assert (await rt.exec(["true"], timeout=30)).exit_code == 0
