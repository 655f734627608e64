"""Fixtures of the gated-session tests: backends, a scripted trainer, leak checks."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest

from harnesses.session import (
    AgentSession,
    Completion,
    InterceptedRequest,
    SyncAgentSession,
    call,
)
from runtimes import Runtime, live_runtimes
from runtimes.channel.agent.procs import dying
from runtimes.reaper import wait_for_removals_blocking

PYTHON_IMAGE = "vf-sandbox/python:latest"
SUBPROCESS = {"type": "subprocess"}
DOCKER = {"type": "docker", "image": PYTHON_IMAGE}  # network="none": the channel relay

BACKENDS = [
    pytest.param(SUBPROCESS, id="subprocess"),
    pytest.param(DOCKER, id="docker", marks=pytest.mark.docker),
]

# Threads that outlive a session by design: the idle worker-thread pools of anyio and trio.
_POOLED_THREADS = ("AnyIO worker thread", "Trio thread", "vf-sandbox-reaper")
"""Process-wide worker threads, bounded in number and reused (the reaper: runtimes/reaper.py)."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    return dict(request.param)


def bash(command: str, **extra: Any) -> Completion:
    """A completion calling the bash tool."""
    return Completion(tool_calls=[call("bash", {"command": command})], **extra)


class ScriptedTrainer:
    """Stands in for a trainer's generator: canned completions, every request kept."""

    def __init__(self, script: Sequence[Completion | str]):
        self.script = list(script)
        self.requests: list[InterceptedRequest] = []
        self.delivered: list[Completion] = []

    def generate(self, request: InterceptedRequest) -> Completion:
        self.requests.append(request)
        item = self.script[len(self.delivered)]
        completion = item if isinstance(item, Completion) else Completion(content=item)
        self.delivered.append(completion)
        return completion

    async def drive(self, session: AgentSession) -> None:
        """Answer every request until the agent exits."""
        while (request := await session.next_request(timeout=60)) is not None:
            await session.deliver(request, self.generate(request))

    def drive_sync(self, session: SyncAgentSession) -> None:
        while (request := session.next_request(timeout=60)) is not None:
            session.deliver(request, self.generate(request))


def _extra_threads(before: set[int | None]) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.ident not in before and t.is_alive() and not t.name.startswith(_POOLED_THREADS)
    ]


def wait_for_no_extra_threads(before: set[int | None], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while _extra_threads(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    leftover = [t.name for t in _extra_threads(before)]
    assert leftover == [], f"threads left running: {leftover}"


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@asynccontextmanager
async def no_leaks() -> AsyncIterator[None]:
    """Asserts that whatever runs inside leaves no thread, task or open runtime behind."""
    threads = {t.ident for t in threading.enumerate()}
    runtimes = set(map(id, live_runtimes()))
    asyncio_tasks = set(asyncio.all_tasks()) if _on_asyncio() else set()
    yield
    assert [rt.describe() for rt in live_runtimes() if id(rt) not in runtimes] == []
    if _on_asyncio():
        await asyncio.sleep(0)
        extra = [t for t in asyncio.all_tasks() if t not in asyncio_tasks and not t.done()]
        assert extra == [], f"tasks left running: {extra}"
    wait_for_no_extra_threads(threads)


def _host_commands(marker: str) -> Iterator[tuple[int, str]]:
    """(pid, command line) of each host process whose command line contains ``marker``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                line = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            continue  # gone meanwhile
        if marker in line:
            yield int(entry), line


def host_processes(marker: str) -> list[str]:
    """Command lines of host processes containing ``marker`` that may still run: one with a
    ``SIGKILL`` pending or already exiting never runs another instruction of its own (on a
    loaded machine it may wait a while to be scheduled and die), so it is not counted."""
    return [line for pid, line in _host_commands(marker) if not dying(pid)]


def described(marker: str) -> str:
    """What /proc says of each host process containing ``marker`` (an assertion's message)."""
    lines = []
    keep = ("State", "PPid", "SigPnd", "ShdPnd", "SigBlk", "NSpid")
    for pid, _ in _host_commands(marker):
        try:
            with open(f"/proc/{pid}/status") as fh:
                status = [line.strip() for line in fh if line.startswith(keep)]
        except OSError:
            continue  # gone meanwhile
        lines.append(f"{pid}: {', '.join(status)} (dying: {dying(pid)})")
    return "\n".join(lines)


async def sandbox_processes(session: AgentSession, marker: str) -> list[str]:
    """Command lines of processes in the session's sandbox containing ``marker``."""
    listing = await session.runtime.exec(["ps", "-eo", "args"], timeout=30)
    assert listing.exit_code == 0, listing.stderr
    return [line for line in listing.stdout.splitlines() if marker in line and "ps -eo" not in line]


async def kill_sandbox(session: AgentSession) -> None:
    """The session's sandbox dies: its container is killed (Docker), or the local sandbox
    is closed under it (subprocess, which has nothing else to die)."""
    await kill_runtime(session.runtime)


async def kill_runtime(runtime: Runtime) -> None:
    """The sandbox dies: its container is killed (Docker), or it is closed (subprocess)."""
    if runtime.config.type != "docker":
        await runtime.close()
        return
    import docker

    client = docker.from_env()
    try:
        client.containers.get(str(runtime.sandbox_id)).kill()
    finally:
        client.close()


def containers_of(rollout_id: str) -> list[str]:
    """Docker containers (any state) labelled with this rollout id, once the removals of
    closed sandboxes have run."""
    import docker

    wait_for_removals_blocking()
    client = docker.from_env()
    try:
        found = client.containers.list(
            all=True, filters={"label": f"vf-sandbox.rollout={rollout_id}"}
        )
        return [str(c.id) for c in found]
    finally:
        client.close()


@pytest.fixture
def unique() -> Iterator[Callable[[str], str]]:
    """Unique rollout ids per test (docker label filters must not see other tests)."""
    counter = iter(range(1_000_000))
    stamp = f"{int(time.time() * 1000) % 10_000_000}"

    def make(prefix: str) -> str:
        return f"{prefix}-{stamp}-{next(counter)}"

    yield make
