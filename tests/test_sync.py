"""The blocking facade (:mod:`runtimes.sync`): the whole Runtime API for synchronous code.

Most checks share one subprocess sandbox; the ones about lifecycle (close, exit, Ctrl-C)
open their own, the exit and interrupt ones in a child interpreter as a user's script
would. One Docker test proves the exit backstop removes a container and that a backend's
own coroutine method (``host_port``) is reachable through the facade.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from runtimes import (
    ExecTimeoutError,
    OutputLimitExceededError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxUnavailableError,
    ShellSessionError,
    SyncRuntime,
    SyncShellSession,
    open_runtime_sync,
)
from runtimes.lifecycle import State, live_runtimes
from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, require_docker_image
from runtimes.sync import BlockingCallInEventLoopError, SyncHostRoute
from tests.cli.cli import ctrl_c_as_at_a_terminal

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs" / "sync.md"


def _config(root: Path) -> dict[str, Any]:
    return {"type": "subprocess", "root": str(root)}


def _portal_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("vf-sandbox-portal")]


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SyncRuntime]:
    with open_runtime_sync(_config(tmp_path_factory.mktemp("sync-sbx"))) as runtime:
        yield runtime


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _gone_soon(pid: int, within: float = 5) -> bool:
    """Whether ``pid`` stops running within ``within`` s (a SIGKILL lands a moment later)."""
    deadline = time.monotonic() + within
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _run_child(script: str, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ------------------------------------------------------------------ the API, blocking


def test_files_and_state_through_the_facade(rt: SyncRuntime, tmp_path: Path) -> None:
    assert rt.state is State.OPEN and not rt.closed and rt.sandbox_id
    assert rt.resolve_path("x") == rt.workdir + "/x"
    assert rt.describe() == rt.runtime.describe()
    rt.write("dir/a.txt", "alpha")
    assert rt.read("dir/a.txt") == b"alpha"
    assert rt.exists("dir/a.txt") and not rt.exists("dir/nothing")
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "b.bin").write_bytes(b"\x00\xff")
    rt.upload(tmp_path / "up", "uploaded")
    assert rt.read("uploaded/b.bin") == b"\x00\xff"
    rt.download("dir", tmp_path / "down")
    assert (tmp_path / "down" / "a.txt").read_bytes() == b"alpha"
    rt.remove("dir")
    assert not rt.exists("dir")
    assert rt.alive() is True
    assert rt.policy_user is None and rt.prepare_policy_user() is None


def test_exec_streams_in_the_portal_thread_and_takes_a_blocking_stdin(rt: SyncRuntime) -> None:
    seen: list[tuple[str, bytes, str]] = []

    def record(stream: str, chunk: bytes) -> None:
        seen.append((stream, chunk, threading.current_thread().name))

    def typed_slowly() -> Iterator[bytes]:
        for line in (b"one\n", b"two\n"):
            time.sleep(0.05)  # blocks a worker thread, never the portal's loop
            yield line

    result = rt.exec(["sh", "-c", "cat; echo err >&2"], stdin=typed_slowly(), on_output=record)
    assert result.stdout_bytes == b"one\ntwo\n" and result.stderr_bytes == b"err\n"
    assert b"".join(c for s, c, _ in seen if s == "stdout") == b"one\ntwo\n"
    assert {name for _, _, name in seen} == {name for name in _portal_threads()}

    kept = rt.exec(["sh", "-c", "head -c 100000 /dev/zero"], keep_output=False, on_output=record)
    assert kept.stdout_bytes == b"" and kept.exit_code == 0


def test_errors_cross_the_portal_as_the_same_objects(rt: SyncRuntime) -> None:
    with pytest.raises(ExecTimeoutError) as timed_out:
        rt.exec(["sh", "-c", "echo partial; sleep 30"], timeout=0.5)
    assert timed_out.value.stdout_bytes == b"partial\n"

    with pytest.raises(SandboxFileNotFoundError) as missing:
        rt.read("no/such/file")
    assert missing.value.filename and missing.value.filename.endswith("no/such/file")

    with pytest.raises(OutputLimitExceededError) as capped:
        rt.exec(["sh", "-c", "head -c 5000 /dev/zero; sleep 30"], output_limit=1000)
    assert len(capped.value.stdout_bytes) == 1000

    mine = LookupError("the callback's own error")

    def fail(stream: str, chunk: bytes) -> None:
        raise mine

    with pytest.raises(LookupError) as raised:
        rt.exec(["echo", "x"], on_output=fail)
    assert raised.value is mine

    def broken_input() -> Iterator[bytes]:
        yield b"first\n"
        raise mine

    with pytest.raises(LookupError) as from_stdin:
        rt.exec(["sh", "-c", "cat; sleep 30"], stdin=broken_input(), timeout=20)
    assert from_stdin.value is mine

    with pytest.raises(SandboxInvalidArgumentError):
        rt.exec([])


def test_host_routes_and_backend_attributes(rt: SyncRuntime) -> None:
    assert rt.host_routes() == ("loopback",)
    assert rt.plan_host_route() == ("loopback", "127.0.0.1")
    with rt.expose_host(8123) as route:
        assert isinstance(route, SyncHostRoute)
        assert route.address == "127.0.0.1:8123" and route.url("/x") == "http://127.0.0.1:8123/x"
        route.check()
    assert route.closed
    assert rt.channel_info.state == "disabled"  # a plain attribute, passed through
    pid = int(rt.exec(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"]).stdout)
    assert rt.stop_processes() >= 1
    assert _gone_soon(pid)


def test_calls_from_eight_threads_run_concurrently(rt: SyncRuntime) -> None:
    codes: list[int] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            codes.append(rt.exec(["sleep", "1"]).exit_code)
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    elapsed = time.monotonic() - started
    assert not errors and codes == [0] * 8
    assert elapsed < 5, f"8 x sleep 1 took {elapsed:.1f}s: calls were serialized"


def test_refuses_to_block_inside_an_event_loop(rt: SyncRuntime) -> None:
    async def in_asyncio() -> None:
        rt.exec(["true"])

    async def in_trio() -> None:
        rt.read("anything")

    with pytest.raises(BlockingCallInEventLoopError, match="asyncio event loop"):
        asyncio.run(in_asyncio())
    with pytest.raises(BlockingCallInEventLoopError, match="trio event loop"):
        trio.run(in_trio)

    def nested(stream: str, chunk: bytes) -> None:
        rt.exec(["true"])  # the callback runs on the portal's own loop

    with pytest.raises(BlockingCallInEventLoopError):
        rt.exec(["echo", "x"], on_output=nested)

    async def from_worker_thread() -> bytes:
        import anyio.to_thread

        result = await anyio.to_thread.run_sync(lambda: rt.exec(["echo", "ok"]))
        return result.stdout_bytes

    assert asyncio.run(from_worker_thread()) == b"ok\n"


# ------------------------------------------------------------------ lifecycle


def test_close_is_idempotent_from_many_threads_and_ends_the_portal(tmp_path: Path) -> None:
    before = set(_portal_threads())
    runtime = open_runtime_sync(_config(tmp_path))
    with pytest.raises(SandboxUnavailableError, match="never started"):
        runtime.exec(["true"])
    assert runtime.alive() is False
    runtime.start()
    workdir = Path(runtime.workdir)
    with pytest.raises(SandboxUnavailableError, match="already started"):
        runtime.start()
    assert set(_portal_threads()) - before

    outcome: list[object] = []
    sleeper = threading.Thread(target=lambda: outcome.append(_exec_outcome(runtime)))
    sleeper.start()
    time.sleep(0.3)
    closers = [threading.Thread(target=runtime.close) for _ in range(4)]
    for thread in closers:
        thread.start()
    for thread in closers:
        thread.join(30)
    sleeper.join(30)
    assert not sleeper.is_alive(), "a call in flight outlived close()"
    assert outcome and outcome[0] != 0, "the sleeper should have been cut short"
    assert runtime.closed and not workdir.exists()
    assert set(_portal_threads()) == before
    runtime.close()
    assert runtime.alive() is False
    with pytest.raises(SandboxUnavailableError, match="is closed"):
        runtime.exec(["true"])
    assert all(r is not runtime.runtime for r in live_runtimes())


def _exec_outcome(runtime: SyncRuntime) -> object:
    try:
        return runtime.exec(["sleep", "30"]).exit_code
    except SandboxUnavailableError as exc:
        return exc


def test_never_started_close_and_trio_backend(tmp_path: Path) -> None:
    unused = open_runtime_sync(_config(tmp_path))
    unused.close()
    assert unused.closed

    with pytest.raises(SandboxInvalidArgumentError, match="curio"):
        open_runtime_sync(_config(tmp_path), backend="curio")

    with open_runtime_sync(_config(tmp_path), backend="trio") as runtime:
        assert runtime.exec(["echo", "trio"]).stdout == "trio\n"
        with pytest.raises(ExecTimeoutError):
            runtime.exec(["sleep", "30"], timeout=0.3)
    assert runtime.closed


_INTERRUPTED_CHILD = r"""
import json, sys, time
from pathlib import Path
from runtimes import open_runtime_sync

