"""Which route the model proxy takes into each backend (asked of the runtime, never probed
by the harness layer), and that a process in the sandbox reaches the proxy through it: the
channel relay by default wherever the channel runs (Docker ``network="none"``, SSH without
any forward, the Modal fake), loopback for the subprocess runtime; the gateway and forward
routes only when asked for."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from harnesses.base import Trace
from harnesses.errors import ProxyRouteError
from harnesses.proxy import ModelProxy, route_to_host
from harnesses.scripted import reply
from runtimes import Runtime, SandboxError, open_runtime
from tests.modal.support import fake_modal, fake_service  # noqa: F401 - fixtures

from .conftest import ScriptedFactory

pytestmark = pytest.mark.anyio

NO_NETWORK = {"type": "docker", "image": "vf-sandbox/python:latest"}

CALL = r"""
import json, sys, urllib.request, urllib.error
url, key = sys.argv[1], sys.argv[2]
body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
req = urllib.request.Request(url + "/chat/completions", data=body,
    headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
try:
    print(json.load(urllib.request.urlopen(req, timeout=20))["choices"][0]["message"]["content"])
except urllib.error.HTTPError as exc:
    print("HTTP", exc.code)
"""

RAW = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), 10)
s.sendall(b"\x00\xffNOT HTTP AT ALL\r\n\r\n" * 64)
s.settimeout(10)
print(s.recv(200)[:12])
"""


async def proxied_call(
    runtime: Runtime, scripted: ScriptedFactory, text: str, via: str | None = None
) -> tuple[str, str, Trace]:
    """One model call made by a process in ``runtime`` through the proxy; returns the route
    taken, what the process printed, and the trace."""
    server = scripted([reply(text)])
    route = await route_to_host(runtime, via=via)
    with ModelProxy(host=route.bind_host) as proxy:
        trace = Trace(harness="test")
        run = proxy.open_run(server.endpoint(), trace)
        url = await route.sandbox_base_url(runtime, proxy)
        try:
            result = await runtime.exec(["python3", "-c", CALL, url, run.secret], timeout=60)
        finally:
            await route.release(runtime)
    assert result.exit_code == 0, result.stderr
    return route.via, result.stdout.strip(), trace


async def test_subprocess_takes_the_loopback(scripted: ScriptedFactory) -> None:
    async with open_runtime({"type": "subprocess"}) as runtime:
        assert runtime.host_routes() == ("loopback",)
        via, said, trace = await proxied_call(runtime, scripted, "over loopback")
        assert (via, said) == ("loopback", "over loopback")
        with pytest.raises(ProxyRouteError, match="its routes: loopback"):
            await route_to_host(runtime, via="channel")
    assert trace.turns[0].status_code == 200


@pytest.mark.docker
async def test_network_less_container_reaches_the_proxy_through_the_channel(
    scripted: ScriptedFactory,
) -> None:
    async with open_runtime(NO_NETWORK) as runtime:
        assert runtime.host_routes() == ("channel",)
        via, said, trace = await proxied_call(runtime, scripted, "through the channel")
        assert (via, said) == ("channel", "through the channel")
        assert trace.turns[0].status_code == 200 and trace.turns[0].reply is not None
        # relayed bytes are untrusted HTTP input to the proxy, as over any network: a
        # wrong secret is a 401, garbage is answered (or dropped) by the HTTP server, and
        # the channel itself is untouched
        server = scripted([reply("never")])
        route = await route_to_host(runtime)
        with ModelProxy(host=route.bind_host) as proxy:
            proxy.open_run(server.endpoint(), Trace(harness="test"))
            url = await route.sandbox_base_url(runtime, proxy)
            wrong = await runtime.exec(["python3", "-c", CALL, url, "not-the-secret"], timeout=60)
            assert wrong.stdout.strip() == "HTTP 401", wrong.stderr
            assert route.exposed is not None
            raw = await runtime.exec(["python3", "-c", RAW, str(route.exposed.port)], timeout=60)
            assert raw.exit_code == 0, raw.stderr
            assert "DOCTYPE" in raw.stdout or "HTTP/1" in raw.stdout  # the error page
            await route.release(runtime)
        assert server.requests == []
        assert runtime.channel_info.state == "running"  # type: ignore[attr-defined]


@pytest.mark.docker
async def test_bridge_container_defaults_to_the_channel_too(scripted: ScriptedFactory) -> None:
    async with open_runtime({**NO_NETWORK, "network": "bridge"}) as runtime:
        assert runtime.host_routes() == ("channel", "gateway")
        via, said, _ = await proxied_call(runtime, scripted, "bridge, by channel")
        assert (via, said) == ("channel", "bridge, by channel")


@pytest.mark.docker
async def test_without_a_channel_a_network_less_container_has_no_route() -> None:
    async with open_runtime({**NO_NETWORK, "channel": False}) as runtime:
        assert runtime.host_routes() == ()
        with pytest.raises(ProxyRouteError, match="network='none' has only the channel route"):
            await route_to_host(runtime)


@pytest.mark.ssh
async def test_ssh_reaches_the_proxy_through_the_channel_without_forwarding(
    scripted: ScriptedFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtimes.ssh import SSHBackend
    from tests.ssh.sshd import SSHServer, image_present

    assert image_present(), "vf-sandbox/sshd is missing: build it with `make images`"

    async def no_forwarding(self: Any, *args: Any, **kwargs: Any) -> int:
        raise SandboxError("this test host allows no TCP forwarding")

    monkeypatch.setattr(SSHBackend, "forward_remote", no_forwarding)
    with SSHServer(tmp_path / "sshd") as sshd:
        async with open_runtime(sshd.config()) as runtime:
            assert runtime.host_routes() == ("channel", "forward")
            via, said, _ = await proxied_call(runtime, scripted, "over ssh, no forward")
            assert (via, said) == ("channel", "over ssh, no forward")


@pytest.mark.docker
async def test_modal_fake_reaches_the_proxy_through_the_channel(
    scripted: ScriptedFactory,
    fake_modal: types.ModuleType,  # noqa: F811 - the fixture
) -> None:
    from tests.modal.support import fake_config

    async with open_runtime(fake_config()) as runtime:
        assert runtime.host_routes() == ("channel",)
        via, said, _ = await proxied_call(runtime, scripted, "modal, by channel")
        assert (via, said) == ("channel", "modal, by channel")
