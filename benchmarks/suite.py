"""The measurements of ``python -m benchmarks``: each beside a baseline measured in the same run.

Sections (each returns markdown):

* exec round trip of ``true`` — every runtime, interleaved call by call with the baselines:
  raw local ``subprocess.run``, the Docker SDK's ``exec_run``, bare paramiko ``exec_command``
  on a socket with ``TCP_NODELAY``;
* files — write and read of 1 KiB and 10 MiB vs ``put_archive`` / ``get_archive`` (tar built
  or extracted in the call), local file I/O, and bare paramiko SFTP;
* create-to-ready — ``start()`` then a first ``exec(["true"])`` vs ``containers.run`` then a
  first ``exec_run(["true"])`` (and the like for the other backends);
* fleet — N concurrent Docker sandboxes x M sequential execs each: throughput, errors,
  containers left afterwards, vs the same with the SDK alone;
* judge placement — ``placement.inputs.materialise`` + reading ``verdict.json`` vs bare writes
  of the same bytes + the same read;
* model proxy — a turn direct vs through the recording proxy (``benchmarks.proxy_latency``);
* streamed exec — first-chunk latency vs ``exec_run(stream=True)`` (``benchmarks.streaming``);
* shell sessions — ``sh.run("true")`` vs ``exec(["true"])`` and SWE-ReX's ``run_in_session``
  (``benchmarks.sessions``).
* idle sandboxes at scale — 64, 128, 256 Docker sandboxes with the channel: how many start and
  answer, and memory per sandbox (``benchmarks.scale``);
* inspect_ai sandboxes — ``exec``, ``write_file``, ``read_file`` through inspect's built-in
  Docker sandbox, vf-sandbox's inspect provider, the Docker SDK and inspect's local sandbox
  (``benchmarks.inspect_sandbox``).
* forks — ``rt.snapshot()`` + a fork's ``start()`` on Docker vs ``docker commit`` +
  ``containers.run`` of the same container (``benchmarks.snapshots``).
* warm pools — ``pool.acquire()`` on a warm Docker pool vs ``open_runtime(...).start()``, and
  the rate of (acquire, 10 execs, close) cycles through a pool vs without (``benchmarks.pool``).
* the embedded default — the subprocess runtime's exec, files, ``close()`` and concurrent exec
  throughput vs plain host calls and inspect_ai's local sandbox (``benchmarks.embedded``).
* Ray — exec, files and create-to-ready through a ray sandbox on a worker node of a local
  cluster vs the same runtime locally, and ``run_rollouts``' rate on 1-3 nodes
  (``benchmarks.ray``; needs ray and root, else the section says why).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import tarfile
import tempfile
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from runtimes import ownership
from runtimes.base import Runtime
from runtimes.docker import DockerConfig, DockerRuntime
from runtimes.subprocess import SubprocessConfig

from .stats import Call, Series, interleaved, ms, ratio, table, timed, verdict

KEEP_ALIVE = ["sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 86400 & wait $!; done"]
KiB = 1024
MiB = 1024 * KiB
FAKE = "modal (FAKE SDK)"
EVERY_BACKEND = {"exec", "files", "create", "placement"}  # the sections that need sshd, fake Modal


DEFAULT_SCALE_COUNTS = (64, 128, 256)

ALL_SECTIONS = (
    "exec",
    "files",
    "create",
    "fleet",
    "placement",
    "proxy",
    "stream",
    "shell",
    "inspect",
    "fork",
    "pool",
    "scale",
    "embedded",
    "ray",
)


@dataclass
class Options:
    image: str = "vf-sandbox/base:bookworm"
    n_exec: int = 300
    n_small_file: int = 100
    n_big_file: int = 10
    n_create: int = 15
    sandboxes: int = 32
    execs_per_sandbox: int = 50
    n_placement: int = 20
    proxy_turns: int = 100
    n_stream: int = 100
    n_shell: int = 200
    n_inspect: int = 100
    quick_scale: bool = False
    n_pool: int = 30
    pool_cycles: int = 48
    pool_workers: tuple[int, ...] = (1, 4)
    n_ray_rollouts: int = 24
    swerex_python: str | None = None
    ssh: bool = True
    modal_fake: bool = True
    sections: set[str] = field(default_factory=lambda: set(ALL_SECTIONS))


@dataclass
class Row:
    """One measured thing beside its baseline, with an optional target."""

    name: str
    ours: Series
    base_name: str
    base: Series | None
    target: str = "-"
    met: bool | None = None

    def cells(self, tail: float = 0.99) -> list[str]:
        base = self.base
        return [
            self.name,
            ms(self.ours.median_ms),
            ms(self.ours.percentile_ms(tail)),
            self.base_name,
            ms(base.median_ms) if base else "-",
            ms(base.percentile_ms(tail)) if base else "-",
            ratio(self.ours.median_ms, base.median_ms) if base else "-",
            self.target,
            verdict(self.met),
        ]


def _within(ours: Series, base: Series, factor: float) -> bool:
    return ours.median_ms <= factor * base.median_ms


def rows_table(rows: list[Row], tail: float = 0.99) -> str:
    label = f"p{round(tail * 100)}"
    headers = [
        "measure",
        "median ms",
        f"{label} ms",
        "baseline (same run)",
        "baseline median ms",
        f"baseline {label} ms",
        "ratio (medians)",
        "target",
        "",
    ]
    return table(headers, [row.cells(tail) for row in rows])


# ---------------------------------------------------------------------- environment


class Environment:
    """The docker client, the baseline container, the sshd container, the fake Modal."""

    def __init__(self, options: Options) -> None:
        import docker

        self.options = options
        self.client = docker.from_env(max_pool_size=64)
        self.ssh_server: Any = None
        self.fake_modal: Any = None
        self._stack = contextlib.ExitStack()

    def docker_version(self) -> str:
        info = self.client.version()
        return f"{info.get('Version', '?')} (API {info.get('ApiVersion', '?')})"

    def __enter__(self) -> Environment:
        tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="vf-bench-")))
        every_backend = bool(self.options.sections & EVERY_BACKEND)
        if self.options.ssh and every_backend:
            from tests.ssh.sshd import SSHServer

            self.ssh_server = self._stack.enter_context(SSHServer(tmp / "sshd"))
        if self.options.modal_fake and every_backend:
            self.fake_modal = self._stack.enter_context(_fake_modal(tmp / "modal"))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self.client.close()

    def bare_container(self) -> Any:
        return self.client.containers.run(
            self.options.image,
            KEEP_ALIVE,
            detach=True,
            network_mode="none",
            init=True,
            labels=ownership.ownership_labels("docker", {"vf-sandbox.role": "benchmark-baseline"}),
        )

    def paramiko_client(self) -> Any:
        """Bare paramiko on a socket with TCP_NODELAY (as SSHRuntime sets it)."""
        import paramiko

        server = self.ssh_server
        sock = socket.create_connection((server.host, server.port), timeout=10)
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

    def configs(self) -> dict[str, Any]:
        """Every runtime variant measured, by label."""
        image = self.options.image
        found: dict[str, Any] = {
            "subprocess": SubprocessConfig(),
            "docker, channel": DockerConfig(image=image, creations_per_second=None),
            "docker, no channel": DockerConfig(
                image=image, channel=False, creations_per_second=None
            ),
        }
        if self.ssh_server is not None:
            found["ssh, channel"] = self.ssh_server.config()
            found["ssh, no channel"] = self.ssh_server.config(channel=False)
        if self.fake_modal is not None:
            from tests.modal.support import fake_config

            found[f"{FAKE}, channel"] = fake_config()
            found[f"{FAKE}, no channel"] = fake_config(channel=False)
        return found


@contextlib.contextmanager
def _fake_modal(state: Path) -> Iterator[types.ModuleType]:
    import pytest

    from tests.modal.fake_modal import FakeModalService, install

    patch = pytest.MonkeyPatch()
    service = FakeModalService(state)
    try:
        yield install(service, patch)
    finally:
        patch.undo()
        service.close()


@contextlib.asynccontextmanager
async def opened(configs: dict[str, Any]) -> AsyncIterator[dict[str, Runtime]]:
    from runtimes import open_runtime

    async with contextlib.AsyncExitStack() as stack:
        runtimes = {}
        for name, config in configs.items():
            runtimes[name] = await stack.enter_async_context(open_runtime(config))
        yield runtimes


def _remove(container: Any) -> None:
    with contextlib.suppress(Exception):
        container.remove(force=True)


def _check_channels(runtimes: dict[str, Runtime]) -> list[str]:
    """A measured "channel" row that was served by the plain path would be a lie: say so."""
    notes = []
    for name, rt in runtimes.items():
        info = getattr(rt, "channel_info", None)
        if info is None or "no channel" in name:
            continue
        if info.state != "running" or info.fallbacks:
            notes.append(f"WARNING: {name}: channel {info.state}, {info.fallbacks} fallbacks")
    return notes


# ---------------------------------------------------------------------- exec round trip


async def exec_section(env: Environment) -> tuple[str, list[Row]]:
    n = env.options.n_exec
    container = env.bare_container()
    paramiko_client = env.paramiko_client() if env.ssh_server is not None else None
    try:
        async with opened(env.configs()) as runtimes:
            calls: dict[str, Call] = {
                "raw subprocess.run": lambda: subprocess.run(["true"], check=True),
                "raw subprocess.run, capture_output": lambda: subprocess.run(
                    ["true"], check=True, capture_output=True
                ),
                "docker SDK exec_run": lambda: _exec_run(container),
            }
            if paramiko_client is not None:
                calls["paramiko exec_command"] = lambda: _paramiko_exec(paramiko_client)
            for name, rt in runtimes.items():
                calls[name] = _runtime_true(rt)
            series = await _fast_then_slow(calls, n)
            notes = _check_channels(runtimes)
    finally:
        if paramiko_client is not None:
            paramiko_client.close()
        await anyio.to_thread.run_sync(_remove, container)

    raw = series["raw subprocess.run"]
    captured = series["raw subprocess.run, capture_output"]
    sdk = series["docker SDK exec_run"]
    sub, docker = series["subprocess"], series["docker, channel"]
    rows = [
        Row(
            "subprocess runtime", sub, "raw subprocess.run", raw, "<= 1.3x", _within(sub, raw, 1.3)
        ),
        Row("subprocess runtime", sub, "... with capture_output=True", captured),
        Row(
            "docker, channel",
            docker,
            "raw subprocess.run",
            raw,
            "<= 2.5x",
            _within(docker, raw, 2.5),
        ),
        Row(
            "docker, channel",
            docker,
            "docker SDK exec_run",
            sdk,
            "median <= 3 ms",
            docker.median_ms <= 3,
        ),
        Row("docker, no channel", series["docker, no channel"], "docker SDK exec_run", sdk),
    ]
    if paramiko_client is not None:
        bare = series["paramiko exec_command"]
        label = "paramiko exec_command (TCP_NODELAY)"
        for variant in ("ssh, channel", "ssh, no channel"):
            ours = series[variant]
            rows.append(Row(variant, ours, label, bare, "<= 1.5x", _within(ours, bare, 1.5)))
    for name in (f"{FAKE}, channel", f"{FAKE}, no channel"):
        if name in series:
            rows.append(Row(name, series[name], "raw subprocess.run", raw))
    text = (
        f"Exec round trip of `true` (n={n} each; every runtime's sandbox open at once, calls "
        "sequential). The fast calls (under ~10 ms) are interleaved call by call with each "
        "other, then the slow ones (`exec_run`, the plain Docker and Modal paths) with each "
        "other: a slow call leaves the engine busy for a while, which would tax whatever "
        "call came next.\n\n" + rows_table(rows)
    )
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text, rows


SLOW = ("docker SDK", "sdk ", "docker, no channel", f"{FAKE}, no channel")


async def _fast_then_slow(calls: dict[str, Call], n: int, warmup: int = 5) -> dict[str, Series]:
    slow = {name: call for name, call in calls.items() if name.startswith(SLOW)}
    fast = {name: call for name, call in calls.items() if name not in slow}
    return {**await interleaved(fast, n, warmup), **await interleaved(slow, n, warmup)}


def _runtime_true(rt: Runtime) -> Call:
    async def call() -> None:
        result = await rt.exec(["true"])
        assert result.exit_code == 0, result

    return call


def _exec_run(container: Any) -> None:
    result = container.exec_run(["true"])
    assert result.exit_code == 0, result


def _paramiko_exec(client: Any) -> None:
    _, stdout, stderr = client.exec_command("true")
    stdout.read()
    stderr.read()
    assert stdout.channel.recv_exit_status() == 0


# ---------------------------------------------------------------------- files


async def files_section(env: Environment) -> tuple[str, list[Row]]:
    container = env.bare_container()
    sftp_client = env.paramiko_client() if env.ssh_server is not None else None
    sftp = sftp_client.open_sftp() if sftp_client is not None else None
    local = Path(tempfile.mkdtemp(prefix="vf-bench-files-"))
    rows: list[Row] = []
    try:
        async with opened(env.configs()) as runtimes:
            for size, n in ((KiB, env.options.n_small_file), (10 * MiB, env.options.n_big_file)):
                data = os.urandom(size)
                label = "1 KiB" if size == KiB else "10 MiB"
                calls: dict[str, Call] = {
                    "sdk put": lambda data=data: _put_archive(container, "/tmp", "bench.bin", data),
                    "sdk get": lambda: _get_archive(container, "/tmp/bench.bin"),
                    "local write": lambda data=data: (local / "bench.bin").write_bytes(data),
                    "local read": lambda: (local / "bench.bin").read_bytes(),
                }
                if sftp is not None:
                    calls["sftp put"] = lambda data=data: _sftp_put(sftp, "/tmp/bench.bin", data)
                    calls["sftp get"] = lambda: _sftp_get(sftp, "/tmp/bench.bin")
                for name, rt in runtimes.items():
                    path = f"{rt.workdir}/bench.bin"
                    calls[f"{name} write"] = lambda rt=rt, path=path, data=data: rt.write(
                        path, data
                    )
                    calls[f"{name} read"] = lambda rt=rt, path=path: rt.read(path)
                if size == KiB:
                    series = await _fast_then_slow(calls, n, warmup=2)
                else:
                    series = await interleaved(calls, n, warmup=2)
                rows += _file_rows(series, label, sftp is not None)
            notes = _check_channels(runtimes)
    finally:
        if sftp_client is not None:
            sftp_client.close()
        await anyio.to_thread.run_sync(_remove, container)
        with contextlib.suppress(OSError):
            (local / "bench.bin").unlink()
            local.rmdir()
    text = (
        f"Files: `write` then `read` of 1 KiB (n={env.options.n_small_file}; fast and slow "
        f"calls interleaved separately, as above) and 10 MiB (n={env.options.n_big_file}, all "
        "interleaved). Docker baselines build or extract the tar inside the timed call, as "
        "any client must.\n\n" + rows_table(rows)
    )
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text, rows


def _file_rows(series: dict[str, Series], label: str, with_sftp: bool) -> list[Row]:
    rows = []
    small = label == "1 KiB"
    for op, sdk, local, sftp in (
        ("write", "sdk put", "local write", "sftp put"),
        ("read", "sdk get", "local read", "sftp get"),
    ):
        sdk_name = "put_archive" if op == "write" else "get_archive"
        rows.append(
            Row(f"subprocess {op} {label}", series[f"subprocess {op}"], "local file", series[local])
        )
        for variant in ("channel", "no channel"):
            row = Row(
                f"docker, {variant}: {op} {label}",
                series[f"docker, {variant} {op}"],
                f"docker SDK {sdk_name}",
                series[sdk],
            )
            if small and variant == "channel":
                row.target = "median <= 3 ms"
                row.met = row.ours.median_ms <= 3.0
            rows.append(row)
        if with_sftp:
            for variant in ("channel", "no channel"):
                rows.append(
                    Row(
                        f"ssh, {variant}: {op} {label}",
                        series[f"ssh, {variant} {op}"],
                        "paramiko SFTP",
                        series[sftp],
                    )
                )
        for variant in ("channel", "no channel"):
            name = f"{FAKE}, {variant} {op}"
            if name in series:
                rows.append(Row(f"{FAKE}, {variant}: {op} {label}", series[name], "-", None))
    return rows


def _put_archive(container: Any, directory: str, name: str, data: bytes) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert container.put_archive(directory, buf.getvalue())


def _get_archive(container: Any, path: str) -> bytes:
    stream, _ = container.get_archive(path)
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream)), mode="r:") as tar:
        member = tar.next()
        assert member is not None
        handle = tar.extractfile(member)
        assert handle is not None
        return handle.read()


def _sftp_put(sftp: Any, path: str, data: bytes) -> None:
    with sftp.open(path, "wb") as fh:
        fh.set_pipelined(True)
        fh.write(data)


def _sftp_get(sftp: Any, path: str) -> bytes:
    with sftp.open(path, "rb") as fh:
        fh.prefetch()
        data: bytes = fh.read()
        return data


# ---------------------------------------------------------------------- create to ready


async def create_section(env: Environment) -> tuple[str, list[Row]]:
    n = env.options.n_create
    calls: dict[str, Callable[[], Awaitable[float]]] = {
        "containers.run": lambda: _sdk_create_to_ready(env),
        "raw mkdtemp + subprocess.run": _local_create_to_ready,
    }
    if env.ssh_server is not None:
        calls["paramiko connect"] = lambda: _paramiko_create_to_ready(env)
    for name, config in env.configs().items():
        calls[name] = _runtime_create_to_ready(config)
    series = {name: Series(name) for name in calls}
    for i in range(n + 1):
        for name, call in calls.items():
            elapsed = await call()
            if i:  # the first round warms caches up
                series[name].samples.append(elapsed)
    sdk = series["containers.run"]
    local = series["raw mkdtemp + subprocess.run"]
    docker = series["docker, channel"]
    rows = [
        Row("subprocess runtime", series["subprocess"], "mkdtemp + subprocess.run", local),
        Row(
            "docker, channel",
            docker,
            "SDK containers.run",
            sdk,
            "<= 1.15x",
            _within(docker, sdk, 1.15),
        ),
        Row("docker, no channel", series["docker, no channel"], "SDK containers.run", sdk),
    ]
    if env.ssh_server is not None:
        bare = series["paramiko connect"]
        for variant in ("channel", "no channel"):
            rows.append(Row(f"ssh, {variant}", series[f"ssh, {variant}"], "paramiko", bare))
    for variant in ("channel", "no channel"):
        name = f"{FAKE}, {variant}"
        if name in series:
            rows.append(Row(name, series[name], "-", None))
    text = (
        f"Create-to-ready (n={n} each, interleaved; removal not timed): `start()` then the "
        "first `exec(['true'])` returning, vs `containers.run(image, keep-alive, detach=True)` "
        "then the first `exec_run(['true'])`; ssh: a new connection (key auth, host key "
        "checked) then `exec_command('true')`.\n\n" + rows_table(rows, tail=0.9)
    )
    return text, rows


def _runtime_create_to_ready(config: Any) -> Callable[[], Awaitable[float]]:
    from runtimes import open_runtime

    async def call() -> float:
        rt = open_runtime(config)
        started = time.perf_counter()
        await rt.start()
        try:
            result = await rt.exec(["true"])
            elapsed = time.perf_counter() - started
            assert result.exit_code == 0, result
        finally:
            await rt.close()
        return elapsed

    return call


async def _sdk_create_to_ready(env: Environment) -> float:
    started = time.perf_counter()
    container = env.bare_container()
    try:
        _exec_run(container)
        return time.perf_counter() - started
    finally:
        _remove(container)


async def _local_create_to_ready() -> float:
    started = time.perf_counter()
    directory = tempfile.mkdtemp(prefix="vf-bench-")
    subprocess.run(["true"], cwd=directory, check=True)  # noqa: ASYNC221 - the baseline
    elapsed = time.perf_counter() - started
    os.rmdir(directory)
    return elapsed


async def _paramiko_create_to_ready(env: Environment) -> float:
    started = time.perf_counter()
    client = env.paramiko_client()
    try:
        _paramiko_exec(client)
        return time.perf_counter() - started
    finally:
        client.close()


# ---------------------------------------------------------------------- fleet


@dataclass
class Fleet:
    name: str
    sandboxes: int
    execs: int
    create_s: float
    exec_s: float
    errors: int
    left: int

    @property
    def throughput(self) -> float:
        return self.execs / self.exec_s if self.exec_s else 0.0


async def fleet_section(env: Environment) -> tuple[str, list[Fleet]]:
    size, per = env.options.sandboxes, env.options.execs_per_sandbox
    image = env.options.image
    fleets = [
        await _runtime_fleet(env, "docker, channel", DockerConfig(image=image), size, per),
        await _runtime_fleet(
            env, "docker, no channel", DockerConfig(image=image, channel=False), size, per
        ),
        await _sdk_fleet(env, size, per),
    ]
    base = fleets[-1]
    rows = []
    for fleet in fleets:
        met = None if fleet is base else fleet.errors == 0 and fleet.left == 0
        rows.append(
            [
                fleet.name,
                str(fleet.sandboxes),
                str(fleet.execs),
                f"{fleet.create_s:.2f}",
                f"{fleet.exec_s:.2f}",
                f"{fleet.throughput:.0f}",
                ratio(fleet.throughput, base.throughput) if fleet is not base else "-",
                str(fleet.errors),
                str(fleet.left),
                "0 errors, 0 left" if fleet is not base else "-",
                verdict(met),
            ]
        )
    headers = [
        "variant",
        "sandboxes",
        "execs",
        "create all (s)",
        "exec phase (s)",
        "execs/s",
        "throughput vs SDK",
        "errors",
        "containers left",
        "target",
        "",
    ]
    text = (
        f"Fleet: {size} Docker sandboxes started concurrently, then {per} sequential "
        f"`exec(['echo', i])` in each, all sandboxes at once (output checked), then all closed; "
        "`containers left` counts this run's containers still present afterwards. Creation "
        "pacing (`creations_per_second`) is off for the runtimes; the SDK baseline does the "
        "same with `containers.run` / `exec_run` / `remove` from 32 threads.\n\n"
        + table(headers, rows)
    )
    return text, fleets


async def _runtime_fleet(
    env: Environment, name: str, config: DockerConfig, size: int, per: int
) -> Fleet:
    config = config.model_copy(update={"creations_per_second": None, "max_live": 256})
    runtimes = [DockerRuntime(config) for _ in range(size)]
    errors = 0
    ids: list[str] = []

    async def start(rt: DockerRuntime) -> None:
        nonlocal errors
        try:
            await rt.start()
        except Exception:  # noqa: BLE001 - counted
            errors += 1

    async def work(rt: DockerRuntime) -> None:
        nonlocal errors
        for i in range(per):
            try:
                result = await rt.exec(["echo", str(i)])
                if result.stdout != f"{i}\n":
                    errors += 1
            except Exception:  # noqa: BLE001 - counted
                errors += 1

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for rt in runtimes:
            tg.start_soon(start, rt)
    created = time.perf_counter()
    ids = [rt.sandbox_id for rt in runtimes if rt.sandbox_id]
    async with anyio.create_task_group() as tg:
        for rt in runtimes:
            if not rt.closed:
                tg.start_soon(work, rt)
    worked = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for rt in runtimes:
            tg.start_soon(rt.close)
    left = await anyio.to_thread.run_sync(_still_there, env.client, ids)
    return Fleet(name, size, size * per, created - started, worked - created, errors, left)


async def _sdk_fleet(env: Environment, size: int, per: int) -> Fleet:
    limiter = anyio.CapacityLimiter(size)
    containers: list[Any] = []
    errors = 0

    def work(container: Any) -> None:
        nonlocal errors
        for i in range(per):
            result = container.exec_run(["echo", str(i)])
            if result.exit_code != 0 or result.output != f"{i}\n".encode():
                errors += 1

    async def create() -> None:
        containers.append(await anyio.to_thread.run_sync(env.bare_container, limiter=limiter))

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(size):
            tg.start_soon(create)
    created = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for container in containers:
            tg.start_soon(lambda c=container: anyio.to_thread.run_sync(work, c, limiter=limiter))
    worked = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for container in containers:
            tg.start_soon(lambda c=container: anyio.to_thread.run_sync(_remove, c, limiter=limiter))
    left = await anyio.to_thread.run_sync(_still_there, env.client, [c.id for c in containers])
    return Fleet(
        "docker SDK alone (baseline)",
        size,
        size * per,
        created - started,
        worked - created,
        errors,
        left,
    )


def _still_there(client: Any, ids: list[str]) -> int:
    import docker.errors

    left = 0
    for cid in ids:
        try:
            client.containers.get(cid)
        except docker.errors.NotFound:
            continue
        left += 1
    return left


# ---------------------------------------------------------------------- judge placement


async def placement_section(env: Environment) -> tuple[str, list[Row]]:
    from harnesses.base import Trace
    from placement.inputs import JudgeInputs, materialise, new_agent_id

    rollout = Path(__file__).resolve().parent.parent / "examples" / "rollout"
    task = json.loads((rollout / "task.json").read_text())
    trace = Trace.model_validate_json((rollout / "trace.json").read_text())
    snapshot = JudgeInputs.take(task, trace)
    verdict_bytes = json.dumps({"score": 1.0, "reason": "benchmark"}).encode()
    n = env.options.n_placement
    configs = {k: v for k, v in env.configs().items() if not k.startswith(FAKE)}
    rows: list[Row] = []
    async with opened(configs) as runtimes:
        for name, rt in runtimes.items():
            placed, bare = Series(name), Series("bare")
            for i in range(n + 2):
                directory = ""

                async def place(rt: Runtime = rt) -> None:
                    nonlocal directory
                    directory = await materialise(rt, new_agent_id("bench"), snapshot)

                spent = await timed(place)
                await rt.write(f"{directory}/verdict.json", verdict_bytes)
                spent += await timed(lambda d=directory, rt=rt: rt.read(f"{d}/verdict.json"))
                await rt.remove(directory)
                plain_dir = f"/tmp/vf-bench-bare/{i}"

                async def write_all(rt: Runtime = rt, plain_dir: str = plain_dir) -> None:
                    for file_name, data in snapshot.files().items():
                        await rt.write(f"{plain_dir}/{file_name}", data)

                base = await timed(write_all)
                await rt.write(f"{plain_dir}/verdict.json", verdict_bytes)
                base += await timed(lambda d=plain_dir, rt=rt: rt.read(f"{d}/verdict.json"))
                await rt.remove(plain_dir)
                if i >= 2:  # warm-up
                    placed.samples.append(spent)
                    bare.samples.append(base)
            rows.append(Row(name, placed, "bare write x3 + read", bare))
    sizes = ", ".join(f"{k} {len(v)} B" for k, v in snapshot.files().items())
    text = (
        f"Judge placement overhead (n={n}): `placement.inputs.materialise` (prepare exec, "
        f"three writes, verify exec) + reading `verdict.json`, vs bare writes of the same "
        f"three files ({sizes}) + the same read, in the same sandbox.\n\n"
        + rows_table(rows, tail=0.9)
    )
    return text, rows


# ---------------------------------------------------------------------- model proxy


async def proxy_section(env: Environment) -> str:
    from .proxy_latency import measure

    turns = env.options.proxy_turns
    direct, proxied = await anyio.to_thread.run_sync(measure, turns)
    rows = [Row("through the proxy", Series("p", proxied), "direct", Series("d", direct))]
    text = (
        f"Model proxy: one chat turn against a local scripted endpoint, direct vs through the "
        f"recording proxy (n={turns}, interleaved; `benchmarks.proxy_latency`).\n\n"
        + rows_table(rows, tail=0.9)
    )
    return text + "\n\n" + await proxy_routes_section(env)


async def proxy_routes_section(env: Environment) -> str:
    """A proxied turn from inside a container: the channel relay (``network="none"``)
    against the bridge's gateway and against a direct host call, in the same run."""
    from .proxy_routes import ROUNDS, measure

    turns = env.options.proxy_turns
    series = await measure(turns, env.options.image)
    channel = Series("channel", series["channel"])
    bridge = Series("bridge", series["bridge"])
    direct = Series("direct", series["direct"])
    added = channel.median_ms - direct.median_ms
    rows = [
        Row(
            "network=none, channel relay, proxy",
            channel,
            "network=bridge, gateway, proxy",
            bridge,
            "<= 2x",
            channel.median_ms <= 2 * bridge.median_ms,
        ),
        Row(
            "network=none, channel relay, proxy",
            channel,
            "host, direct to the endpoint",
            direct,
            f"<= +3 ms (+{added:.2f})",
            added <= 3.0,
        ),
        Row("network=bridge, gateway, proxy", bridge, "host, direct to the endpoint", direct),
    ]
    return (
        f"Proxied model turn from inside a Docker container (`{env.options.image}`), one "
        f"keep-alive `http.client` connection, n={turns} per path in {ROUNDS} interleaved rounds "
        "(`benchmarks.proxy_routes`): through the channel relay with no network, through the "
        "bridge's gateway, and a direct host call to the scripted endpoint (no proxy).\n\n"
        + rows_table(rows, tail=0.9)
    )


