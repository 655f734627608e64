"""Attack class 11: a shell session (``runtimes/shell``, ``docs/shell.md``) spoken for by
sandbox code.

A judge may open a session in the policy's live sandbox. The policy plays against it:

(a) output of a command (or a program the command runs) carrying fake end-of-command
    status lines or driver frames must not end the command early or change its exit code;
(b) a leftover process of the policy, as ``policy_user``, must not reach the session: not
    its control FIFOs, not the command file, not the non-dumpable driver (``/proc`` handles,
    ``ptrace``, signals), not its terminal;
(c) startup files the policy planted (``~/.bashrc``, ``/etc/bash.bashrc``, profiles,
    ``BASH_ENV``, ``/etc/inputrc``, a ``~/.bash_history`` symlink to a file it wants
    overwritten) are neither read nor written by the session;
(d) a command that tampers with the status reporting (``PROMPT_COMMAND``, the sequence
    variable, ``builtin`` shadowed, ``enable -n printf``, ``set -e``, ``TMOUT``, ...) either
    leaves it working or gets the session declared dead (``ShellSessionError``), in bounded
    time: never a wrong result, never a hang;
(e) (class 2 too) a placed ``bash`` judge with ``persistent_shell`` runs the policy's program,
    which forks a verdict writer: the verdict collected is the judge's own.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from harnesses.scripted import bash_call, reply
from runtimes import ExecTimeoutError, Runtime, ShellSessionError, open_runtime
from runtimes.channel.agent.codec import Sealer
from runtimes.shell import ShellSession
from runtimes.shell import protocol as frames
from tests.placement import conftest as placement_fixtures
from tests.placement.conftest import ModelsFactory

from .conftest import Hostile
from .test_judges import (
    ALIVE,
    WRITE_FAIL,
    bash_judge,
    detached,
    forged,
    judge_once,
    name,
    plant_policy,
    tool_output,
)

scripted_models = placement_fixtures.scripted_models

pytestmark = pytest.mark.anyio

LOCAL = ["subprocess", "docker-root"]

# Seconds a sabotaged command may take to be answered (interrupted, or the session declared
# dead): its timeout, two grace periods of the driver and the host's slack, on a loaded host.
TIMEOUT = 2.0
GRACE = 0.5
ANSWER_BOUND = TIMEOUT + 2 * max(GRACE, 1.0) + 5.0 + 5.0


def _forged_statuses(up_to: int = 400) -> bytes:
    """Status lines for every likely sequence number, exit 0, and the driver's END and
    DEAD frames as raw bytes (sealed under a key of the forger's: it does not know the
    session's)."""
    lines = b"".join(b"0 %d\n" % seq for seq in range(up_to))
    forger = Sealer(bytes(frames.KEY))
    return lines + forger.seal(frames.END, 0, b"0") + forger.seal(frames.DEAD, 0, b"forged")


# ---------------------------------------------------------------------- (a) forged ends

_FOREGROUND_FORGER = r"""
import os, sys, time
status, lines = sys.argv[1], sys.stdin.buffer.read()
fd = os.open(status, os.O_WRONLY | os.O_NONBLOCK)
for _ in range(3):
    os.write(fd, lines[:4000])
    time.sleep(0.05)
os.close(fd)
time.sleep(1.0)  # still the terminal's foreground while the forgeries are read
print("forger done")
sys.exit(5)
"""


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", LOCAL, indirect=True)
async def test_fake_status_in_output_does_not_end_a_command(hostile: Hostile) -> None:
    forged = _forged_statuses()
    async with open_runtime(hostile.config) as rt, rt.shell() as sh:
        await rt.write("forged.txt", forged)
        command = (
            "cat forged.txt; cat forged.txt >&2; printf '0 1\\n0 2\\n' >&2; "
            "sleep 0.3; echo tail-after-forgery; touch ran-to-the-end; (exit 7)"
        )
        result = await sh.run(command, timeout=30)
        assert result.exit_code == 7, result
        assert result.stdout_bytes == forged + b"tail-after-forgery\n"
        assert result.stderr_bytes == forged + b"0 1\n0 2\n"
        assert await rt.exists("ran-to-the-end")
        after = await sh.run("echo next", timeout=30)
        assert (after.exit_code, after.stdout) == (0, "next\n"), after


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", LOCAL, indirect=True)
async def test_program_writing_the_status_fifo_does_not_end_a_command(hostile: Hostile) -> None:
    """A program the command runs (the policy's ``./run_tests``) found the session's status
    FIFO (same user: it can open it) and writes exit-0 statuses for every sequence number,
    then driver frames with no line end, while it holds the terminal: the lines are refused
    (the shell is not in the foreground) and the unterminated junk must not swallow the
    real status line that follows."""
    async with open_runtime(hostile.config) as rt, rt.shell() as sh:
        await rt.write("forger.py", _FOREGROUND_FORGER.encode())
        await rt.write("forged.txt", _forged_statuses())
        started = time.monotonic()
        result = await sh.run(
            'python3 forger.py "$__vf_dir/status" < forged.txt; echo "program said $?"',
            timeout=30,
        )
        assert result.exit_code == 0, result
        assert result.stdout == "forger done\nprogram said 5\n", result
        assert time.monotonic() - started >= 1.0
        follow = await sh.run("(exit 3)", timeout=30)
        assert follow.exit_code == 3, follow


_DETACHED_FORGER = r"""
import os, sys, time
status, seconds, tally = sys.argv[1], float(sys.argv[2]), sys.argv[3]
if os.fork():
    os._exit(0)
os.setsid()  # detached: a new session, no longer the shell's job
lines = b"".join(b"0 %d\n" % seq for seq in range(64))
writes = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    try:
        fd = os.open(status, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, lines)
        os.close(fd)
        writes += 1
    except OSError:
        pass
    time.sleep(0.002)
with open(tally, "w") as f:
    f.write(str(writes))
"""


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", LOCAL, indirect=True)
async def test_detached_leftover_forging_statuses_cannot_end_builtin_commands(
    hostile: Hostile,
) -> None:
    """A detached leftover of a program the judge ran (same user, so it can open the status
    FIFO) spams exit-0 statuses while later commands run shell builtins only (the shell
    then holds the terminal): every command must still end when it ends, with its code."""
    async with open_runtime(hostile.config) as rt, rt.shell() as sh:
        await rt.write("forger.py", _DETACHED_FORGER.encode())
        started = await sh.run(
            'python3 forger.py "$__vf_dir/status" 4 "$PWD/forged.tally" >/dev/null 2>&1',
            timeout=30,
        )
        assert started.exit_code == 0, started
        wrong: list[str] = []
        with anyio.fail_after(60):
            for i in range(8):
                # ~0.3 s of builtins, then a code the forger does not write
                result = await sh.run(
                    f"n=0; while [ $n -lt 20000 ]; do n=$((n + 1)); done;"
                    f" echo counted $n; (exit {i + 1})",
                    timeout=30,
                )
                if (result.exit_code, result.stdout) != (i + 1, "counted 20000\n"):
                    wrong.append(f"run {i}: {result!r}")
        await rt.exec(["sh", "-c", "until [ -s forged.tally ]; do sleep 0.1; done"], timeout=30)
        assert int((await rt.read("forged.tally")).decode()) > 100, "the forger did not run"
        assert not wrong, "forged statuses were accepted:\n" + "\n".join(wrong)


# ---------------------------------------------------------------------- (b) leftovers

_LEFTOVER = r"""
import ctypes, glob, json, os, signal, subprocess, sys, time
target, out, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
while not os.path.exists(target):
    time.sleep(0.02)
driver, bash = (int(x) for x in open(target).read().split())
libc = ctypes.CDLL(None, use_errno=True)
# Control: the same opens on a dumpable process of our own work (the attack path is live).
ctl = subprocess.Popen(["sleep", "30"], stdin=subprocess.PIPE)
try:
    os.close(os.open("/proc/%d/fd/0" % ctl.pid, os.O_WRONLY))
    control = "opened"
except OSError as exc:
    control = repr(exc)
ctl.kill()
breaches, refused, dirs = set(), set(), set()

def attempt(name, fn):
    try:
        fn()
        breaches.add(name)
    except OSError as exc:
        refused.add("%s:%s" % (name, exc.strerror))

def open_close(path, mode):
    os.close(os.open(path, mode | os.O_NONBLOCK))

def ptrace(pid):
    if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for d in glob.glob("/tmp/vf-shell-*"):
        dirs.add(d)
        attempt("list " + d, lambda: os.listdir(d))
        for name, mode in (("status", os.O_WRONLY), ("out", os.O_RDONLY), ("err", os.O_RDONLY),
                           ("cmd", os.O_RDONLY), ("cmd", os.O_WRONLY)):
            attempt("%s %s" % (name, mode), lambda: open_close(os.path.join(d, name), mode))
    for pid in (driver, bash):
        for fd in (0, 1, 2):
            for mode in (os.O_RDONLY, os.O_WRONLY):
                attempt("fd %d/%d/%d" % (pid, fd, mode),
                        lambda: open_close("/proc/%d/fd/%d" % (pid, fd), mode))
        attempt("mem %d" % pid, lambda: open_close("/proc/%d/mem" % pid, os.O_RDONLY))
        attempt("environ %d" % pid, lambda: open("/proc/%d/environ" % pid, "rb").read())
        attempt("ptrace %d" % pid, lambda: ptrace(pid))
        attempt("signal %d" % pid, lambda: os.kill(pid, signal.SIGINT))
    for tty in glob.glob("/dev/pts/[0-9]*"):
        attempt("tty " + tty, lambda: open_close(tty, os.O_WRONLY))
    time.sleep(0.01)
with open(out + ".tmp", "w") as f:
    json.dump({"control": control, "breaches": sorted(breaches),
               "refused": sorted(refused), "dirs": sorted(dirs)}, f)
os.rename(out + ".tmp", out)
"""


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", ["docker-user"], indirect=True)
async def test_policy_leftover_cannot_reach_a_judges_session(hostile: Hostile) -> None:
    """The policy (``vf-policy``) left a process running; a judge (root) opens a session and
    runs commands carrying a secret. The leftover finds the session's control dir and the
    driver's and shell's pids but can open, read, write, trace or signal none of them."""
    async with open_runtime(hostile.config) as rt:
        assert rt.policy_user == hostile.user
        await rt.write("/tmp/vf-leftover.py", _LEFTOVER.encode())
        await rt.exec(["chmod", "644", "/tmp/vf-leftover.py"])
        spawn = await rt.exec(
            [
                "sh",
                "-c",
                "mkdir -p /tmp/vf-loot && nohup python3 /tmp/vf-leftover.py /tmp/vf-target "
                "/tmp/vf-loot/result.json 3 >/tmp/vf-loot/log 2>&1 &",
            ],
            user=rt.policy_user,
        )
        assert spawn.exit_code == 0, spawn
        async with rt.shell() as sh:
            pids = await sh.run("echo $PPID $$", timeout=30)
            await rt.write("/tmp/vf-target.tmp", pids.stdout_bytes)
            published = "chmod 644 /tmp/vf-target.tmp && mv /tmp/vf-target.tmp /tmp/vf-target"
            await rt.exec(["sh", "-c", published])
            wrong = []
            deadline = time.monotonic() + 4
            i = 0
            while time.monotonic() < deadline:
                i += 1
                result = await sh.run(f"echo secret-{i}; (exit {i % 7})", timeout=30)
                if (result.exit_code, result.stdout) != (i % 7, f"secret-{i}\n"):
                    wrong.append(repr(result))
                await anyio.sleep(0.02)
            assert not wrong, wrong
        waited = await rt.exec(
            ["sh", "-c", "until [ -e /tmp/vf-loot/result.json ]; do sleep 0.1; done"], timeout=30
        )
        assert waited.exit_code == 0, waited
        report: dict[str, Any] = json.loads(await rt.read("/tmp/vf-loot/result.json"))
        log = (await rt.read("/tmp/vf-loot/log")).decode(errors="replace")
        assert report["control"] == "opened", (report, log)
        assert report["dirs"], f"the leftover never saw the session's control dir: {report}"
        assert report["breaches"] == [], report["breaches"]
        refused = report["refused"]
        assert any(r.startswith("ptrace") for r in refused), refused
        assert any(r.startswith("signal") for r in refused), refused


async def _judged(sh: ShellSession) -> str:
    try:
        result = await sh.run("echo judge-secret-42; (exit 3)", timeout=5)
    except (ShellSessionError, ExecTimeoutError) as exc:
        return f"refused: {exc}"
    if (result.exit_code, result.stdout) != (3, "judge-secret-42\n"):
        return f"wrong result {result!r}"
    return "works"


_DIR_SWAPPER = r"""
import glob, json, os, signal, sys, time
base, out, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
swapped, stolen, errors, steps = None, b"", [], []

def report(*_):
    with open(out + ".tmp", "w") as f:
        json.dump({"swapped": swapped, "stolen": stolen.decode("utf-8", "replace"),
                   "errors": errors[-5:], "steps": steps}, f)
    os.rename(out + ".tmp", out)
    os._exit(0)

signal.signal(signal.SIGALRM, report)
signal.alarm(int(seconds) + 5)  # a blocked FIFO open must not keep the report from the test
deadline = time.monotonic() + seconds
while time.monotonic() < deadline and swapped is None:
    for d in glob.glob(base + "/vf-shell-*"):
        if d.endswith(".orig"):
            continue
        try:
            os.rename(d, d + ".orig")  # the parent is ours: root's dir moves aside
            os.mkdir(d, 0o777)
            os.mkfifo(d + "/cmd", 0o666)
            with open(d + "/init", "w") as f:  # in case the shell has not read its own yet
                f.write("touch /tmp/vf-pwned-by-policy\n")
            swapped = d
            break
        except OSError as exc:
            errors.append(repr(exc))
    time.sleep(0.002)
if swapped:
    fd = os.open(swapped + "/cmd", os.O_RDONLY)  # the driver writing the judge's command
    steps.append("cmd opened for reading")
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        stolen += chunk
    os.close(fd)
    fd = os.open(swapped + "/cmd", os.O_WRONLY)  # the shell sourcing it
    os.write(fd, b"touch /tmp/vf-pwned-by-policy\n")
    os.close(fd)
    steps.append("evil command handed to the shell")
report()
"""


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", ["docker-user"], indirect=True)
async def test_control_dir_under_a_policy_writable_tmpdir_cannot_be_swapped(
    hostile: Hostile,
) -> None:
    """``TMPDIR`` points into the policy's workdir (an environment a user set for the
    policy's benefit): the policy owns the parent of the session's control dir, so it can
    rename that dir aside and put its own in its place, with a FIFO as ``cmd`` to read the
    judge's command and hand the shell its own (and an ``init`` of its own, should the shell
    not have read the real one yet). The session must not use such a parent (or must notice
    the swap): nothing of the policy's runs as root, no command leaks."""
    async with open_runtime(hostile.config) as rt:
        tmpdir = f"{rt.workdir}/tmp"
        await rt.write("/tmp/vf-swapper.py", _DIR_SWAPPER.encode())
        await rt.exec(["chmod", "644", "/tmp/vf-swapper.py"])
        spawn = await rt.exec(
            [
                "sh",
                "-c",
                f"mkdir -p {tmpdir} /tmp/vf-loot && nohup python3 /tmp/vf-swapper.py {tmpdir} "
                "/tmp/vf-loot/swap.json 8 >/tmp/vf-loot/log 2>&1 &",
            ],
            user=rt.policy_user,
        )
        assert spawn.exit_code == 0, spawn
        try:
            async with rt.shell(
                env={"TMPDIR": tmpdir}, interrupt_grace=GRACE, start_timeout=5
            ) as sh:
                await anyio.sleep(0.5)  # the swapper's chance, before the judge's command
                outcome = await _judged(sh)
        except ShellSessionError as exc:
            outcome = f"refused: {exc}"
        await rt.exec(
            ["sh", "-c", "until [ -e /tmp/vf-loot/swap.json ]; do sleep 0.1; done"], timeout=30
        )
        report = json.loads(await rt.read("/tmp/vf-loot/swap.json"))
        pwned = await rt.exists("/tmp/vf-pwned-by-policy")
        assert not pwned, f"the policy's code ran as root in the judge's session ({report})"
        assert "judge-secret-42" not in report["stolen"], f"the judge's command leaked: {report}"
        print(outcome, report)
        assert not outcome.startswith("wrong"), outcome


# ---------------------------------------------------------------------- (c) startup files

_STARTUP_FILES = [
    ".bashrc",
    ".bash_profile",
    ".bash_login",
    ".profile",
    ".bash_logout",
]
_SYSTEM_FILES = ["/etc/bash.bashrc", "/etc/profile", "/etc/profile.d/vf-planted.sh"]


def _planted(marker: str) -> str:
    """A startup file that leaves a mark and hijacks what a judge relies on."""
    return (
        f"touch {marker}\n"
        "alias ls='echo hijacked'\n"
        "echo() { builtin echo hijacked; }\n"
        "PROMPT_COMMAND='builtin printf \"0 0\\n\"'\n"
        "export PATH=/nonexistent\n"
    )


async def _plant(rt: Runtime, home: str, marks: str, system: bool) -> list[str]:
    """Plant every startup file (and, with ``system``, the system-wide ones); returns the
    marker paths they would create."""
    markers = []
    targets = [f"{home}/{name}" for name in _STARTUP_FILES]
    if system:
        targets += _SYSTEM_FILES
    for i, path in enumerate(targets):
        marker = f"{marks}/sourced-{i}"
        markers.append(marker)
        await rt.write(path, _planted(marker).encode())
    bash_env = f"{marks}/bash_env.sh"
    await rt.write(bash_env, _planted(f"{marks}/sourced-bash-env").encode())
    markers.append(f"{marks}/sourced-bash-env")
    # An inputrc that is a FIFO: a shell that opened it for reading would hang at its start.
    inputrcs = [f"{home}/.inputrc"] + (["/etc/inputrc"] if system else [])
    fifos = " ".join(shlex.quote(p) for p in inputrcs)
    history = f"{home}/.bash_history"
    made = await rt.exec(
        [
            "sh",
            "-c",
            f"rm -f {fifos} && mkfifo {fifos} && printf precious > {marks}/victim"
            f" && rm -f {history} && ln -s {marks}/victim {history}",
        ]
    )
    assert made.exit_code == 0, made
    return markers


async def _assert_untouched(rt: Runtime, home: str, marks: str, markers: list[str]) -> None:
    sourced = [m for m in markers if await rt.exists(m)]
    assert not sourced, f"planted startup files were read: {sourced}"
    assert await rt.read(f"{marks}/victim") == b"precious", "the history symlink was written"
    link = await rt.exec(["sh", "-c", f"readlink {home}/.bash_history"])
    assert link.stdout.strip() == f"{marks}/victim", "the history symlink was replaced"


async def _judge_commands(rt: Runtime, sh: ShellSession, marks: str) -> None:
    listing = await sh.run(f"ls {marks}", timeout=30)
    assert "hijacked" not in listing.stdout and "victim" in listing.stdout, listing
    said = await sh.run("echo honest; type echo", timeout=30)
    assert said.stdout.startswith("honest\necho is a shell builtin"), said
    # non-interactive shells the judge runs do not get BASH_ENV / ENV either
    nested = await sh.run("bash -c 'echo nested'; sh -c 'echo posix'", timeout=30)
    assert nested.stdout == "nested\nposix\n", nested
    assert (await sh.run("(exit 4)", timeout=30)).exit_code == 4


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
async def test_planted_startup_files_have_no_effect(hostile: Hostile) -> None:
    """A root policy plants root's and the system's bash startup files, inputrcs as FIFOs,
    a ``BASH_ENV`` file and a ``~/.bash_history`` symlink to a file it wants overwritten;
    the judge's session (root) reads none of them and writes no history."""
    async with open_runtime(hostile.config) as rt:
        marks = "/srv/vf-marks"
        await rt.exec(["mkdir", "-p", marks])
        markers = await _plant(rt, "/root", marks, system=True)
        env = {
            "BASH_ENV": f"{marks}/bash_env.sh",
            "ENV": f"{marks}/bash_env.sh",
            "HISTFILE": f"{marks}/victim",
            "PROMPT_COMMAND": f"touch {marks}/sourced-prompt-command",
        }
        markers.append(f"{marks}/sourced-prompt-command")
        async with rt.shell(env=env, start_timeout=15) as sh:
            await _judge_commands(rt, sh, marks)
        async with rt.shell(pty=True, env=env, start_timeout=15) as sh:
            typed = await sh.run("echo pty-honest", timeout=30)
            assert typed.stdout.replace("\r", "") == "pty-honest\n", typed
        await _assert_untouched(rt, "/root", marks, markers)


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", ["subprocess"], indirect=True)
async def test_planted_home_startup_files_have_no_effect(hostile: Hostile, tmp_path: Path) -> None:
    """The same in the sandbox user's home (a HOME of the test's own on the host)."""
    home, marks = tmp_path / "home", tmp_path / "marks"
    home.mkdir()
    marks.mkdir()
    async with open_runtime(hostile.config) as rt:
        markers = await _plant(rt, str(home), str(marks), system=False)
        # No BASH_ENV here: the host's python3 may be a bash script (a pyenv shim) that would
        # source it before the driver runs; the Docker test covers BASH_ENV.
        env = {"HOME": str(home), "HISTFILE": f"{marks}/victim"}
        async with rt.shell(env=env, start_timeout=15) as sh:
            await _judge_commands(rt, sh, str(marks))
        await _assert_untouched(rt, str(home), str(marks), markers)


# ---------------------------------------------------------------------- (d) tampering

# Commands that try to break the status reporting, and whether the session must survive
# them ("works") or may instead be declared dead ("works or dead").
_TAMPERING = {
    "PROMPT_COMMAND='echo hijacked'": "works",
    "unset PROMPT_COMMAND": "works",
    "unset -v PROMPT_COMMAND": "works",
    "declare +r PROMPT_COMMAND": "works",
    "declare -g PROMPT_COMMAND=true": "works",
    "PROMPT_COMMAND+=(true)": "works",
    "__vf_dir=/tmp": "works",
    "set -C": "works",
    "exec >/dev/null 2>&1": "works",
    "PS1='$(echo hijacked)'": "works",
    "stty echo </dev/tty": "works",
    "trap '' INT; sleep 30": "works",
    "exec 0</dev/null": "works or dead",
    "exec 0<&-": "works or dead",
    "trap '' INT; while :; do :; done": "works or dead",
    "shopt -s extdebug; trap false DEBUG": "works or dead",
    "__vf_seq=999999": "works or dead",
    "unset __vf_seq": "works or dead",
    "readonly __vf_seq": "works or dead",
    "alias builtin=true": "works or dead",
    "builtin() { :; }": "works or dead",
    "enable -n printf": "works or dead",
    "trap 'exit 9' DEBUG": "works or dead",
    "set -e; false": "works or dead",
    "TMOUT=1": "works or dead",
    "kill -STOP $$": "works or dead",
    "exec sleep 30": "works or dead",
}


# Tamperings that keep a CPU busy until the session kills them: run alone, after the others,
# so they cannot starve the others' answers past TIMEOUT on a two-core machine.
_CPU_BOUND = {"trap '' INT; while :; do :; done"}


async def _tampered(sh: ShellSession, command: str) -> str:
    """Run ``command``, then a command with a known result: what became of the session."""
    try:
        with contextlib.suppress(ExecTimeoutError):  # its own command may hang: fine
            await sh.run(command, timeout=TIMEOUT)
        if command.startswith("TMOUT"):
            await anyio.sleep(2.5)
        check = await sh.run("echo still-honest; (exit 6)", timeout=TIMEOUT)
    except ShellSessionError as exc:
        return f"dead: {exc.reason}"
    except ExecTimeoutError:
        return "HUNG: the check command timed out"
    fine = (check.exit_code, check.stdout) == (6, "still-honest\n")
    return "works" if fine else f"WRONG RESULT {check!r}"


async def _tamper(rt: Runtime, command: str, outcomes: dict[str, str]) -> None:
    started = time.monotonic()
    async with rt.shell(interrupt_grace=GRACE) as sh:
        outcomes[command] = await _tampered(sh, command)
    took = time.monotonic() - started
    if took > ANSWER_BOUND + (2.5 if command.startswith("TMOUT") else 0):
        outcomes[command] = f"SLOW ({took:.1f}s): {outcomes[command]}"


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", LOCAL, indirect=True)
async def test_tampering_with_status_reporting_never_gives_a_wrong_result(
    hostile: Hostile,
) -> None:
    outcomes: dict[str, str] = {}
    async with open_runtime(hostile.config) as rt:
        limiter = anyio.CapacityLimiter(8)

        async def limited(command: str) -> None:
            async with limiter:
                await _tamper(rt, command, outcomes)

        async with anyio.create_task_group() as tg:
            for command in _TAMPERING.keys() - _CPU_BOUND:
                tg.start_soon(limited, command)
        for command in _CPU_BOUND:
            await _tamper(rt, command, outcomes)
        # Running side by side is only for speed: on a loaded machine a session may miss its
        # deadlines and be declared dead. One that must keep working is judged again, alone.
        for command in _unexpected(outcomes):
            if _TAMPERING[command] == "works":
                await _tamper(rt, command, outcomes)
    print(json.dumps(outcomes, indent=1))  # the notes record which are defended / detected
    bad = {command: outcomes[command] for command in _unexpected(outcomes)}
    assert not bad, json.dumps(bad, indent=1)


def _unexpected(outcomes: dict[str, str]) -> list[str]:
    """The tamperings whose outcome is not one allowed for them."""
    return [
        command
        for command, allowed in _TAMPERING.items()
        if not (
            outcomes[command] == "works"
            or (allowed == "works or dead" and outcomes[command].startswith("dead: "))
        )
    ]


# ---------------------------------------------------------------------- a placed judge


@pytest.mark.attack(2, 11)
@pytest.mark.parametrize("hostile", [*LOCAL, "docker-user"], indirect=True)
async def test_persistent_shell_judge_keeps_its_verdict(
    hostile: Hostile, scripted_models: ModelsFactory
) -> None:
    """A ``bash`` judge with ``persistent_shell`` placed in the policy's sandbox runs
    ./run_tests, which forks a writer that waits to rewrite the verdict: the guard's sweep
    after each command ends the writer (and the session: the next command runs in a fresh one,
    the judge is told), and the collected verdict is the judge's own."""
    judge = name("ps")
    script = [
        bash_call(f"./run_tests; {WRITE_FAIL}{ALIVE}"),
        bash_call('sleep 2.5; echo "verdict at $VF_AGENT_VERDICT"'),
        reply("x"),
    ]
    models = scripted_models({judge: script})
    spec = bash_judge(judge).model_copy(
        update={"harness": {"id": "bash", "per_call_timeout": 30, "persistent_shell": True}}
    )
    async with open_runtime(hostile.config) as rt:
        await plant_policy(rt, hostile, detached(1.0, judge))
        runs, error = await judge_once(rt, spec, models)
        assert error is None, error
        assert re.search(r"writers=[1-9]", tool_output(runs[0], 0)), "control: no writer ran"
        second = tool_output(runs[0], 1)
        assert second.startswith("note: the shell session had ended"), second
        assert "verdict at /" in second, "the fresh session lost the judge's shell variables"
        assert runs[0].verdict == {"passed": False}, "the policy's writer forged the verdict"
        assert await forged(rt) == []


# ---------------------------------------------------------------------- (f) a replaced driver

# What a policy that replaced the sandbox's python3 answers a session with (played by putting a
# fake python3 first on the session's PATH): a frame header announcing 4 GiB, then an endless
# stream; or a READY whose pid is not a number.
_FAKE_DRIVERS = {
    "flood": "printf 'S\\377\\377\\377\\377'; exec cat /dev/zero \"$0\"\n",
    "garbled": "printf 'S\\000\\000\\000\\003abc'; exec cat \"$0\" /dev/stdin\n",
}


@pytest.mark.attack(7, 11)
@pytest.mark.parametrize("hostile", LOCAL, indirect=True)
@pytest.mark.parametrize("fake", sorted(_FAKE_DRIVERS))
async def test_a_replaced_driver_is_refused_in_bounded_host_memory(
    hostile: Hostile, fake: str
) -> None:
    import tracemalloc

    async with open_runtime(hostile.config) as rt:
        fake_bin = f"{rt.workdir}/fake-bin"
        await rt.write(f"{fake_bin}/python3", "#!/bin/sh\n" + _FAKE_DRIVERS[fake])
        assert (await rt.exec(["chmod", "+x", f"{fake_bin}/python3"])).exit_code == 0
        path = (await rt.exec(["sh", "-c", 'printf %s "$PATH"'])).stdout
        tracemalloc.start()
        try:
            started = time.monotonic()
            with pytest.raises(ShellSessionError) as caught:
                async with rt.shell(env={"PATH": f"{fake_bin}:{path}"}, start_timeout=20):
                    pass
            took = time.monotonic() - started
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert "broke its protocol" in caught.value.reason, caught.value.reason
        assert took < 15, f"refused only after {took:.1f}s"
        assert peak < 32 << 20, f"the host buffered {peak >> 20} MiB of the fake driver's frame"
        assert await _no_fake_left(rt, fake_bin), "the fake driver was left running"
        assert (await rt.exec(["echo", "still usable"])).stdout == "still usable\n"


async def _no_fake_left(rt: Runtime, fake_bin: str) -> bool:
    for _ in range(40):
        ps = await rt.exec(["ps", "-eo", "args"])
        if not any(fake_bin in line for line in ps.stdout.splitlines()):
            return True
        await anyio.sleep(0.05)
    return False


@pytest.mark.attack(11)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
async def test_a_bash_planted_in_the_workdir_is_not_the_sessions_shell(hostile: Hostile) -> None:
    """A PATH with an empty entry (the current directory, the workdir where the session
    starts): the policy's ./bash there is not what the driver runs. (Not played on the
    subprocess target: there python3 may itself be a bash script, a pyenv shim, which `env`
    finds through that same entry — any exec with such a PATH would; see docs/shell.md.)"""
    async with open_runtime(hostile.config) as rt:
        marker = f"{rt.workdir}/planted-bash-ran"
        await rt.write("bash", f'#!/bin/sh\ntouch {marker}\nexec /bin/sh "$@"\n')
        assert (await rt.exec(["chmod", "+x", "bash"])).exit_code == 0
        path = (await rt.exec(["sh", "-c", 'printf %s "$PATH"'])).stdout
        async with rt.shell(env={"PATH": f":{path}"}) as sh:
            result = await sh.run('echo "$BASH_VERSION"', timeout=30)
        assert result.exit_code == 0 and result.stdout.strip(), result
        assert not await rt.exists(marker), "the session ran the policy's ./bash"
