"""The in-sandbox shell driver on its own: started with the local ``python3`` exactly as a
session ships it (through the channel agent's bootstrap, ``python3 -I -S -B -c BOOTSTRAP``,
its source and then the key on stdin), spoken to in authenticated frames over its stdin and
stdout. What these pin down is the driver's half of the contract: statuses, interrupts and
their escalation, death, the terminal, cleanup, and the defences of docs/shell.md."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimes.channel import bootstrap
from runtimes.channel.agent.codec import Sealer
from runtimes.shell import protocol

PYTHON = "/usr/bin/python3"
"""The system interpreter (readable by ``nobody``, and no pyenv shim in between)."""


class Driver:
    """A driver process and a blocking frame reader."""

    def __init__(
        self,
        *,
        pty: bool = False,
        grace: float = 0.5,
        env: dict[str, str] | None = None,
        rows: int = 24,
        cols: int = 80,
        user: str | None = None,
    ) -> None:
        self.link = protocol.Link(pty=pty, rows=rows, cols=cols, grace=grace)
        self.proc = subprocess.Popen(
            protocol.driver_command(PYTHON),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env if env is not None else {"PATH": os.environ["PATH"]},
            user=user,
            cwd="/",
        )
        self.write(self.link.opening())
        self.pending: list[tuple[int, bytes]] = []

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, kind: int, payload: bytes = b"") -> None:
        self.write(self.link.seal(kind, payload))

    def frame(self, timeout: float = 10.0) -> tuple[int, bytes]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while not self.pending:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(left, 0))
            if not ready:
                raise AssertionError("the driver said nothing in time")
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                raise AssertionError("the driver's stdout ended")
            reply, frames = self.link.feed(chunk)
            if reply:
                self.write(reply)
            self.pending += frames
        return self.pending.pop(0)

    def ready(self) -> int:
        kind, payload = self.frame()
        assert kind == protocol.READY, (kind, payload)
        return int(payload)

    def run(
        self, command: str, *, interrupt_after: float | None = None, timeout: float = 10.0
    ) -> tuple[int, bytes, bytes, bytes]:
        """(final frame kind, stdout, stderr, final payload)."""
        self.send(protocol.RUN, command.encode())
        if interrupt_after is not None:
            time.sleep(interrupt_after)
            self.send(protocol.INTERRUPT)
        out, err = bytearray(), bytearray()
        while True:
            kind, payload = self.frame(timeout)
            if kind == protocol.OUT:
                out += payload
            elif kind == protocol.ERR:
                err += payload
            else:
                return kind, bytes(out), bytes(err), payload

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError):
                self.send(protocol.QUIT)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def driver() -> Iterator[Driver]:
    d = Driver()
    d.ready()
    yield d
    d.close()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_state_persists_and_statuses_are_exact(driver: Driver) -> None:
    assert driver.run("cd /tmp && export A=x && f() { echo f$1; }")[0] == protocol.END
    kind, out, err, code = driver.run("pwd; f 1; echo $A >&2; (exit 7)")
    assert (kind, out, err, code) == (protocol.END, b"/tmp\nf1\n", b"x\n", b"7")


def test_declare_in_a_command_stays_global(driver: Driver) -> None:
    driver.run("declare -A M=([k]=v)")
    assert driver.run('echo "${M[k]}"')[1] == b"v\n"


def test_output_is_byte_exact_and_long_commands_pass(driver: Driver) -> None:
    out = driver.run("printf '\\xff\\x00\\xc3\\xa9'")[1]
    assert out == b"\xff\x00\xc3\xa9"
    long_line = "echo " + "y" * 20000
    assert driver.run(long_line)[1] == b"y" * 20000 + b"\n"
    heredoc = "cat <<'EOF'\nline $1\n  two\nEOF"
    assert driver.run(heredoc)[1] == b"line $1\n  two\n"


def test_big_output_is_all_forwarded(driver: Driver) -> None:
    _, out, _, code = driver.run("head -c 3000000 /dev/zero")
    assert (len(out), code) == (3_000_000, b"0")


def test_syntax_errors_are_a_status_not_a_hang(driver: Driver) -> None:
    kind, _, err, code = driver.run("echo 'unterminated")
    assert kind == protocol.END and code != b"0" and err
    assert driver.run("echo fine")[1] == b"fine\n"


def test_sigint_interrupts_a_program_a_builtin_loop_and_a_list(driver: Driver) -> None:
    for command in ("sleep 30", "while true; do :; done", "while true; do sleep 1; done"):
        started = time.monotonic()
        kind, _, _, code = driver.run(command, interrupt_after=0.2)
        assert (kind, code) == (protocol.END, b"130"), command
        assert time.monotonic() - started < 2
    kind, out, _, code = driver.run("sleep 30; echo after", interrupt_after=0.2)
    assert (kind, code) == (protocol.END, b"130") and b"after" not in out
    assert driver.run("echo alive")[1] == b"alive\n"


def test_a_program_ignoring_sigint_is_killed_after_the_grace(driver: Driver) -> None:
    ignore = (
        f"{PYTHON} -S -c 'import signal,time; signal.signal(2, signal.SIG_IGN); time.sleep(60)'"
    )
    for command in (ignore, f"while true; do {ignore}; done"):
        started = time.monotonic()
        kind, _, _, code = driver.run(command, interrupt_after=0.5)  # python is up by then
        took = time.monotonic() - started
        assert (kind, code) == (protocol.END, b"137"), command
        assert 0.9 <= took < 3.5, took  # grace 0.5 s after the interrupt
    assert driver.run("echo alive")[1] == b"alive\n"


def test_a_shell_that_cannot_be_interrupted_is_declared_dead() -> None:
    d = Driver(grace=0.3)
    pid = d.ready()
    try:
        kind, _, _, reason = d.run("trap '' INT; while :; do :; done", interrupt_after=0.2)
        assert kind == protocol.DEAD and b"could not be interrupted" in reason
        assert d.proc.wait(timeout=5) == 0
        assert not _alive(pid)
    finally:
        d.close()


def test_exit_and_exec_are_the_sessions_death() -> None:
    for command, status in (("exit 4", b"status 4"), ("exec true", b"status 0")):
        d = Driver()
        d.ready()
        try:
            kind, _, _, reason = d.run(command)
            assert kind == protocol.DEAD and status in reason, reason
        finally:
            d.close()


def test_quit_kills_every_job_and_removes_the_control_dir() -> None:
    d = Driver()
    d.ready()
    _, out, _, _ = d.run("sleep 300 & echo $! $__vf_dir; disown")
    job, control = out.decode().split()
    assert Path(control).is_dir()
    assert Path(control).stat().st_mode & 0o777 == 0o700
    d.close()
    assert not _alive(int(job))
    assert not Path(control).exists()


def test_a_closed_stdin_ends_the_driver_like_quit() -> None:
    d = Driver()
    pid = d.ready()
    assert d.proc.stdin is not None
    d.proc.stdin.close()
    assert d.proc.wait(timeout=5) == 0
    assert not _alive(pid)
    d.proc.stdout.close()  # type: ignore[union-attr]


def test_a_status_forged_by_a_background_job_is_not_accepted(driver: Driver) -> None:
    """A job of the command itself (it knows the control dir and the command's nonce) writes
    a status line while the command still holds the terminal: the driver waits for the real
    end (the shell must hold the terminal again)."""
    forge = '(sleep 0.3; echo "0 $__vf_seq" > "$__vf_dir/status") & sleep 1.5; echo real; false'
    started = time.monotonic()
    kind, out, _, code = driver.run(forge)
    assert (kind, code, out) == (protocol.END, b"1", b"real\n")
    assert time.monotonic() - started >= 1.4


def test_statuses_without_the_nonce_and_junk_do_not_end_a_command(driver: Driver) -> None:
    """A leftover that can write the status FIFO but does not know the nonce guesses while
    the shell itself holds the terminal (a builtin loop), and leaves junk with no newline."""
    control = driver.run("echo $__vf_dir")[1].decode().strip()
    status = os.open(f"{control}/status", os.O_WRONLY | os.O_NONBLOCK)
    try:
        driver.send(protocol.RUN, b"for i in $(seq 200000); do :; done; echo done; (exit 4)")
        for guess in range(64):
            os.write(status, b"0 %d\n" % guess)
        os.write(status, b"junk without a newline")
        out = bytearray()
        while (frame := driver.frame())[0] == protocol.OUT:
            out += frame[1]
        assert frame == (protocol.END, b"4") and out == b"done\n"
        assert driver.run("echo next")[1] == b"next\n"
    finally:
        os.close(status)


def test_the_control_dir_ignores_tmpdir(tmp_path: Path) -> None:
    """$TMPDIR may point into the policy's files, where our directory could be renamed
    away and replaced: the control dir goes under the root-owned sticky /tmp."""
    d = Driver(env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)})
    d.ready()
    try:
        control = d.run("echo $__vf_dir")[1].decode().strip()
        assert os.path.dirname(control) == "/tmp" and not list(tmp_path.iterdir())
    finally:
        d.close()


def test_startup_variables_do_not_run_and_history_is_off(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    history = tmp_path / "history"
    env = {
        "PATH": "/usr/bin:/bin",  # not a pyenv shim: a bash script would source BASH_ENV
        "BASH_ENV": str(planted),
        "ENV": str(planted),
        "PROMPT_COMMAND": f"touch {tmp_path}/prompt",
        "HISTFILE": str(history),
    }
    planted.write_text(f"touch {tmp_path}/sourced\n")
    d = Driver(env=env)
    d.ready()
    try:
        d.run("echo secret-command; bash -c true")
        assert d.run("echo ${HISTFILE-unset}")[1] == b"unset\n"
    finally:
        d.close()
    assert not (tmp_path / "sourced").exists()
    assert not (tmp_path / "prompt").exists()
    assert not history.exists()


def test_no_bash_is_reported(tmp_path: Path) -> None:
    d = Driver(env={"PATH": str(tmp_path)})
    try:
        kind, reason = d.frame()
        assert kind == protocol.DEAD and b"no bash" in reason
    finally:
        d.close()


def test_a_command_cannot_open_the_drivers_stdout_to_forge_frames() -> None:
    """The attack: a command (same uid as the driver) opens /proc/<driver>/fd/1 and writes
    frames of its own. The driver is non-dumpable, so the kernel refuses the open."""
    d = Driver(user="nobody", env={"PATH": "/usr/bin:/bin"})
    d.ready()
    try:
        probe = f"exec 3>/proc/{d.proc.pid}/fd/1 && echo opened || echo refused"
        kind, out, err, _ = d.run(probe)
        assert kind == protocol.END and out == b"refused\n", (out, err)
        assert b"Permission denied" in err
    finally:
        d.close()


def test_pty_mode_merges_output_on_a_terminal_of_the_given_size() -> None:
    d = Driver(pty=True, rows=30, cols=100)
    d.ready()
    try:
        kind, out, err, code = d.run("tty; stty size; echo oops >&2")
        assert kind == protocol.END and err == b"" and code == b"0"
        lines = out.split(b"\r\n")
        assert lines[0].startswith(b"/dev/pts/") and lines[1:3] == [b"30 100", b"oops"]
        d.send(protocol.RESIZE, protocol.resize_payload(40, 120))
        assert d.run("stty size")[1] == b"40 120\r\n"
        d.send(protocol.RUN, b"read -r line; echo got:$line")
        d.send(protocol.INPUT, b"hello\n")
        out2 = bytearray()
        while (frame := d.frame())[0] == protocol.OUT:
            out2 += frame[1]
        assert frame == (protocol.END, b"0") and out2 == b"got:hello\r\n"
    finally:
        d.close()


def test_typed_input_the_command_did_not_read_never_runs_as_a_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    d = Driver(pty=True)
    d.ready()
    try:
        d.send(protocol.RUN, b"true")
        d.send(protocol.INPUT, f"touch {marker}\n".encode())
        assert d.frame() == (protocol.END, b"0")
        assert d.run("echo next")[1] == b"next\r\n"
    finally:
        d.close()
    assert not marker.exists()


def test_a_killed_driver_takes_the_shell_and_its_jobs_down() -> None:
    """The driver's exec cancelled (SIGKILL, no cleanup): the terminal's hangup ends bash,
    and bash hangs up its jobs."""
    d = Driver()
    shell = d.ready()
    job_text, control = d.run("sleep 300 >/dev/null 2>&1 & echo $! $__vf_dir")[1].split()
    job = int(job_text)
    d.proc.kill()
    d.proc.wait()
    shutil.rmtree(control)  # no driver left to remove it: the sandbox's own cleanup does
    deadline = time.monotonic() + 5
    while (_alive(shell) or _alive(job)) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not _alive(shell) and not _alive(job)
    finally:
        d.close()


def test_the_driver_and_the_host_agree_on_the_frame_numbers() -> None:
    from runtimes.shell import driver

    names = ("RUN", "INPUT", "INTERRUPT", "RESIZE", "QUIT", "READY", "OUT", "ERR", "END", "DEAD")
    for name in (*names, "OPEN", "GREET"):
        assert getattr(driver, name) == getattr(protocol, name), name
    for fields in ("OPEN_FIELDS", "VERSION_FIELD"):
        assert getattr(driver, fields).format == getattr(protocol, fields).format, fields
    assert driver.SHELL_VERSION == protocol.VERSION


def test_the_driver_shadows_no_name_of_the_parts_joined_before_it() -> None:
    """The driver's source is wire.py, codec.py, then driver.py in one namespace: a top-level
    name of the driver's that is also one of theirs would change what their code uses."""
    import ast

    def top_level(path: Path) -> set[str]:
        names = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                names.add(node.name)
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                names |= (
                    {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if target else set()
                )
        return names

    *shared, own = protocol.DRIVER_PARTS
    assert not top_level(own) & set().union(*(top_level(p) for p in shared))


def _handshake(version: int) -> tuple[subprocess.Popen[bytes], protocol.FrameParser, bytes]:
    """A driver keyed by hand whose OPEN says ``version``; (process, parser, its stdout)."""
    proc = subprocess.Popen(
        protocol.driver_command(PYTHON),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
        cwd="/",
    )
    key = os.urandom(protocol.KEY)
    opening = protocol.open_payload(pty=False, rows=24, cols=80, grace=0.5, version=version)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(protocol.driver_source())
    proc.stdin.flush()
    assert proc.stdout.read(len(bootstrap.READY)) == bootstrap.READY
    proc.stdin.write(key + Sealer(key).seal(protocol.OPEN, 0, opening))
    proc.stdin.close()
    out = proc.stdout.read()
    proc.wait(timeout=10)
    proc.stdout.close()
    return proc, protocol.FrameParser(key), out


def test_an_open_of_another_protocol_version_is_refused() -> None:
    proc, parser, out = _handshake(protocol.VERSION - 1)
    frames = parser.feed(out)
    assert frames[0] == (protocol.GREET, protocol.VERSION_FIELD.pack(protocol.VERSION))
    assert frames[1][0] == protocol.DEAD and b"version 1" in frames[1][1], frames
    assert len(frames) == 2 and proc.returncode == 0


def test_a_greeting_of_another_protocol_version_is_refused() -> None:
    link = protocol.Link(pty=False, rows=24, cols=80, grace=1.0)
    reply, frames = link.feed(bootstrap.READY)
    assert frames == [] and len(reply) > protocol.KEY
    greet = Sealer(reply[: protocol.KEY]).seal(
        protocol.GREET, 0, protocol.VERSION_FIELD.pack(protocol.VERSION + 1)
    )
    with pytest.raises(protocol.DriverProtocolError, match=f"version {protocol.VERSION + 1}"):
        link.feed(greet)


def test_a_frame_the_host_did_not_seal_kills_the_session(driver: Driver) -> None:
    """Bytes written to the driver's stdin by anyone but the host (no key) are refused: the
    driver says why and ends the session."""
    driver.write(Sealer(os.urandom(protocol.KEY)).seal(protocol.RUN, 0, b"echo forged"))
    kind, payload = driver.frame()
    assert kind == protocol.DEAD and b"did not send" in payload, payload
    assert driver.proc.wait(timeout=5) == 0
