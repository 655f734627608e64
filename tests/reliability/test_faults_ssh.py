"""Faults on the ssh backend, against a real OpenSSH server in a container: the server
killed, stopped and paused mid-exec, mid-read and mid-write, then brought back.

A killed or stopped server drops the connection: a call under way is a
``SandboxTransportError`` (or, for an idempotent call whose retry found the host gone,
``SandboxUnavailableError``); calls made while it is down are ``SandboxUnavailableError``;
once it is back at the same address the runtime reconnects by itself. A paused server
answers nothing: an exec runs into its own timeout (``ExecTimeoutError``), file calls into
``io_timeout``. No call waits past its bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import (
    ExecTimeoutError,
    SandboxTransportError,
    SandboxUnavailableError,
    open_runtime,
)
from runtimes.base import Runtime
from runtimes.models import MiB
from tests.ssh.sshd import SSHServer

from .conftest import TALLY, assert_no_process, settle, settle_during, sha, token

pytestmark = [pytest.mark.anyio, pytest.mark.ssh]

BIG = 96 * MiB
EXEC_TIMEOUT = 3.0
MARGIN = 20.0
"""Beyond an exec's timeout: the channel waits 10 s for its agent to confirm a kill, then
the plain path kills within 5 s (both unanswered on a paused server)."""
IO_TIMEOUT = 2.0
CONNECT_TIMEOUT = 1.5
FILE_LIMIT = 3 * (IO_TIMEOUT + CONNECT_TIMEOUT) + 10
"""A file call on a silent server: io_timeout, then bounded reconnect attempts."""

OLD = b"old content\n"
NEW = bytes(range(256)) * (BIG // 256)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, sshd_image: str) -> Iterator[SSHServer]:
    with SSHServer(Path(tmp_path_factory.mktemp("faulted-sshd"))) as sshd:
        yield sshd


@pytest.fixture
def sshd(server: SSHServer) -> Iterator[SSHServer]:
    """The module's server, running and unpaused whatever the previous test did to it."""
    _bring_back(server)
    yield server
    _bring_back(server)


def _bring_back(server: SSHServer) -> None:
    server.wrapped.reload()
    status = server.wrapped.status
    if status == "paused":
        server.wrapped.unpause()
    elif status != "running":
        server.start_again()
    server.wait_ready()


def _kill(server: SSHServer) -> None:
    server.kill()


def _stop(server: SSHServer) -> None:
    server.wrapped.stop(timeout=1)


def _pause(server: SSHServer) -> None:
    import docker.errors

    for attempt in range(5):
        try:
            server.wrapped.pause()
            return
        except docker.errors.APIError as exc:
            # runc's cgroup-v1 freezer gives up on a busy machine ("unable to freeze") and
            # thaws again: the fault was not injected yet, so it is tried again.
            if "unable to freeze" not in str(exc) or attempt == 4:
                raise


FAULTS: dict[str, Callable[[SSHServer], None]] = {
    "killed": _kill,
    "stopped": _stop,
    "paused": _pause,
    "paused-plain": _pause,
}
EXEC_FAULTS = ["killed", "stopped", "paused"]
FILE_FAULTS = ["killed", "stopped", "paused", "paused-plain"]
"""paused-plain: the same with channel=False (the path images without python3 use)."""


def _file_config(sshd: SSHServer, fault: str) -> Any:
    return sshd.config(
        io_timeout=IO_TIMEOUT, connect_timeout=CONNECT_TIMEOUT, channel=fault != "paused-plain"
    )


async def _after_fault(rt: Runtime, sshd: SSHServer, fault: str) -> None:
    """While the server is down, calls are unavailable; once it is back, the runtime is."""
    if not fault.startswith("paused"):
        down = await settle(rt.exec(["true"], timeout=EXEC_TIMEOUT), MARGIN)
        down.raised(SandboxUnavailableError)
        assert await rt.alive() is False
    await anyio.to_thread.run_sync(_bring_back, sshd)
    assert await rt.alive() is True
    assert await rt.read("kept.txt") == OLD, "the sandbox's files survive the fault"
    assert (await rt.exec(["echo", "back"], timeout=30)).stdout == "back\n"


