"""A stdin given as an async iterable, through the channel.

It cannot be replayed: the channel never hands an exec whose iterable it pulled from to the
plain path (a typed ``SandboxTransportError`` instead), and pulls nothing before the agent
started the command, so an exec the agent refuses still takes the plain path with its
iterable untouched. A command that closes its stdin stops the pulling (``STDIN_CLOSED``)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
import pytest

from runtimes import SandboxTransportError, SandboxUnavailableError
from runtimes.channel import ChannelHooks, ChannelSupervisor
from runtimes.channel.protocol import ChannelRefused
from runtimes.models import ExecRequest, OutputSink
from runtimes.pytest_plugin import DockerRuntimeFactory

pytestmark = pytest.mark.anyio


def _request(stdin: Any) -> ExecRequest:
    return ExecRequest(("cat",), "/", {}, stdin, None, None, 1 << 20)


async def _unused(*_: object) -> Any:
    raise AssertionError("not expected to be called")


class _PullsThenRefused:
    """A channel whose agent refuses the exec after the host pulled the first chunk."""

    usable = True
    tampered = None

    async def exec(self, request: ExecRequest, sink: OutputSink, env: object) -> int:
        assert request.stdin is not None and not isinstance(request.stdin, bytes)
        await anext(aiter(request.stdin))
        raise ChannelRefused("cannot switch to 'daemon' here")


async def test_a_refused_exec_whose_iterable_was_pulled_is_a_transport_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    supervisor = ChannelSupervisor(
        True, lambda: "fake sandbox", ChannelHooks(_unused, _unused, _unused)
    )

    async def current() -> Any:
        return _PullsThenRefused()

    monkeypatch.setattr(supervisor, "_current", current)
    pulled: list[bytes] = []

    async def source() -> AsyncIterator[bytes]:
        for chunk in (b"one\n", b"two\n"):
            pulled.append(chunk)
            yield chunk

    plain_runs: list[str] = []

    async def plain() -> int:
        plain_runs.append("plain")
        return 0

    with pytest.raises(SandboxTransportError, match="cannot be replayed"):
        await supervisor.exec(_request(source()), OutputSink(1 << 20), plain)
    assert plain_runs == [], "the plain path ran a command whose stdin was partly consumed"
    assert pulled == [b"one\n"]


@pytest.mark.usefixtures("no_leaks")
async def test_an_iterable_partly_sent_when_the_agent_dies_is_not_replayed(
    docker_runtime_factory: DockerRuntimeFactory, docker_client: Any
) -> None:
    """The agent dies after the command consumed the first chunk: a transport error, the
    command ran once (never again on the plain path), the iterable is pulled no further."""
    token = f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"
    pulled: list[bytes] = []

    async def source() -> AsyncIterator[bytes]:
        pulled.append(b"first\n")
        yield b"first\n"
        await anyio.sleep(3600)
        pulled.append(b"second\n")
        yield b"second\n"

    script = f'echo ran >> /tmp/ran; read a; echo "$a" > /tmp/got; echo consumed; sleep {token}'
    consumed = anyio.Event()
    async with docker_runtime_factory() as rt:
        container = docker_client.containers.get(rt.sandbox_id)
        outcome: list[object] = []

        async def run() -> None:
            try:
                outcome.append(
                    await rt.exec(
                        ["sh", "-c", script],
                        stdin=source(),
                        timeout=30,
                        on_output=lambda stream, data: consumed.set(),
                    )
                )
            except Exception as exc:  # noqa: BLE001 - inspected below
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(10):
                await consumed.wait()
            pid = rt.channel_info.agent_pid
            await anyio.to_thread.run_sync(lambda: container.exec_run(["kill", "-KILL", str(pid)]))
        exc = outcome[0]
        assert isinstance(exc, SandboxTransportError), repr(exc)
        assert not isinstance(exc, SandboxUnavailableError)
        assert pulled == [b"first\n"], pulled
        assert await rt.read("/tmp/ran") == b"ran\n", "the command ran again"
        assert await rt.read("/tmp/got") == b"first\n"
        assert rt.channel_info.fallbacks == 0, rt.channel_info
        listing = (await rt.exec(["ps", "-eo", "args"])).stdout
        assert token not in listing, listing


@pytest.mark.usefixtures("no_leaks")
async def test_a_refused_exec_takes_the_plain_path_with_its_iterable_whole(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """The agent (running as nobody) cannot become daemon: nothing was pulled, so the plain
    path serves the call and the command reads every chunk."""

    async def source() -> AsyncIterator[bytes]:
        yield b"one\n"
        yield b"two\n"

    async with docker_runtime_factory(user="nobody") as rt:
        result = await rt.exec(["sh", "-c", "id -un; cat"], user="daemon", stdin=source())
        assert result.stdout == "daemon\none\ntwo\n", result
        info = rt.channel_info
        assert info.state == "running" and info.fallbacks == 1, info


async def test_a_command_that_closes_its_stdin_stops_the_pulling(
    docker_runtime_factory: DockerRuntimeFactory,
) -> None:
    """The agent reports the closed pipe: the host stops pulling an endless iterable while
    the command runs on (without the report it would pull ~200 more chunks in that second)."""
    chunk = 16 * 1024
    pulled = 0
    at_close: list[int] = []

    async def endless() -> AsyncIterator[bytes]:
        nonlocal pulled
        while True:
            pulled += 1
            yield b"x" * chunk
            await anyio.sleep(0.005)

    def on_output(stream: str, data: bytes) -> None:
        if b"closed" in data:
            at_close.append(pulled)

    script = "head -c 5 >/dev/null; exec 0<&-; echo closed; sleep 1; echo done"
    async with docker_runtime_factory() as rt:
        result = await rt.exec(["sh", "-c", script], stdin=endless(), on_output=on_output)
        assert result.stdout == "closed\ndone\n", result
        assert at_close, result
        assert pulled - at_close[0] <= 20, f"{pulled - at_close[0]} chunks pulled after the close"
