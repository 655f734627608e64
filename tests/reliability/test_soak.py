"""Soak: the three local backends in one process under a CPU and I/O background load,
thousands of mixed calls, cancellations and closes; 0 hangs, 0 untyped errors, 0 leaks.

Per backend (subprocess, docker, ssh) :data:`SANDBOXES` sandboxes are open for the whole
soak, each worked by a task that draws operations from a seeded generator: exec with output
and with stdin (every byte checked), exec whose ``timeout=`` expires (``ExecTimeoutError``,
its process gone), exec cancelled from outside at a random point (its process gone),
write / read / exists, upload then download of a small tree, ``spawn`` then ``kill()`` or
``stop_processes()``, and now and then a close and reopen of the sandbox. One more task per
backend churns: it opens a sandbox, uses it and closes it, or closes it while calls are in
flight on it (those calls return or raise a ``SandboxError``; afterwards the sandbox answers
``SandboxUnavailableError`` and nothing it ran is left). Meanwhile ``stress-ng`` loads both
cores and the disk.

Every operation runs under a watchdog of :data:`WATCHDOG` seconds: a hang fails the test
naming the operation, the backend and the seed. Anything raised that the operation does not
expect is recorded with its type and fails the test at the end, with a table of all of them.
At the end: no container of the soak left, no process of it left anywhere on the machine
(every command it ran carries the soak's token), no SSH session left on the server, and this
process's descriptors and threads back where they were before the soak.

``VF_SOAK_SEED`` replays a seed (the run prints its own), ``VF_SOAK_OPS`` sets the number of
operations (:data:`OPS`): docs/reliability.md.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import ExecResult, Runtime, drain_removals, open_runtime, reaper
from runtimes.docker.client import close_idle_connections
from runtimes.errors import ExecTimeoutError, SandboxError, SandboxUnavailableError
from tests.processes import running_anywhere
from tests.ssh.sshd import SSHServer

from .conftest import TABLES, TALLY, session_containers, settle_host

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.ssh]

OPS = int(os.environ.get("VF_SOAK_OPS", "3000"))
"""Operations in all, over the three backends (``VF_SOAK_OPS`` overrides)."""
SANDBOXES = 3
"""Sandboxes per backend open for the whole soak (plus one churning)."""
WATCHDOG = 90.0
"""Seconds any one operation may take before it counts as a hang."""
EXEC_TIMEOUT = 60.0
"""``timeout=`` of the execs that should finish: under the watchdog, so a stuck command is
an ``ExecTimeoutError`` (recorded as unexpected), not a hang."""
GONE_WITHIN = 20.0
"""Seconds a killed command's processes may take to disappear from the machine."""
LOAD = ["stress-ng", "--cpu", "2", "--cpu-load", "60", "--io", "1", "--timeout", "1800s"]
"""The background load: both cores at 60 %, one worker spinning on sync()."""

WEIGHTS = {
    "exec_out": 18,
    "exec_stdin": 18,
    "exec_timeout": 6,
    "exec_cancel": 14,
    "files": 18,
    "tree": 5,
    "spawn_kill": 6,
    "spawn_stop": 3,
    "reopen": 1,
}
CHURN_WEIGHTS = {"churn": 2, "close_in_flight": 3}


# ---------------------------------------------------------------------- bookkeeping


@dataclass
class Failure:
    backend: str
    op: str
    kind: str
    detail: str


