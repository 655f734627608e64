"""Faults on a real sshd: the host killed mid-exec and mid-transfer, restarted, unreachable.

Each test that kills or restarts the server gets its own container (``own_sshd``), bound
to a fixed host port so the restarted container comes back at the same address.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Awaitable

import anyio
import anyio.to_thread
import pytest

from runtimes import (
    ProvisioningError,
    SandboxTransportError,
    SandboxUnavailableError,
    open_runtime,
)
from runtimes.ssh import HostUnreachableError, SSHConfig
from tests.ssh.sshd import ECHO_CLIENT, SSHServer, free_port, tcp_echo_server

pytestmark = pytest.mark.anyio

BIG = 200 * 1024 * 1024
"""Big enough that a transfer is still running when the container dies."""


async def _kill_soon(server: SSHServer, delay: float) -> None:
    await anyio.sleep(delay)
    await anyio.to_thread.run_sync(server.kill)


async def _while_killed(server: SSHServer, delay: float, call: Awaitable[object]) -> BaseException:
    """Run ``call`` while the container is killed after ``delay`` seconds; return its error."""
    caught: list[BaseException] = []

    async def run() -> None:
        try:
            await call
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            caught.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        tg.start_soon(_kill_soon, server, delay)
    assert caught, "the call survived the crash"
    return caught[0]


async def test_killed_mid_exec_is_a_transport_error_then_unavailable(own_sshd: SSHServer) -> None:
    async with open_runtime(own_sshd.config()) as rt:
        await rt.write("survivor.txt", b"written before the crash")
        started = time.monotonic()
        exc = await _while_killed(
            own_sshd, 1.0, rt.exec(["sh", "-c", "echo started; sleep 60"], timeout=30)
        )
        assert time.monotonic() - started < 15, "the dropped connection was not noticed"
        assert isinstance(exc, SandboxTransportError), repr(exc)
        assert not isinstance(exc, SandboxUnavailableError | FileNotFoundError)

        # The host is gone: reconnecting is refused, so the sandbox is unavailable.
        with pytest.raises(SandboxUnavailableError):
            await rt.exec(["true"])
        with pytest.raises(SandboxUnavailableError):
            await rt.read("survivor.txt")
        assert await rt.alive() is False

        # The host comes back on the same port: the runtime reconnects by itself.
        await anyio.to_thread.run_sync(own_sshd.start_again)
        assert await rt.alive() is True
        assert await rt.read("survivor.txt") == b"written before the crash"
        assert (await rt.exec(["echo", "back"])).stdout == "back\n"


# paramiko's SFTP prefetch runs in its own thread, which dies with an EOFError when the
# connection drops; the read itself surfaces the typed error.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_killed_mid_read_is_unavailable_after_retry(own_sshd: SSHServer) -> None:
    async with open_runtime(own_sshd.config()) as rt:
        made = await rt.exec(["sh", "-c", f"head -c {BIG} /dev/zero > big.bin"], timeout=120)
        assert made.exit_code == 0, made
        started = time.monotonic()
        exc = await _while_killed(own_sshd, 0.3, rt.read("big.bin"))
        # The transfer failed (transport), the bounded retry found the host gone.
        assert isinstance(exc, SandboxUnavailableError), repr(exc)
        assert "reconnecting failed" in str(exc), exc
        assert time.monotonic() - started < 20


async def test_killed_mid_write_is_a_transport_error(own_sshd: SSHServer) -> None:
    async with open_runtime(own_sshd.config()) as rt:
        exc = await _while_killed(own_sshd, 0.3, rt.write("big.bin", b"\x5a" * BIG))
        assert isinstance(exc, SandboxTransportError), repr(exc)
        assert not isinstance(exc, SandboxUnavailableError | FileNotFoundError)


async def test_restart_while_idle_reconnects_transparently(own_sshd: SSHServer) -> None:
    """`docker restart`: the connection drops, the next calls reconnect (forwards too)."""
    with tcp_echo_server() as echo_port:
        async with open_runtime(own_sshd.config()) as rt:
            await rt.write("kept.txt", b"kept")
            remote_port = await rt.forward_remote(echo_port)
            await anyio.to_thread.run_sync(own_sshd.restart)

            result = await rt.exec(["cat", "kept.txt"])  # exec reconnects before sending
            assert result.stdout == "kept", result
            assert await rt.read("kept.txt") == b"kept"
            probe = await rt.exec(["python3", "-c", ECHO_CLIENT, str(remote_port)], timeout=30)
            assert probe.stdout == "echo:ping\n", probe


async def test_unreachable_host_at_start_is_provisioning_error() -> None:
    config = SSHConfig(
        host="127.0.0.1", port=free_port(), username="root", password="unused", connect_timeout=3
    )
    with pytest.raises(HostUnreachableError) as info:
        async with open_runtime(config):
            pass
    assert isinstance(info.value, ProvisioningError)
    assert f"127.0.0.1:{config.port}" in str(info.value)


async def test_silent_host_times_out_at_start() -> None:
    """A port that accepts TCP but never speaks SSH: refused within connect_timeout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)  # never accepted: the kernel completes the handshake, no banner
        port = listener.getsockname()[1]
        config = SSHConfig(
            host="127.0.0.1", port=port, username="root", password="unused", connect_timeout=1.5
        )
        started = time.monotonic()
        with pytest.raises(HostUnreachableError):
            async with open_runtime(config):
                pass
        assert time.monotonic() - started < 10
