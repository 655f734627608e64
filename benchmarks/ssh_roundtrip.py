"""Exec round trip of ``true`` through SSHRuntime vs bare paramiko, same server, same run.

    python -m benchmarks.ssh_roundtrip [-n 200]

Starts a ``vf-sandbox/sshd`` container (see ``tests/ssh/sshd.py``), then times, one call
after another on already-open connections:

* ``SSHRuntime.exec(["true"])`` -- channel, wrapper (cwd/program checks, setsid, header),
  both streams read in worker threads, exit status;
* bare ``paramiko`` ``exec_command("true")`` + read + exit status, on an ``SSHClient`` with
  paramiko's defaults (Nagle on);
* the same with ``TCP_NODELAY`` on the socket, as SSHRuntime sets it.

Prints a markdown table: median and p99 in milliseconds and ratios against both baselines.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import paramiko

from runtimes.ssh import SSHRuntime
from tests.ssh.sshd import SSHServer


def _percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _bare_client(server: SSHServer, nodelay: bool) -> paramiko.SSHClient:
    sock = socket.create_connection((server.host, server.port), timeout=10)
    if nodelay:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client = paramiko.SSHClient()
    client.load_host_keys(str(server.known_hosts))
    client.connect(
        server.host,
        server.port,
        username="root",
        key_filename=str(server.key.private_path),
        allow_agent=False,
        look_for_keys=False,
        sock=sock,
    )
    return client


def _time_bare(client: paramiko.SSHClient, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        started = time.perf_counter()
        _, stdout, stderr = client.exec_command("true")
        stdout.read()
        stderr.read()
        assert stdout.channel.recv_exit_status() == 0
        samples.append(time.perf_counter() - started)
    return samples


async def _time_runtime(server: SSHServer, n: int, warmup: int) -> list[float]:
    async with SSHRuntime(server.config()) as rt:
        for _ in range(warmup):
            await rt.exec(["true"])
        samples = []
        for _ in range(n):
            started = time.perf_counter()
            result = await rt.exec(["true"])
            samples.append(time.perf_counter() - started)
            assert result.exit_code == 0, result
        return samples


def _measure_bare(server: SSHServer, n: int, warmup: int, nodelay: bool) -> list[float]:
    client = _bare_client(server, nodelay)
    try:
        _time_bare(client, warmup)
        return _time_bare(client, n)
    finally:
        client.close()


def _row(name: str, samples: list[float], baselines: dict[str, float]) -> str:
    median = statistics.median(samples) * 1000
    p99 = _percentile(samples, 0.99) * 1000
    ratios = " | ".join(f"{median / base:.2f}x" for base in baselines.values())
    return f"| {name} | {median:.2f} | {p99:.2f} | {ratios} |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=200, help="timed calls per variant")
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp, SSHServer(Path(tmp)) as server:
        runs: dict[str, Callable[[], list[float]]] = {
            "paramiko exec_command (defaults)": lambda: _measure_bare(
                server, args.n, args.warmup, nodelay=False
            ),
            "paramiko exec_command + TCP_NODELAY": lambda: _measure_bare(
                server, args.n, args.warmup, nodelay=True
            ),
            "SSHRuntime.exec": lambda: anyio.run(_time_runtime, server, args.n, args.warmup),
        }
        results = {name: run() for name, run in runs.items()}

    baselines = {
        name: statistics.median(results[name]) * 1000
        for name in ("paramiko exec_command (defaults)", "paramiko exec_command + TCP_NODELAY")
    }
    print(f"exec round trip of `true`, n={args.n} each, sshd in a local container\n")
    print("| variant | median ms | p99 ms | vs paramiko defaults | vs paramiko + NODELAY |")
    print("|---|---:|---:|---:|---:|")
    for name, samples in results.items():
        print(_row(name, samples, baselines))


if __name__ == "__main__":
    main()
