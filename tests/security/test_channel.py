"""Attack classes 3, 4 and 7: the in-sandbox channel (``docs/channel.md``, "Security").

3. Code in the sandbox (the policy's user; root where the policy is root) tries to speak for
   the channel: it opens the agent's stdin/stdout through ``/proc/<agent pid>/fd/`` and writes
   forged frames built with the agent's own framing, while many execs and reads run.
4. A root policy plants a fake ``python3`` ahead on ``PATH`` and at the interpreter's real
   path, then kills the agent: the restart must not run the fake.
7. A hostile agent (a test double run in place of the real one) answers a capped read with
   hundreds of MiB, or announces a 4 GiB frame: a typed error, host memory bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from typing import Any

import anyio
import pytest

from runtimes import OutputLimitExceededError, open_runtime
from runtimes.channel.agent import wire as agent
from runtimes.errors import ChannelTamperedError, SandboxTransportError

from .conftest import Hostile

pytestmark = pytest.mark.anyio

CHANNEL_TARGETS = ["docker-root", "docker-user", "ssh-root", "ssh-user", "modal-fake"]
ROOT_TARGETS = ["docker-root", "ssh-root", "modal-fake"]

# ---------------------------------------------------------------------- class 3

_ATTACK = r"""
import json, os, subprocess, sys, time
pid, seconds = int(sys.argv[1]), float(sys.argv[2])
forged = sys.stdin.buffer.read()
# Control: the same open on a dumpable process of ours works (the attack path is live).
ctl = subprocess.Popen(["sleep", "30"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
try:
    os.close(os.open("/proc/%d/fd/1" % ctl.pid, os.O_WRONLY))
    control = "opened"
except OSError as exc:
    control = repr(exc)
ctl.kill()
opened, refused, fds = [], [], []
for n in (0, 1):
    for mode, name in ((os.O_WRONLY, "w"), (os.O_RDWR, "rw"), (os.O_RDONLY, "r")):
        try:
            fds.append((os.open("/proc/%d/fd/%d" % (pid, n), mode | os.O_NONBLOCK), name))
            opened.append("%d:%s" % (n, name))
        except OSError as exc:
            refused.append("%d:%s:%s" % (n, name, exc.strerror))
stolen = 0
deadline = time.monotonic() + seconds
while fds and time.monotonic() < deadline:
    for fd, name in fds:
        try:
            if name == "r":
                stolen += len(os.read(fd, 65536))
            else:
                os.write(fd, forged)
        except OSError:
            pass
    time.sleep(0.005)
print(json.dumps({"control": control, "opened": opened, "refused": refused, "stolen": stolen}))
"""


def _forged_frames() -> bytes:
    """What an impostor would say, in the agent's own framing (it cannot know the key: the
    tag is a guess): every small request id exits 0, and reads return forged bytes."""
    frames = []
    for rid in range(1, 600):
        for kind, payload in (
            (agent.STARTED, agent.U32.pack(1)),
            (agent.CHUNK, b"FORGED"),
            (agent.STDOUT, b"FORGED"),
            (agent.EXIT, agent.I32.pack(0)),
            (agent.DONE, b""),
        ):
            frames.append(agent.HEADER.pack(kind, rid, len(payload)) + payload + bytes(agent.TAG))
    return b"".join(frames)


@pytest.mark.attack(3)
@pytest.mark.parametrize("hostile", CHANNEL_TARGETS, indirect=True)
async def test_sandbox_code_cannot_speak_for_the_channel(hostile: Hostile) -> None:
    content = os.urandom(3000)
    rt: Any
    async with open_runtime(hostile.config) as rt:
        info = rt.channel_info
        assert info.state == "running" and info.agent_pid, info
        path = f"/tmp/vf-channel-{uuid.uuid4().hex[:8]}"
        await rt.write(path, content)
        await rt.exec(["chmod", "644", path], user=hostile.user)
        await rt.write("/tmp/vf-attack.py", _ATTACK.encode())
        wrong: list[str] = []
        typed: list[BaseException] = []
        attack: dict[str, Any] = {}

        async def run_attack() -> None:
            result = await rt.exec(
                ["python3", "/tmp/vf-attack.py", str(info.agent_pid), "4"],
                stdin=_forged_frames(),
                user=hostile.user,
                timeout=60,
            )
            attack.update(json.loads(result.stdout))

        async def one(i: int) -> None:
            try:
                if i % 3 == 0:
                    code = (await rt.exec(["sh", "-c", "exit 7"], user=hostile.user)).exit_code
                    if code != 7:
                        wrong.append(f"exit {code} instead of 7")
                elif i % 3 == 1:
                    out = (await rt.exec(["printf", f"out-{i}"], user=hostile.user)).stdout
                    if out != f"out-{i}":
                        wrong.append(f"stdout {out!r} instead of out-{i}")
                else:
                    data = await rt.read(path)
                    if data != content:
                        wrong.append(f"read returned {data[:20]!r}...")
            except ChannelTamperedError as exc:  # detected: a typed error, never a wrong result
                typed.append(exc)

        async def load() -> None:
            limiter = anyio.CapacityLimiter(16)

            async def limited(i: int) -> None:
                async with limiter:
                    await one(i)

            async with anyio.create_task_group() as tg:
                for i in range(240):
                    tg.start_soon(limited, i)
                    if i % 16 == 15:
                        await anyio.sleep(0.05)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_attack)
            tg.start_soon(load)

        assert attack["control"] == "opened", attack  # the /proc path is live for its own kind
        assert not wrong, (wrong[:5], attack)
        # Prevented: the agent is non-dumpable, /proc/<pid>/fd is closed to sandbox code.
        assert attack["opened"] == [], attack
        assert not typed, typed[:3]
        assert (await rt.exec(["sh", "-c", "exit 7"])).exit_code == 7
        assert rt.channel_info.state == "running", rt.channel_info


@pytest.mark.attack(3)
@pytest.mark.parametrize("hostile", ["docker-user", "ssh-user"], indirect=True)
async def test_root_in_the_sandbox_cannot_open_the_agent_either(
    hostile: Hostile, request: pytest.FixtureRequest
) -> None:
    """Where the policy is unprivileged, a root process in the sandbox (one the policy could
    never start; here the engine's own exec) still cannot open the agent's stream: Docker
    drops CAP_SYS_PTRACE, and without it root cannot open a non-dumpable process's fds."""
    rt: Any
    async with open_runtime(hostile.config) as rt:
        pid = rt.channel_info.agent_pid
        await rt.write("/tmp/vf-attack.py", _ATTACK.encode())
        command = f"python3 /tmp/vf-attack.py {pid} 1 </dev/null"
        if hostile.backend == "docker":
            client = request.getfixturevalue("docker_client")
            container = client.containers.get(rt.sandbox_id)
            code, out = await anyio.to_thread.run_sync(
                lambda: container.exec_run(["sh", "-c", command], user="0")
            )
            assert code == 0, out
            text = out.decode()
        else:
            sshd = request.getfixturevalue("sshd")
            text = await anyio.to_thread.run_sync(sshd.docker_exec, command)
        attack = json.loads(text.strip().splitlines()[-1])
        assert attack["control"] == "opened", attack
        assert attack["opened"] == [], attack
        assert (await rt.exec(["sh", "-c", "exit 7"])).exit_code == 7
        assert rt.channel_info.state == "running"


@pytest.mark.attack(3)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
async def test_a_forged_frame_on_the_stream_is_a_typed_error_and_the_channel_is_dropped(
    hostile: Hostile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forged bytes that do reach the host's side of the stream (here: injected into the
    transport, as an impostor holding the agent's stdout would write them) fail the
    authentication: every request in flight fails typed, later calls take the plain path."""
    rt: Any
    async with open_runtime(hostile.config) as rt:
        chan = rt._channel_supervisor._channel
        assert chan is not None
        transport = chan._transport
        original = transport.recv
        injected = {"done": False}

        def recv() -> bytes:
            data: bytes = original()
            if data and not injected["done"]:
                injected["done"] = True
                forged = agent.HEADER.pack(agent.EXIT, 1, 4) + agent.I32.pack(0)
                return forged + bytes(agent.TAG) + data
            return data

        monkeypatch.setattr(transport, "recv", recv)
        with pytest.raises(ChannelTamperedError):
            await rt.exec(["sh", "-c", "sleep 0.2; exit 7"])
        info = rt.channel_info
        assert info.state == "distrusted" and "authentication" in (info.reason or ""), info
        # The plain path serves from now on, exactly.
        assert (await rt.exec(["sh", "-c", "exit 7"])).exit_code == 7
        assert rt.channel_info.fallbacks >= 1


# ---------------------------------------------------------------------- class 4


async def _wait_down(rt: Any) -> None:
    """Until the runtime noticed its agent died (the stream's EOF)."""
    with anyio.fail_after(10):
        while rt.channel_info.state == "running":  # noqa: ASYNC110 - polls another thread's view
            await anyio.sleep(0.01)


_KILL_LATER = "(sleep 0.2; kill -9 {pid}) </dev/null >/dev/null 2>&1 &"
"""The policy kills the agent from a detached process (a command that kills its own parent
fails with a transport error: a known edge, not this attack)."""

_FAKE = """#!/bin/sh
echo "ran $1" >> {marker}
exec {real} "$@"
"""
"""The fake interpreter: logs each run (its first argument: ``-I`` when started as the
channel agent) and passes on to the real one (so nothing else in the sandbox breaks)."""


@pytest.mark.attack(4)
@pytest.mark.parametrize("hostile", ROOT_TARGETS, indirect=True)
async def test_a_replaced_interpreter_never_runs_as_the_agent(hostile: Hostile) -> None:
    marker = f"/tmp/vf-fake-python-ran-{uuid.uuid4().hex[:8]}"
    rt: Any
    async with open_runtime(hostile.config) as rt:
        first = rt.channel_info
        assert first.state == "running", first
        real = (
            await rt.exec(["sh", "-c", 'readlink -f "$(command -v python3)"'], user=hostile.user)
        ).stdout.strip()
        assert real.startswith("/"), real
        moved = real + ".orig"
        fake = _FAKE.format(marker=marker, real=moved)
        plant = (
            f"set -e; mv {real} {moved}; printf '%s' \"$1\" > {real}; chmod 755 {real}; "
            f"mkdir -p /usr/local/bin; printf '%s' \"$1\" > /usr/local/bin/python3; "
            "chmod 755 /usr/local/bin/python3"
        )
        planted = await rt.exec(["sh", "-c", plant, "sh", fake], user=hostile.user)
        assert planted.exit_code == 0, planted
        # Control: the fake is live, first on PATH and at the real path.
        assert (await rt.exec(["python3", "-c", "print(6*7)"])).stdout == "42\n"
        assert (await rt.exec([real, "-c", "print(6*7)"])).stdout == "42\n"
        assert (await rt.exec(["cat", marker])).stdout == "ran -c\nran -c\n"
        await rt.exec(["rm", "-f", marker])
        # The policy kills the agent.
        await rt.exec(["sh", "-c", _KILL_LATER.format(pid=first.agent_pid)], user=hostile.user)
        await _wait_down(rt)
        # The next calls are exact, and never went through the fake.
        assert (await rt.exec(["sh", "-c", "echo next; exit 7"])).exit_code == 7
        assert (await rt.exec(["echo", "hello"])).stdout == "hello\n"
        assert await rt.read("/etc/hostname")
        info = rt.channel_info
        assert info.state == "distrusted", info
        assert info.reason and "changed" in info.reason, info
        runs = (await rt.exec(["sh", "-c", f"cat {marker} 2>/dev/null || true"])).stdout
        if hostile.backend == "modal":
            # The fake SDK's stand-in for Modal's filesystem tool (a Rust binary on Modal) is
            # a python3 script inside the sandbox: the verification read ran the fake through
            # it. What matters: the fake never ran as the agent (``-I``).
            assert "ran -I" not in runs, (runs, info)
        else:
            assert runs == "", (runs, info)


@pytest.mark.attack(4)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
async def test_attaching_to_a_sandbox_with_a_planted_python3_never_runs_it(
    hostile: Hostile,
) -> None:
    """A judge's runtime attaches to a rollout's container where the policy already planted a
    ``python3`` first on PATH: the first agent of the attached runtime is not started through
    it (the engine's diff shows the plant), the plain path serves, exactly."""
    marker = f"/tmp/vf-fake-python-ran-{uuid.uuid4().hex[:8]}"
    fake = _FAKE.format(marker=marker, real="/usr/bin/python3.11")
    plant = "printf '%s' \"$1\" > /usr/local/bin/python3; chmod 755 /usr/local/bin/python3"
    rollout: Any
    judge: Any
    async with open_runtime(hostile.config) as rollout:
        assert (await rollout.exec(["sh", "-c", plant, "sh", fake])).exit_code == 0
        assert (await rollout.exec(["python3", "-c", "print(1)"])).stdout == "1\n"  # live
        await rollout.exec(["rm", "-f", marker])
        async with open_runtime({**hostile.config, "container": rollout.sandbox_id}) as judge:
            assert (await judge.exec(["sh", "-c", "exit 7"])).exit_code == 7
            assert (await judge.exec(["echo", "judge"])).stdout == "judge\n"
            info = judge.channel_info
            assert info.state == "distrusted" and "python3" in (info.reason or ""), info
        runs = (await rollout.exec(["sh", "-c", f"cat {marker} 2>/dev/null || true"])).stdout
        assert runs == "", runs


@pytest.mark.attack(4)
@pytest.mark.parametrize("hostile", ["ssh-root"], indirect=True)
async def test_a_fake_python3_on_path_alone_is_never_searched_on_restart(
    hostile: Hostile,
) -> None:
    """Only PATH is poisoned (the real interpreter is intact): the restart runs the pinned
    interpreter by absolute path, verified, and the channel serves again."""
    marker = f"/tmp/vf-fake-python-ran-{uuid.uuid4().hex[:8]}"
    rt: Any
    async with open_runtime(hostile.config) as rt:
        first = rt.channel_info
        fake = f"#!/bin/sh\necho ran >> {marker}\nexit 0\n"
        plant = (
            "mkdir -p /usr/local/bin; printf '%s' \"$1\" > /usr/local/bin/python3; "
            "chmod 755 /usr/local/bin/python3"
        )
        assert (await rt.exec(["sh", "-c", plant, "sh", fake])).exit_code == 0
        assert (await rt.exec(["sh", "-c", "command -v python3"])).stdout.strip() == (
            "/usr/local/bin/python3"
        )
        await rt.exec(["sh", "-c", _KILL_LATER.format(pid=first.agent_pid)])
        await _wait_down(rt)
        assert (await rt.exec(["sh", "-c", "exit 7"])).exit_code == 7
        info = rt.channel_info
        assert info.state == "running" and info.restarts == 1, info
        assert info.agent_pid != first.agent_pid
        gone = await rt.exec(["sh", "-c", f"test -e {marker} && echo RAN || echo clean"])
        assert gone.stdout == "clean\n"


# ---------------------------------------------------------------------- class 7


def _measure(config: dict[str, Any], mode: str) -> dict[str, Any]:
    """Run ``tests.security.channel_memory_child`` (a clean process) and parse its result."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.security.channel_memory_child", json.dumps(config), mode],
        capture_output=True,
        timeout=300,
        check=False,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


BOUND = 64 * 1024 * 1024
"""Host memory growth allowed while a hostile agent floods: well under what it sends."""


@pytest.mark.attack(7)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
@pytest.mark.parametrize("mode", ["read-flood", "huge-frame", "exec-flood"])
async def test_a_hostile_agent_cannot_grow_host_memory(hostile: Hostile, mode: str) -> None:
    outcome = await anyio.to_thread.run_sync(_measure, hostile.config, mode)
    assert outcome["hostile_agent"] is True, outcome  # the double really answered
    if mode == "read-flood":
        assert outcome["error"] == OutputLimitExceededError.__name__, outcome
    elif mode == "huge-frame":
        assert outcome["error"] in (
            ChannelTamperedError.__name__,
            SandboxTransportError.__name__,
        ), outcome
    else:
        assert outcome["error"] in (
            OutputLimitExceededError.__name__,
            ChannelTamperedError.__name__,
        ), outcome
        assert outcome["kept"] <= 1024 * 1024, outcome
    # Control: the double did flood past the cap, or announce its frame (the attack is live).
    if mode == "huge-frame":
        assert "4294967280" in outcome["message"], outcome
    else:
        assert outcome["received_bytes"] > 1024 * 1024, outcome
    assert outcome["growth_bytes"] < BOUND, outcome
    assert outcome["state_after"] == "distrusted", outcome
    assert outcome["usable_after"] is True, outcome
