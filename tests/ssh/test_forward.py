"""forward_remote: a process in the SSH sandbox reaches a server on the host's loopback."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import anyio
import pytest

from runtimes import SandboxUnavailableError, open_runtime
from runtimes.ssh import SSHRuntime
from tests.ssh.sshd import ECHO_CLIENT, SSHServer, free_port, tcp_echo_server

pytestmark = pytest.mark.anyio


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = f"hello from the host: {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


_GET = (
    "import sys, urllib.request; "
    "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
)


async def test_http_through_reverse_forward(sshd: SSHServer, http_port: int) -> None:
    async with open_runtime(sshd.config()) as rt:
        assert isinstance(rt, SSHRuntime)
        remote_port = await rt.forward_remote(http_port)
        assert remote_port > 0
        result = await rt.exec(
            ["python3", "-c", _GET, f"http://127.0.0.1:{remote_port}/v1/chat"], timeout=30
        )
        assert result.stdout == "hello from the host: /v1/chat\n", result


async def test_concurrent_connections_and_large_payloads(sshd: SSHServer) -> None:
    with tcp_echo_server() as echo_port:
        async with open_runtime(sshd.config()) as rt:
            assert isinstance(rt, SSHRuntime)
            remote_port = await rt.forward_remote(echo_port)
            outputs: dict[int, str] = {}

            async def client(i: int) -> None:
                message = f"m{i}-" + "x" * (100_000 if i == 0 else 10)
                r = await rt.exec(
                    ["python3", "-c", ECHO_CLIENT, str(remote_port), message], timeout=30
                )
                outputs[i] = r.stdout

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(client, i)
            assert outputs[0] == "echo:m0-" + "x" * 100_000 + "\n"
            assert {i: outputs[i] for i in range(1, 6)} == {
                i: f"echo:m{i}-xxxxxxxxxx\n" for i in range(1, 6)
            }


async def test_fixed_remote_port_and_cancel(sshd: SSHServer) -> None:
    with tcp_echo_server() as echo_port:
        async with open_runtime(sshd.config()) as rt:
            assert isinstance(rt, SSHRuntime)
            wanted = (
                free_port()
            )  # free on the host; the container's loopback is its own, so free too
            assert await rt.forward_remote(echo_port, wanted) == wanted
            ok = await rt.exec(["python3", "-c", ECHO_CLIENT, str(wanted)], timeout=30)
            assert ok.stdout == "echo:ping\n", ok
            await rt.cancel_forward_remote(wanted)
            refused = await rt.exec(["python3", "-c", ECHO_CLIENT, str(wanted)], timeout=30)
            assert refused.exit_code != 0 and "ConnectionRefusedError" in refused.stderr, refused


async def test_forward_to_a_dead_local_port_fails_only_that_connection(sshd: SSHServer) -> None:
    async with open_runtime(sshd.config()) as rt:
        assert isinstance(rt, SSHRuntime)
        remote_port = await rt.forward_remote(free_port())  # nothing listens there
        failed = await rt.exec(["python3", "-c", ECHO_CLIENT, str(remote_port)], timeout=30)
        assert failed.exit_code != 0 or failed.stdout.strip() == "", failed
        assert (await rt.exec(["echo", "fine"])).stdout == "fine\n"


async def test_forward_needs_an_open_runtime(sshd: SSHServer) -> None:
    rt = open_runtime(sshd.config())
    assert isinstance(rt, SSHRuntime)
    with pytest.raises(SandboxUnavailableError):
        await rt.forward_remote(8080)
