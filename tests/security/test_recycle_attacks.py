"""Attack class 22: a policy leaves state for the next user of a recycled sandbox.

``RuntimePool(recycle=True)`` hands a released sandbox to the next acquirer once a reset
proved it back to its state after start (``runtimes.recycle``). The policy (the pool's
unprivileged account) leaves what it can: files in every writable place, processes that
re-fork or hide under another name, System V and POSIX IPC objects, an abstract unix
socket, a full tmpfs, writes to files it should not be able to change, sockets the kernel
keeps after their process died. The next acquirer must see none of it, or the sandbox must
have been destroyed instead. A judge placed in a recycled sandbox keeps its guarantees.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from runtimes import Runtime
from runtimes.pool import RuntimePool
from tests.placement.conftest import ModelsFactory
from tests.placement.conftest import scripted_models as scripted_models

from .conftest import IMAGE, Hostile
from .test_judges import (
    ALIVE,
    WRITE_FAIL,
    bash_call,
    bash_judge,
    detached,
    forged,
    judge_once,
    name,
    plant_policy,
    reply,
    tool_output,
)

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

RECYCLED = {
    "type": "docker",
    "image": IMAGE,
    "read_only": True,
    "policy_user": "nobody",
    "disk": 64,
    "memory": "640MiB",
}
POLICY = Hostile("docker-recycled", RECYCLED, "user", user="nobody")

LOOK = r"""
for d in /work /tmp /dev/shm /dev/mqueue; do echo "$d: $(ls -A "$d" | tr '\n' ' ')"; done
stat -c 'work %U %a' /work
echo "procs: $(ps -eo user=,args= | grep -v -e '^root ' | grep -cv 'ps -eo')"
hidden="-e [k]worker -e [s]leep.1000 -e [s]leep.0.05 -e [t]ime.sleep"
# shellcheck disable=SC2086
echo "sleepers: $(ps -eo args= | grep -c $hidden)"
echo "sysv: $(tail -q -n +2 /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem | wc -l)"
echo "unix: $(tail -n +2 /proc/net/unix | wc -l)"
"""
CLEAN = {
    "/work": "",
    "/tmp": "",
    "/dev/shm": "",
    "/dev/mqueue": "",
    "work": "nobody 755",
    "procs": "0",
    "sleepers": "0",
    "sysv": "0",
    "unix": "0",
}


async def look(rt: Runtime) -> dict[str, str]:
    """What a next acquirer (root, the pool's default user) sees of the last one."""
    done = await rt.exec(["sh", "-c", LOOK])
    assert done.exit_code == 0, done.stderr
    seen = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(": ") if ": " in line else line.partition(" ")
        seen[key] = value.strip()
    return seen


async def policy(rt: Runtime, script: str) -> str:
    done = await rt.exec(["sh", "-c", script], user=rt.policy_user, timeout=60)
    return done.stdout + done.stderr


@asynccontextmanager
async def recycled_pool() -> AsyncIterator[RuntimePool]:
    # size 0: no replacement is made while a sandbox is out, so the next acquirer gets
    # the recycled one (or, where it was destroyed, a new one).
    async with RuntimePool(RECYCLED, size=0, recycle=True) as pool:
        yield pool


async def released(pool: RuntimePool, rt: Runtime) -> None:
    """Wait until the reset of ``rt`` (released by its block) is over."""
    with anyio.fail_after(60):
        while pool.resetting:  # noqa: ASYNC110 - the pool's counter has no event
            await anyio.sleep(0.02)


async def attack_then_look(script: str) -> tuple[str, dict[str, str], bool, str]:
    """The policy runs ``script`` in a pooled sandbox; the next acquirer looks. Returns
    the policy's output, what the next acquirer saw, whether it got the same sandbox, and
    the first acquirer's view before the reset (the control)."""
    async with recycled_pool() as pool:
        async with pool.acquire() as rt:
            first = rt.sandbox_id
            out = await policy(rt, script)
            control = await rt.exec(["sh", "-c", LOOK])
        await released(pool, rt)
        async with pool.acquire() as again:
            seen = await look(again)
            same = again.sandbox_id == first
        return out, seen, same, control.stdout


@pytest.mark.attack(22)
async def test_files_left_in_every_writable_place_are_gone() -> None:
    script = (
        "echo 1 > /work/answer; mkdir -p /work/.cache/deep; echo hint > /work/.cache/deep/x;"
        "ln -s /etc/passwd /work/link; chmod 777 /work; echo 1 > /tmp/.hidden;"
        "mkdir /tmp/d; echo 1 > /dev/shm/seg; mkfifo /tmp/fifo; echo done"
    )
    out, seen, same, control = await attack_then_look(script)
    assert "done" in out and "answer" in control and "seg" in control, out
    assert same, "the sandbox was not recycled"
    assert seen == CLEAN


@pytest.mark.attack(22, 6)
async def test_processes_that_refork_or_hide_under_another_name_are_gone() -> None:
    script = (
        "nohup sh -c 'while :; do sleep 0.05 & wait; done' >/dev/null 2>&1 &"
        "setsid bash -c 'exec -a kworker/0:1 sleep 1000' >/dev/null 2>&1 < /dev/null &"
        "python3 -c 'import os,time\nif os.fork(): os._exit(0)\nos.setsid()\n"
        "if os.fork(): os._exit(0)\ntime.sleep(1000)' &"
        "sleep 0.3; echo started"
    )
    out, seen, same, control = await attack_then_look(script)
    assert "started" in out and "kworker" not in seen, out
    assert re.search(r"sleepers: [1-9]", control), "control: no hidden process ran"
    assert same, "the sandbox was not recycled"
    assert seen == CLEAN


IPC = r"""
import ctypes, ctypes.util, os
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
IPC_CREAT = 0o1000
print("shm", libc.shmget(0x5eed, 4096, IPC_CREAT | 0o666))
print("msg", libc.msgget(0x5eee, IPC_CREAT | 0o666))
print("sem", libc.semget(0x5eef, 1, IPC_CREAT | 0o666))
rt = ctypes.CDLL(ctypes.util.find_library("rt"), use_errno=True)
print("mq", rt.mq_open(b"/leftover", os.O_CREAT | os.O_RDWR, 0o666, None))
"""


@pytest.mark.attack(22)
async def test_system_v_and_posix_ipc_objects_are_gone() -> None:
    out, seen, same, control = await attack_then_look(f"python3 -c '{IPC}'")
    assert re.search(r"shm \d+", out) and not re.search(r"(shm|msg|sem|mq) -1", out), out
    assert re.search(r"sysv: 3", control) and "leftover" in control, control
    assert same, "the sandbox was not recycled"
    assert seen == CLEAN


ABSTRACT = (
    "python3 -c 'import socket,time\ns=socket.socket(socket.AF_UNIX)\n"
    's.bind("\\0vf-leftover"); s.listen(); time.sleep(1000)\' >/dev/null 2>&1 &'
    "sleep 0.5; echo bound"
)


@pytest.mark.attack(22)
async def test_an_abstract_unix_socket_is_gone_and_its_name_free() -> None:
    async with recycled_pool() as pool:
        async with pool.acquire() as rt:
            assert "bound" in await policy(rt, ABSTRACT)
            assert "@vf-leftover" in (await rt.exec(["cat", "/proc/net/unix"])).stdout
        await released(pool, rt)
        async with pool.acquire() as again:
            assert again.sandbox_id == rt.sandbox_id
            assert "vf-leftover" not in (await again.exec(["cat", "/proc/net/unix"])).stdout
            rebind = "import socket; socket.socket(socket.AF_UNIX).bind(b'\\0vf-leftover')"
            assert (await again.exec(["python3", "-c", rebind], user=again.policy_user)).ok


@pytest.mark.attack(22)
async def test_files_it_should_not_change_stay_unchanged() -> None:
    files = ["/etc/passwd", "/usr/bin/python3", "/bin/sh", "/etc/hosts"]
    script = "; ".join(f"echo pwned >> {f}" for f in files) + "; touch /usr/x /etc/x; echo tried"
    async with recycled_pool() as pool:
        async with pool.acquire() as rt:
            before = {f: hashlib.sha256(await rt.read(f)).hexdigest() for f in files}
            assert "tried" in await policy(rt, script)
        await released(pool, rt)
        async with pool.acquire() as again:
            assert again.sandbox_id == rt.sandbox_id
            after = {f: hashlib.sha256(await again.read(f)).hexdigest() for f in files}
            assert after == before, [f for f in files if after[f] != before[f]]
            assert not await again.exists("/usr/x") and not await again.exists("/etc/x")


@pytest.mark.attack(22)
async def test_a_tmpfs_filled_to_the_brim_is_emptied() -> None:
    script = "head -c 200M /dev/zero > /tmp/big; head -c 200M /dev/zero > /work/big; df -m /tmp"
    async with recycled_pool() as pool:
        async with pool.acquire() as rt:
            out = await policy(rt, script)
            assert "No space left" in out, out
        await released(pool, rt)
        async with pool.acquire() as again:
            assert again.sandbox_id == rt.sandbox_id
            assert await look(again) == CLEAN
            room = "head -c 48M /dev/zero > /tmp/fits && head -c 48M /dev/zero > fits && echo ok"
            assert "ok" in await policy(again, room)


TIME_WAIT = r"""
import socket
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen()
client = socket.create_connection(server.getsockname())
conn, _ = server.accept(); conn.close(); client.recv(1); client.close(); server.close()
print("closed")
"""


@pytest.mark.attack(22)
async def test_what_the_reset_cannot_undo_destroys_the_sandbox() -> None:
    """A TCP connection closed from the server's side stays in TIME_WAIT for a minute,
    after its process died: visible to the next user, so the sandbox is not recycled."""
    async with recycled_pool() as pool:
        async with pool.acquire() as rt:
            assert "closed" in await policy(rt, f"python3 -c '{TIME_WAIT}'")
        await released(pool, rt)
        assert pool.recycling is not None and pool.recycling.discarded == 1
        assert rt.closed
        async with pool.acquire() as again:
            assert again.sandbox_id != rt.sandbox_id
            tcp = await again.exec(["sh", "-c", "tail -n +2 /proc/net/tcp | wc -l"])
            assert tcp.stdout.strip() == "0"


@pytest.mark.attack(22, 2)
async def test_a_judge_in_a_recycled_sandbox_keeps_its_verdict(
    scripted_models: ModelsFactory,
) -> None:
    """The last acquirer's policy leaves a forger behind; the next acquirer's policy plants
    its own; the judge placed in the recycled sandbox collects its own verdict."""
    judge = name("rj")
    script = [bash_call(f"./run_tests; {WRITE_FAIL}{ALIVE}"), bash_call("sleep 2.5"), reply("x")]
    models = scripted_models({judge: script})
    async with recycled_pool() as pool:
        async with pool.acquire() as rt:
            await plant_policy(rt, POLICY, detached(5.0, judge))
            await policy(rt, 'nohup sh "$PWD/forger.sh" 3 ' + judge + ' "$PWD" file loop &')
        await released(pool, rt)
        async with pool.acquire() as again:
            assert again.sandbox_id == rt.sandbox_id
            await plant_policy(again, POLICY, detached(1.0, judge))
            runs, error = await judge_once(again, bash_judge(judge), models)
            assert error is None, error
            assert re.search(r"writers=[1-9]", tool_output(runs[0], 0)), "control: no writer ran"
            assert runs[0].verdict == {"passed": False}, "the policy's writer forged the verdict"
            assert await forged(again) == []


@pytest.mark.attack(22, 14)
async def test_what_root_leaves_in_its_own_places_destroys_the_sandbox() -> None:
    """A read-only config has no judges' account: a judge runs the policy's programs as the
    sandbox's default user, root. What such a program leaves where only root can write
    (``/dev``, ``/sys/fs/cgroup``: the engine's tmpfs, not on the read-only root) is not
    something the reset empties: the sandbox is destroyed instead."""
    async with recycled_pool() as pool:
        async with pool.acquire() as rt:
            assert rt.judge_user is None  # no account of its own: a judge runs as root
            done = await rt.exec(["sh", "-c", "echo hint > /dev/.note && mkdir /sys/fs/cgroup/x"])
            assert done.exit_code == 0, done.stderr
        await released(pool, rt)
        assert pool.recycling is not None and pool.recycling.discarded == 1
        async with pool.acquire() as again:
            assert again.sandbox_id != rt.sandbox_id
            assert not await again.exists("/dev/.note")