def alive(pid):
    deadline = time.monotonic() + 5  # a SIGKILL lands a moment after it is sent
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            return False
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
        time.sleep(0.02)
    return True

with open_runtime_sync({"type": "subprocess", "root": sys.argv[1]}) as rt:
    started = time.monotonic()
    try:
        rt.exec(
            ["sh", "-c", "sleep 300 & echo $! > bg; echo $$ > sh; echo go; wait"],
            on_output=lambda stream, chunk: print("READY", flush=True),
        )
    except KeyboardInterrupt:
        pids = [int(rt.read(name)) for name in ("sh", "bg")]
        print(json.dumps({
            "after": time.monotonic() - started,
            "alive": [pid for pid in pids if alive(pid)],
            "usable": rt.exec(["echo", "ok"]).stdout,
        }), flush=True)
    with rt.shell() as sh:
        print("SHELL", rt.workdir, flush=True)
        try:
            sh.run("touch started; sleep 300; echo not interrupted")
        except KeyboardInterrupt:
            print(json.dumps({"shell": sh.run("echo still here").stdout}), flush=True)
"""


def test_keyboard_interrupt_cancels_the_exec_and_kills_its_tree(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_CHILD, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "READY"
        child.send_signal(signal.SIGINT)
        report = json.loads(child.stdout.readline())
        shell_line = child.stdout.readline().split()
        assert shell_line[0] == "SHELL", shell_line
        _wait_for(Path(shell_line[1]) / "started")
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert report["alive"] == [], "the interrupted command's tree survived"
    assert report["usable"] == "ok\n"
    assert report["after"] < 20
    assert json.loads(out) == {"shell": "still here\n"}, "the session did not survive Ctrl-C"
    assert os.listdir(tmp_path) == []


def _wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


_INTERRUPTED_ENTER_CHILD = r"""
import anyio
from runtimes.portal import HeldContext, PortalThread