@pytest.mark.parametrize("fault", EXEC_FAULTS)
async def test_server_faulted_mid_exec(sshd: SSHServer, fault: str) -> None:
    # Default io_timeout (120 s): the exec's own timeout must bound it, not io_timeout.
    async with open_runtime(sshd.config()) as rt:
        await rt.write("kept.txt", OLD)
        mark = token()
        outcome = await settle_during(
            rt.exec(["sh", "-c", f"echo started; sleep {mark}"], timeout=EXEC_TIMEOUT),
            0.6,
            lambda: FAULTS[fault](sshd),
            EXEC_TIMEOUT + MARGIN,
        )
        if fault == "paused":
            error = outcome.raised(ExecTimeoutError)
            assert error.stdout_bytes == b"started\n", error.stdout_bytes
        else:
            error = outcome.raised(SandboxTransportError)
            assert not isinstance(error, SandboxUnavailableError | FileNotFoundError)
        await _after_fault(rt, sshd, fault)
        await assert_no_process(rt, mark)
    TALLY.add(f"faults survived: ssh server {fault} mid-exec")


@pytest.mark.parametrize("fault", FILE_FAULTS)
async def test_server_faulted_mid_read(sshd: SSHServer, fault: str) -> None:
    config = _file_config(sshd, fault)
    async with open_runtime(config) as rt:
        await rt.write("kept.txt", OLD)
        await rt.write("big.bin", NEW)
        outcome = await settle_during(
            rt.read("big.bin"), 0.1, lambda: FAULTS[fault](sshd), FILE_LIMIT
        )
        if outcome.error is None:
            assert sha(outcome.value) == sha(NEW), "a read that returns must return every byte"
        else:
            outcome.raised(SandboxUnavailableError, SandboxTransportError)
        await _after_fault(rt, sshd, fault)
        assert sha(await rt.read("big.bin")) == sha(NEW)
    TALLY.add(f"faults survived: ssh server {fault} mid-read")


@pytest.mark.parametrize("fault", FILE_FAULTS)
async def test_server_faulted_mid_write(sshd: SSHServer, fault: str) -> None:
    config = _file_config(sshd, fault)
    async with open_runtime(config) as rt:
        await rt.write("kept.txt", OLD)
        await rt.write("big.bin", OLD)
        outcome = await settle_during(
            rt.write("big.bin", NEW), 0.1, lambda: FAULTS[fault](sshd), FILE_LIMIT
        )
        if outcome.error is not None:
            outcome.raised(SandboxTransportError, SandboxUnavailableError)
        await _after_fault(rt, sshd, fault)
        after = await rt.read("big.bin")
        if outcome.error is None:
            assert sha(after) == sha(NEW)
        else:
            assert after == OLD or sha(after) == sha(NEW), (
                f"a failed write left {len(after)} bytes, neither the old content nor the new"
            )
        await rt.write("big.bin", NEW)
        assert sha(await rt.read("big.bin")) == sha(NEW), "writing again works"
    TALLY.add(f"faults survived: ssh server {fault} mid-write")


async def test_server_restarted_while_idle_and_busy(sshd: SSHServer) -> None:
    """`docker restart` under open runtimes: idle ones reconnect on their next call."""
    async with open_runtime(sshd.config()) as first, open_runtime(sshd.config()) as second:
        await first.write("kept.txt", OLD)
        await second.write("kept.txt", OLD)
        await anyio.to_thread.run_sync(sshd.restart)
        for rt in (first, second):
            assert (await settle(rt.read("kept.txt"), MARGIN)).value == OLD
            assert (await rt.exec(["echo", "back"], timeout=30)).stdout == "back\n"
    TALLY.add("faults survived: ssh server restarted under 2 open runtimes")