async def run(options: Options) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Every selected section: (machine description, [(title, markdown)])."""
    sections: list[tuple[str, str]] = []
    with Environment(options) as env:
        about = [("Docker", env.docker_version())]
        wanted = options.sections
        if "exec" in wanted:
            sections.append(("Exec round trip", (await exec_section(env))[0]))
        if "files" in wanted:
            sections.append(("Files", (await files_section(env))[0]))
        if "create" in wanted:
            sections.append(("Create-to-ready", (await create_section(env))[0]))
        if "fleet" in wanted:
            sections.append(("Concurrent sandboxes", (await fleet_section(env))[0]))
        if "placement" in wanted:
            sections.append(("Judge placement", (await placement_section(env))[0]))
        if "proxy" in wanted:
            sections.append(("Model proxy", await proxy_section(env)))
        if "stream" in wanted:
            from .streaming import stream_section

            sections.append(("Streamed exec: first chunk", (await stream_section(env))[0]))
        if "shell" in wanted:
            from .sessions import shell_section

            sections.append(("Shell sessions", (await shell_section(env))[0]))
        if "inspect" in wanted:
            from .inspect_sandbox import inspect_section

            sections.append(("inspect_ai sandboxes", (await inspect_section(env))[0]))
        if "fork" in wanted:
            from .snapshots import fork_section

            sections.append(("Forks from snapshots", (await fork_section(env))[0]))
        if "pool" in wanted:
            from .pool import pool_section

            sections.append(("Warm pools", (await pool_section(env))[0]))
        if "scale" in wanted:
            from .scale import scale_section

            counts = (8,) if options.quick_scale else DEFAULT_SCALE_COUNTS
            sections.append(("Idle sandboxes at scale", await scale_section(counts, options.image)))
        if "embedded" in wanted:
            from .embedded import embedded_section

            sections.append(("The embedded default", (await embedded_section(env))[0]))
        if "ray" in wanted:
            from .ray import ray_section

            sections.append(("Ray", (await ray_section(env))[0]))
    return about, sections