class SlowToEnter:
    cleaned = False

    async def __aenter__(self):
        print("ENTERING", flush=True)
        try:
            await anyio.sleep(300)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.sleep(0.3)  # a cleanup that takes a while, like ending a shell
            SlowToEnter.cleaned = True

    async def __aexit__(self, *exc):
        return None

loop = PortalThread("asyncio", {}, "test-portal")
try:
    HeldContext(loop.portal, SlowToEnter()).enter()
except KeyboardInterrupt:
    print("cleaned before the interrupt came out:", SlowToEnter.cleaned, flush=True)
print("stopped:", loop.stop(10), flush=True)
"""


def test_keyboard_interrupt_while_entering_a_held_context_cancels_it(tmp_path: Path) -> None:
    """What a Ctrl-C during ``with rt.shell()`` relies on: the start is cancelled and its
    cleanup done before the interrupt reaches the caller."""
    child = subprocess.Popen(
        [sys.executable, "-c", _INTERRUPTED_ENTER_CHILD],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ENTERING"
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert out.splitlines() == ["cleaned before the interrupt came out: True", "stopped: True"]


_LEFT_OPEN_CHILD = r"""
import atexit, sys, threading
atexit.register(lambda: print("threads at exit:", *sorted(t.name for t in threading.enumerate())))
from runtimes import open_runtime_sync