@dataclass
class Soak:
    seed: int
    base: str
    """The token every command of the soak carries: ``sleep <base><n>`` is findable."""
    left: int
    scratch: Path
    latencies: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    typed: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    serial: int = 0

    def token(self) -> str:
        self.serial += 1
        return f"{self.base}{self.serial:05d}"

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True

    def expected(self, backend: str, exc: BaseException) -> None:
        self.typed[(backend, type(exc).__name__)] += 1

    async def run(self, backend: str, op: str, call: Callable[[], Awaitable[None]]) -> bool:
        """Run one operation under the watchdog; record its time or what went wrong."""
        started = time.monotonic()
        try:
            with anyio.fail_after(WATCHDOG) as scope:
                await call()
        except TimeoutError as exc:
            if type(exc) is TimeoutError and scope.cancel_called:
                self.fail(backend, op, "HANG", f"no answer within {WATCHDOG:g}s")
            else:
                self.fail(backend, op, type(exc).__name__, str(exc))
            return False
        except AssertionError as exc:
            self.fail(backend, op, "wrong result", str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - recorded, fails the test at the end
            self.fail(backend, op, _qualified(exc), str(exc))
            return False
        self.latencies.setdefault((backend, op), []).append(time.monotonic() - started)
        return True

    def fail(self, backend: str, op: str, kind: str, detail: str) -> None:
        self.failures.append(Failure(backend, op, kind, detail[:300]))


def _qualified(exc: BaseException) -> str:
    kind = type(exc)
    return kind.__name__ if kind.__module__.startswith("runtimes") else repr(kind)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


# ---------------------------------------------------------------------- the load


@contextmanager
def background_load() -> Iterator[subprocess.Popen[bytes]]:
    """``stress-ng`` (:data:`LOAD`) as a child of this test, killed (its whole group) at the end."""
    if shutil.which("stress-ng") is None:
        pytest.fail("stress-ng is missing: `make test` installs it (apt-get install stress-ng)")
    with tempfile.TemporaryDirectory(prefix="vf-soak-load-") as where:
        proc = subprocess.Popen(
            [*LOAD, "--temp-path", where],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=15)


# ---------------------------------------------------------------------- operations


async def gone(token: str, within: float = GONE_WITHIN) -> None:
    """Every process naming ``token`` is gone from the machine within ``within`` seconds."""
    left: list[str] = []
    with anyio.move_on_after(within):
        while left := await anyio.to_thread.run_sync(running_anywhere, token):  # noqa: ASYNC110
            await anyio.sleep(0.2)
    assert not left, f"processes left running {within:g}s after their kill: {left}"


async def exec_out(soak: Soak, backend: str, rt: Runtime, rng: random.Random) -> None:
    word = rng.randbytes(rng.randrange(1, 64)).hex()
    result = await rt.exec(["printf", "%s\\n", word, word], timeout=EXEC_TIMEOUT)
    assert result.exit_code == 0, result
    assert result.stdout_bytes == f"{word}\n{word}\n".encode(), result
    assert result.stderr_bytes == b"", result


async def exec_stdin(soak: Soak, backend: str, rt: Runtime, rng: random.Random) -> None:
    data = rng.randbytes(rng.choice([0, 1, 4096, 65_537, rng.randrange(512 << 10)]))
    result = await rt.exec(["cat"], stdin=data, timeout=EXEC_TIMEOUT)
    assert result.exit_code == 0, result
    assert result.stdout_bytes == data, f"stdin came back corrupted ({len(data)} bytes)"


async def exec_timeout(soak: Soak, backend: str, rt: Runtime, rng: random.Random) -> None:
    mark = soak.token()
    timeout = rng.uniform(0.2, 1.5)
    try:
        result = await rt.exec(["sh", "-c", f"sleep {mark} & sleep {mark}"], timeout=timeout)
    except ExecTimeoutError as exc:
        soak.expected(backend, exc)
    else:
        raise AssertionError(f"exec(timeout={timeout:.2f}) of a sleep returned {result!r}")
    await gone(mark)


async def exec_cancel(soak: Soak, backend: str, rt: Runtime, rng: random.Random) -> None:
    mark = soak.token()
    kind = rng.randrange(3)
    argv = [
        ["sh", "-c", f"sleep {mark} & sleep {mark}; wait"],
        ["sh", "-c", f"sleep {mark} & cat >/dev/null; sleep {mark}"],
        ["sh", "-c", f"sleep {mark} & while :; do echo line; done"],
    ][kind]
    stdin = b"x" * (1 << 20) if kind == 1 else None
    with anyio.move_on_after(rng.uniform(0.0, 0.8)) as scope:
        await rt.exec(argv, stdin=stdin, timeout=EXEC_TIMEOUT, output_limit=1 << 30)
    assert scope.cancelled_caught, "a command that never ends returned"
    await gone(mark)


async def files(soak: Soak, backend: str, rt: Runtime, rng: random.Random) -> None:
    path = f"soak/{rng.randrange(8)}/{soak.token()}.bin"
    data = rng.randbytes(rng.choice([0, 1, 1000, rng.randrange(256 << 10)]))
    assert not await rt.exists(path), path
    await rt.write(path, data)
    assert await rt.exists(path), path
    assert await rt.read(path) == data, f"{path} read back corrupted ({len(data)} bytes)"
    await rt.remove(path)


async def tree(soak: Soak, backend: str, rt: Runtime, rng: random.Random) -> None:
    name = soak.token()
    local = soak.scratch / f"up-{name}"
    wanted: dict[str, bytes] = {}
    for n in range(rng.randrange(1, 6)):
        rel = f"d{n % 2}/f{n}.bin" if n else "top.txt"
        wanted[rel] = rng.randbytes(rng.randrange(4096))
        (local / rel).parent.mkdir(parents=True, exist_ok=True)
        (local / rel).write_bytes(wanted[rel])
    await rt.upload(local, f"trees/{name}")
    back = soak.scratch / f"down-{name}"
    await rt.download(f"trees/{name}", back)
    got = {str(p.relative_to(back)): p.read_bytes() for p in back.rglob("*") if p.is_file()}
    assert got == wanted, f"tree {name} came back different: {sorted(got)} != {sorted(wanted)}"
    shutil.rmtree(local)
    shutil.rmtree(back)


async def spawn_kill(soak: Soak, backend: str, rt: Runtime, rng: random.Random) -> None:
    mark = soak.token()
    proc = await rt.spawn(["sh", "-c", f"echo ready; sleep {mark} & sleep {mark}"])
    await anyio.sleep(rng.uniform(0.0, 0.5))
    await proc.kill()
    result = await proc.wait(timeout=EXEC_TIMEOUT)
    assert result.exit_code == 137, result
    assert proc not in rt.processes()
    await gone(mark)


async def spawn_stop(soak: Soak, backend: str, rt: Runtime, rng: random.Random) -> None:
    mark = soak.token()
    proc = await rt.spawn(["sh", "-c", f"sleep {mark} & sleep {mark}"])
    await anyio.sleep(rng.uniform(0.1, 0.5))
    stopped = await rt.stop_processes()
    result = await proc.wait(timeout=EXEC_TIMEOUT)
    assert stopped >= 1 and result.exit_code == 137, (stopped, result)
    await gone(mark)


OPERATIONS: dict[str, Callable[[Soak, str, Runtime, random.Random], Awaitable[None]]] = {
    "exec_out": exec_out,
    "exec_stdin": exec_stdin,
    "exec_timeout": exec_timeout,
    "exec_cancel": exec_cancel,
    "files": files,
    "tree": tree,
    "spawn_kill": spawn_kill,
    "spawn_stop": spawn_stop,
}


async def close_in_flight(soak: Soak, backend: str, config: Any, rng: random.Random) -> None:
    """Open a sandbox, start calls on it, close it under them: each call returns or raises a
    ``SandboxError``; afterwards the sandbox is unavailable and nothing it ran is left."""
    mark = soak.token()
    rt = await open_runtime(config).start()
    outcomes: list[str] = []

    async def call(what: str, run: Callable[[], Awaitable[object]]) -> None:
        try:
            result = await run()
        except SandboxError as exc:
            if type(exc) is SandboxError:  # the wrapper of "failed unexpectedly": untyped
                soak.fail(backend, f"close_in_flight/{what}", "SandboxError", str(exc))
            soak.expected(backend, exc)
            outcomes.append(type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 - recorded, fails the test at the end
            soak.fail(backend, f"close_in_flight/{what}", _qualified(exc), repr(exc))
            outcomes.append(type(exc).__name__)
        else:
            # The command killed by close() may report its death instead (subprocess: 137).
            if isinstance(result, ExecResult) and what in ("sleep", "stdin"):
                if result.exit_code < 128:
                    detail = f"a command that never ends returned {result.exit_code}"
                    soak.fail(backend, f"close_in_flight/{what}", "wrong result", detail)
                soak.typed[(backend, f"killed by close ({result.exit_code})")] += 1
            outcomes.append("returned")

    data = rng.randbytes(rng.randrange(1 << 20))
    calls: dict[str, Callable[[], Awaitable[object]]] = {
        "sleep": lambda: rt.exec(["sh", "-c", f"sleep {mark} & sleep {mark}"], timeout=60),
        "stdin": lambda: rt.exec(
            ["sh", "-c", f"cat >/dev/null; sleep {mark}"], stdin=data, timeout=60
        ),
        "write": lambda: rt.write("in-flight.bin", data),
        "read": lambda: rt.read("in-flight.bin"),
        "list": lambda: rt.exists("in-flight.bin"),
    }
    try:
        async with anyio.create_task_group() as tg:
            for what, run in calls.items():
                tg.start_soon(call, what, run)
            await anyio.sleep(rng.uniform(0.0, 0.6))
            await rt.close()
    finally:
        await rt.close()
    assert len(outcomes) == len(calls), outcomes
    try:
        await rt.exec(["true"])
    except SandboxUnavailableError as exc:
        soak.expected(backend, exc)
    else:
        raise AssertionError("exec on a closed sandbox returned")
    await gone(mark)


async def churn(soak: Soak, backend: str, config: Any, rng: random.Random) -> None:
    async with open_runtime(config) as rt:
        await exec_out(soak, backend, rt, rng)
        if rng.randrange(2):
            await files(soak, backend, rt, rng)


# ---------------------------------------------------------------------- workers


async def worker(
    soak: Soak, backend: str, config: Any, slot: list[Runtime], rng: random.Random
) -> None:
    kinds = list(WEIGHTS)
    weights = list(WEIGHTS.values())
    while soak.take():
        op = rng.choices(kinds, weights)[0]
        op_rng = random.Random(rng.random())
        if op == "reopen":

            async def reopen() -> None:
                await slot[0].close()
                slot[0] = await open_runtime(config).start()

            await soak.run(backend, op, reopen)
            if slot[0].closed:  # the reopen failed: the failure is recorded; carry on
                slot[0] = await open_runtime(config).start()
            continue
        await soak.run(backend, op, partial(OPERATIONS[op], soak, backend, slot[0], op_rng))


async def churner(soak: Soak, backend: str, config: Any, rng: random.Random) -> None:
    kinds = list(CHURN_WEIGHTS)
    weights = list(CHURN_WEIGHTS.values())
    # A pause between its operations: each opens and closes a sandbox, the heaviest calls.
    while soak.take():
        op = rng.choices(kinds, weights)[0]
        op_rng = random.Random(rng.random())
        run = close_in_flight if op == "close_in_flight" else churn
        await soak.run(backend, op, partial(run, soak, backend, config, op_rng))
        await anyio.sleep(rng.uniform(0.5, 2.0))


# ---------------------------------------------------------------------- leaks


def sshd_sessions(server: SSHServer) -> list[str]:
    """sshd's per-connection processes on the server (the listener itself left out)."""
    out = server.docker_exec("ps -eo args")
    return [
        line for line in out.splitlines() if line.startswith("sshd:") and "listener" not in line
    ]


def fd_targets() -> list[str]:
    """What this process's descriptors are (``socket:``, ``pipe:``, a path), inode numbers cut."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}").split("[")[0])
        except OSError:  # the listing's own descriptor, closed already
            continue
    return found


def thread_names() -> list[str]:
    return [t.name.rstrip("0123456789") for t in threading.enumerate()]


REAPER = "vf-sandbox-reaper-"


def thread_count() -> int:
    """Threads, less the reaper's: up to ``WORKERS`` daemon threads it keeps idle for the
    next removal, for the process's life (runtimes/reaper.py)."""
    return len([t for t in threading.enumerate() if not t.name.startswith(REAPER)])


async def quiet_host() -> tuple[int, int]:
    """Descriptors and threads once removals are done, the engine connections kept for reuse
    closed and anyio's idle worker threads gone (pruned after 10 s idle)."""
    await drain_removals()
    close_idle_connections()
    fds, _ = await settle_host(0, 0, within=12)
    assert len(threading.enumerate()) - thread_count() <= reaper.WORKERS
    return fds, thread_count()


# ---------------------------------------------------------------------- the soak


async def test_soak_three_backends_under_load(
    shared_sshd: SSHServer, docker_client: Any, tmp_path: Path
) -> None:
    seed = int(os.environ.get("VF_SOAK_SEED", str(random.randrange(10**9))))
    rng = random.Random(seed)
    base = f"{rng.randrange(100, 999)}.{rng.randrange(10**6, 10**7)}"
    soak = Soak(seed=seed, base=base, left=OPS, scratch=tmp_path)
    where = f"seed {seed} (replay: VF_SOAK_SEED={seed})"
    print(f"\nsoak: {OPS} operations, {SANDBOXES} sandboxes per backend + churn, {where}")
    configs: dict[str, Any] = {
        "subprocess": {"type": "subprocess"},
        "docker": {"type": "docker"},
        "ssh": shared_sshd.config(),
    }
    containers_before = {c.id for c in session_containers(docker_client)}
    sessions_before = await anyio.to_thread.run_sync(sshd_sessions, shared_sshd)
    # Warm-up: each backend's process-wide pieces exist (the engine client, a channel's code,
    # the subprocess runtime's watch on the mount table, opened by its first file operation:
    # counted as a leak when no test before the soak in this process had made one).
    for config in configs.values():
        async with open_runtime(config) as rt:
            await rt.exec(["true"], timeout=EXEC_TIMEOUT)
            await rt.write("warm-up.txt", b"warm")
            assert await rt.read("warm-up.txt") == b"warm"
    fds_before, threads_before = await quiet_host()
    handles_before = Counter(fd_targets()), Counter(thread_names())

    started = time.monotonic()
    with background_load():
        slots: dict[str, list[list[Runtime]]] = {name: [] for name in configs}

        async def open_slot(name: str) -> None:
            slots[name].append([await open_runtime(configs[name]).start()])

        try:
            with anyio.fail_after(120):
                async with anyio.create_task_group() as tg:
                    for name in configs:
                        for _ in range(SANDBOXES):
                            tg.start_soon(open_slot, name)
            async with anyio.create_task_group() as tg:
                for name, config in configs.items():
                    for slot in slots[name]:
                        tg.start_soon(worker, soak, name, config, slot, random.Random(rng.random()))
                    tg.start_soon(churner, soak, name, config, random.Random(rng.random()))
        finally:
            with anyio.CancelScope(shield=True):
                for name in configs:
                    for slot in slots[name]:
                        await slot[0].close()
    seconds = time.monotonic() - started

    # Leaks: containers, processes, SSH sessions, descriptors and threads.
    fds_after, threads_after = await quiet_host()
    leaks: list[str] = []
    left = [c.name for c in session_containers(docker_client) if c.id not in containers_before]
    if left:
        leaks.append(f"containers left: {left}")
    if procs := await anyio.to_thread.run_sync(running_anywhere, f"sleep {base}"):
        leaks.append(f"processes left: {procs}")
    sessions_after: list[str] = []
    with anyio.move_on_after(10):  # sshd notices a closed connection a moment later
        while True:
            sessions_after = await anyio.to_thread.run_sync(sshd_sessions, shared_sshd)
            if len(sessions_after) <= len(sessions_before):
                break
            await anyio.sleep(0.25)
    if len(sessions_after) > len(sessions_before):
        leaks.append(f"ssh sessions left on the server: {sessions_before} -> {sessions_after}")
    if fds_after > fds_before:
        extra = Counter(fd_targets()) - handles_before[0]
        leaks.append(f"file descriptors: {fds_before} -> {fds_after}: {dict(extra)}")
    if threads_after > threads_before:
        extra = Counter(thread_names()) - handles_before[1]
        leaks.append(f"threads: {threads_before} -> {threads_after}: {dict(extra)}")

    done = sum(len(v) for v in soak.latencies.values())
    table = _table(soak, seconds, (fds_before, fds_after), (threads_before, threads_after))
    TABLES["reliability soak"] = table
    print("\n".join(table))
    TALLY.add("soak: operations", done + len(soak.failures))
    TALLY.add("soak: failures", len(soak.failures))
    problems = [f"{f.backend} {f.op}: {f.kind}: {f.detail}" for f in soak.failures] + leaks
    assert not problems, f"soak, {where}:\n" + "\n".join(problems)


def _table(soak: Soak, seconds: float, fds: tuple[int, int], threads: tuple[int, int]) -> list[str]:
    lines = [
        f"soak: seed {soak.seed}, {OPS - soak.left} operations in {seconds:.1f}s under "
        f"`{' '.join(LOAD)}`; fds {fds[0]}->{fds[1]}, threads {threads[0]}->{threads[1]}",
        f"{'backend':<11}{'operation':<16}{'done':>6}{'p50 ms':>9}{'p99 ms':>9}",
    ]
    for (backend, op), values in sorted(soak.latencies.items()):
        lines.append(
            f"{backend:<11}{op:<16}{len(values):>6}{statistics.median(values) * 1000:>9.0f}"
            f"{_pct(values, 0.99):>9.0f}"
        )
    typed = ", ".join(f"{b} {k} {n}" for (b, k), n in sorted(soak.typed.items()))
    lines.append(f"typed errors (expected): {typed or 'none'}")
    failed = Counter((f.backend, f.op, f.kind) for f in soak.failures)
    lines.append(f"failures: {len(soak.failures)}")
    lines.extend(f"  {b} {op}: {kind} x{n}" for (b, op, kind), n in sorted(failed.items()))
    return lines
