"""Faults on the docker backend: the container killed, stopped and paused mid-exec, mid-read
and mid-write; the engine connection cut and brought back while runtimes are open.

"The engine restarted" is played by a TCP proxy in front of the engine's socket
(``tests/docker/proxy.py``): cutting it resets every connection and refuses new ones,
restoring it forwards again. From the client's side that is an engine restart; the real
dockerd is never touched (other tests use it).

Every faulted call runs under ``settle(call, limit)``: it must answer with its typed error
(or, where the engine could finish the transfer, the exact bytes) before ``limit``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
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
from tests.docker.proxy import EngineProxy

from .conftest import TALLY, assert_no_process, settle, settle_during, sha, token

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.usefixtures("no_container_leaks")]

BIG = 96 * MiB
"""Big enough that a transfer is still running when the fault hits."""
EXEC_TIMEOUT = 3.0
MARGIN = 10.0
"""Seconds a faulted call may take beyond its own timeout (kill, probe, close)."""

OLD = b"old content\n"
NEW = bytes(range(256)) * (BIG // 256)


def _kill(container: Any) -> None:
    container.kill()


def _stop(container: Any) -> None:
    container.stop(timeout=1)


def _pause(container: Any) -> None:
    container.pause()


FAULTS: dict[str, Callable[[Any], None]] = {"killed": _kill, "stopped": _stop, "paused": _pause}


def _recover(container: Any, fault: str) -> None:
    """What an operator does to bring the container back."""
    if fault == "paused":
        container.unpause()
    else:
        container.start()


@pytest.fixture
async def rt() -> Any:
    async with open_runtime({"type": "docker"}) as runtime:
        yield runtime


def _container(docker_client: Any, runtime: Runtime) -> Any:
    return docker_client.containers.get(runtime.sandbox_id)


# ---------------------------------------------------------------------- the container faulted


PATHS = [pytest.param(True, id="channel"), pytest.param(False, id="plain")]
"""Each command through the persistent channel (the default), or through one engine exec
each (channel=False, what images without python3 fall back to)."""


@pytest.mark.parametrize("channel", PATHS)
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_container_faulted_mid_exec(docker_client: Any, fault: str, channel: bool) -> None:
    async with open_runtime({"type": "docker", "channel": channel}) as rt:
        await _faulted_exec(rt, docker_client, fault)
    TALLY.add(f"faults survived: docker {fault} mid-exec")


async def _faulted_exec(rt: Runtime, docker_client: Any, fault: str) -> None:
    container = _container(docker_client, rt)
    await rt.write("kept.txt", OLD)
    mark = token()
    outcome = await settle_during(
        rt.exec(["sh", "-c", f"echo started; sleep {mark}"], timeout=EXEC_TIMEOUT),
        0.5,
        lambda: FAULTS[fault](container),
        EXEC_TIMEOUT + MARGIN,
    )
    if fault == "paused":
        # A frozen command cannot finish: the call runs into its own timeout, or the
        # runtime notices the pause first (a paused sandbox is a stopped one).
        error = outcome.raised(ExecTimeoutError, SandboxUnavailableError)
        if isinstance(error, ExecTimeoutError):
            assert error.stdout_bytes == b"started\n", error.stdout_bytes
    else:
        outcome.raised(SandboxUnavailableError)
        later = await settle(rt.exec(["true"]), MARGIN)
        later.raised(SandboxUnavailableError)
        assert not await rt.alive()

    await anyio.to_thread.run_sync(_recover, container, fault)
    assert await rt.read("kept.txt") == OLD, "the sandbox's files survive the fault"
    assert (await rt.exec(["echo", "back"])).stdout == "back\n", "the runtime carries on"
    await assert_no_process(rt, mark)


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_container_faulted_mid_read(rt: Runtime, docker_client: Any, fault: str) -> None:
    container = _container(docker_client, rt)
    await rt.write("big.bin", NEW)
    outcome = await settle_during(
        rt.read("big.bin"), 0.05, lambda: FAULTS[fault](container), MARGIN
    )
    if outcome.error is not None:
        outcome.raised(SandboxUnavailableError)
    else:
        # The engine reads a stopped or paused container's filesystem: a read that was
        # under way may finish. Then it must be the exact bytes.
        assert sha(outcome.value) == sha(NEW), "a read that returns must return every byte"
    if fault != "paused":
        (await settle(rt.exec(["true"]), MARGIN)).raised(SandboxUnavailableError)
    await anyio.to_thread.run_sync(_recover, container, fault)
    assert sha(await rt.read("big.bin")) == sha(NEW)
    TALLY.add(f"faults survived: docker {fault} mid-read")


@pytest.mark.parametrize("channel", PATHS)
@pytest.mark.parametrize("fault", list(FAULTS))
async def test_container_faulted_mid_write(docker_client: Any, fault: str, channel: bool) -> None:
    async with open_runtime({"type": "docker", "channel": channel}) as rt:
        await _faulted_write(rt, docker_client, fault)
    TALLY.add(f"faults survived: docker {fault} mid-write")


async def _faulted_write(rt: Runtime, docker_client: Any, fault: str) -> None:
    container = _container(docker_client, rt)
    await rt.write("target.bin", OLD)
    outcome = await settle_during(
        rt.write("target.bin", NEW), 0.05, lambda: FAULTS[fault](container), MARGIN
    )
    if outcome.error is not None:
        outcome.raised(SandboxUnavailableError)
    await anyio.to_thread.run_sync(_recover, container, fault)
    after = await rt.read("target.bin")
    if outcome.error is None:
        assert sha(after) == sha(NEW), "a write that returned must have landed whole"
    else:
        assert after in (OLD, NEW), f"a failed write left {len(after)} bytes, neither old nor new"


# ---------------------------------------------------------------------- the engine connection


@pytest.fixture
def proxy() -> Iterator[EngineProxy]:
    with EngineProxy() as engine:
        yield engine


def _proxied(proxy: EngineProxy, channel: bool = True) -> Any:
    config = {"type": "docker", "base_url": proxy.base_url, "api_timeout": 5, "channel": channel}
    return open_runtime(config)


@pytest.fixture
async def proxied(proxy: EngineProxy) -> Any:
    async with _proxied(proxy) as rt:
        yield rt


@pytest.mark.parametrize("channel", PATHS)
async def test_engine_restart_mid_exec(proxy: EngineProxy, channel: bool) -> None:
    """The connection drops under a running command: a transport error (exec is not
    retried), and once the engine answers again the runtime carries on and the command
    it lost track of does not keep running."""
    async with _proxied(proxy, channel) as proxied:
        await _exec_through_restart(proxied, proxy)
    TALLY.add("faults survived: docker engine restarted mid-exec")


async def _exec_through_restart(proxied: Runtime, proxy: EngineProxy) -> None:
    mark = token()
    started = anyio.Event()

    async def cut_once_started() -> None:
        # Cut once the command's output arrived: its process group was announced before it
        # (a cut at a fixed delay came first on a busy machine, and a command the runtime
        # never heard of cannot be killed).
        with anyio.fail_after(30):
            await started.wait()
        await anyio.to_thread.run_sync(proxy.cut)

    async with anyio.create_task_group() as tg:
        tg.start_soon(cut_once_started)
        outcome = await settle(
            proxied.exec(
                ["sh", "-c", f"echo started; sleep {mark}"],
                timeout=30,
                on_output=lambda _stream, _chunk: started.set(),
            ),
            30 + MARGIN,
        )
    error = outcome.raised(SandboxTransportError)
    assert not isinstance(error, SandboxUnavailableError | FileNotFoundError)
    assert outcome.seconds < MARGIN, f"a dropped engine took {outcome.seconds:.1f}s to notice"
    (await settle(proxied.exec(["true"]), MARGIN)).raised(SandboxTransportError)
    proxy.restore()
    assert (await proxied.exec(["echo", "back"], timeout=30)).stdout == "back\n"
    await assert_no_process(proxied, mark)


async def test_engine_restart_mid_read_is_ridden_out(proxied: Runtime, proxy: EngineProxy) -> None:
    """A read is idempotent: cut mid-transfer and back 0.3 s later, the retry delivers
    every byte."""
    await proxied.write("big.bin", NEW)

    def blip() -> None:
        proxy.cut()
        threading.Timer(0.3, proxy.restore).start()

    outcome = await settle_during(proxied.read("big.bin"), 0.05, blip, MARGIN + 30)
    assert outcome.error is None, f"the read did not ride out a short outage: {outcome.error!r}"
    assert sha(outcome.value) == sha(NEW)
    TALLY.add("faults survived: docker engine restarted mid-read")


async def test_engine_down_mid_read_is_transport_error(
    proxied: Runtime, proxy: EngineProxy
) -> None:
    await proxied.write("big.bin", NEW)
    outcome = await settle_during(proxied.read("big.bin"), 0.05, proxy.cut, MARGIN + 30)
    outcome.raised(SandboxTransportError)
    proxy.restore()
    assert sha(await proxied.read("big.bin")) == sha(NEW)
    TALLY.add("faults survived: docker engine down mid-read")


@pytest.mark.parametrize("channel", PATHS)
async def test_engine_restart_mid_write(proxy: EngineProxy, channel: bool) -> None:
    async with _proxied(proxy, channel) as proxied:
        await _write_through_restart(proxied, proxy)
    TALLY.add("faults survived: docker engine restarted mid-write")


async def _write_through_restart(proxied: Runtime, proxy: EngineProxy) -> None:
    await proxied.write("target.bin", OLD)
    outcome = await settle_during(proxied.write("target.bin", NEW), 0.05, proxy.cut, MARGIN + 30)
    outcome.raised(SandboxTransportError)
    proxy.restore()
    after = await proxied.read("target.bin")
    assert after in (OLD, NEW), f"a failed write left {len(after)} bytes, neither old nor new"
    await proxied.write("target.bin", NEW)
    assert sha(await proxied.read("target.bin")) == sha(NEW), "writing again works"