rt = open_runtime_sync({"type": "subprocess", "root": sys.argv[1]}).start()
pid = rt.exec(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"]).stdout.strip()
print(rt.workdir, pid, flush=True)
"""


def test_a_runtime_left_open_is_closed_at_exit(tmp_path: Path) -> None:
    started = time.monotonic()
    done = _run_child(_LEFT_OPEN_CHILD, str(tmp_path))
    assert done.returncode == 0, done.stderr
    workdir, pid = done.stdout.splitlines()[0].split()
    assert not Path(workdir).exists() and os.listdir(tmp_path) == []
    assert _gone_soon(int(pid))
    assert "vf-sandbox-portal" not in done.stdout.splitlines()[-1], "the portal thread survived"
    assert time.monotonic() - started < 30


# ------------------------------------------------------------------ shell sessions


def test_shell_session_keeps_state_and_survives_a_timeout(rt: SyncRuntime) -> None:
    with rt.shell() as sh:
        assert isinstance(sh, SyncShellSession) and sh.pid
        started_alive = sh.alive
        assert started_alive
        sh.run("cd /tmp && export SYNC_X=42")
        assert sh.run("pwd; echo $SYNC_X").stdout == "/tmp\n42\n"
        with pytest.raises(ExecTimeoutError):
            sh.run("sleep 30", timeout=0.5)
        assert sh.run("echo still; (exit 3)").exit_code == 3
    assert not sh.alive
    with pytest.raises(ShellSessionError):
        sh.run("true")
    sh.close()


def test_pty_shell_session_resizes(rt: SyncRuntime) -> None:
    with rt.shell(pty=True, size=(30, 90)) as sh:
        assert sh.run("stty size").stdout.split() == ["30", "90"]
        sh.resize(40, 100)
        assert sh.run("stty size").stdout.split() == ["40", "100"]
    with pytest.raises(SandboxInvalidArgumentError):
        rt.shell(size=(0, 80))


def test_shell_session_left_open_closes_with_the_runtime(tmp_path: Path) -> None:
    with open_runtime_sync(_config(tmp_path)) as runtime:
        sh = runtime.shell()
        sh.__enter__()
        pid = sh.pid
        assert pid and _alive(pid)
    assert _gone_soon(pid)
    sh.close()  # already gone with the runtime: a no-op
    with pytest.raises(ShellSessionError):
        sh.run("true")


# ------------------------------------------------------------------ docs and Docker


def _docs_example() -> str:
    match = re.search(r"^```python\n(.*?)^```$", DOCS.read_text(), re.S | re.M)
    assert match, "docs/sync.md has no python code block"
    return match.group(1)


def test_the_docs_example_runs(tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(_docs_example())
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "hello from the sandbox",
        "stdout b'1\\n'",
        "stdout b'2\\n'",
        "timed out, partial output: 'started\\n'",
        "/tmp 42",
        "workers: [0, 0, 0, 0]",
    ]


_DOCKER_CHILD = r"""
import atexit, sys, threading
atexit.register(lambda: print("threads at exit:", *sorted(t.name for t in threading.enumerate())))
from runtimes import open_runtime_sync

config = {"type": "docker", "image": sys.argv[1], "network": "bridge", "ports": [8000]}
rt = open_runtime_sync(config).start()
host, port = rt.host_port(8000)  # the backend's own coroutine method, blocking
typed = rt.exec(["cat"], stdin=iter([b"o", b"k"])).stdout  # through the channel
print(rt.sandbox_id, host, port, typed, rt.channel_info.state, flush=True)
"""


@pytest.mark.docker
def test_docker_backend_method_and_exit_backstop() -> None:
    import docker

    require_docker_image(DOCKER_TEST_IMAGE)
    done = _run_child(_DOCKER_CHILD, DOCKER_TEST_IMAGE, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    container, host, port, typed, channel = lines[0].split()
    assert (host, typed, channel) == ("127.0.0.1", "ok", "running") and int(port) > 0
    assert "vf-sandbox-portal" not in lines[-1], "the portal thread survived"
    client = docker.from_env()
    try:
        assert client.containers.list(all=True, filters={"id": container}) == []
    finally:
        client.close()
