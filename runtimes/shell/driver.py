"""The in-sandbox half of a shell session: a standard-library program (Python >= 3.8), joined
after the channel agent's :mod:`~runtimes.channel.agent.wire` and
:mod:`~runtimes.channel.agent.codec` into one source and shipped through the agent's bootstrap
(:mod:`runtimes.channel.bootstrap`) by :mod:`runtimes.shell.session`. It imports nothing else
of ``runtimes`` (its relative imports are dropped by the joining), and defines no top-level
name of those two.

It forks an interactive ``bash`` on a new pty (job control on, the pty its controlling terminal,
echo off, no startup files, no history) and talks to the host over its own stdin/stdout in the
channel's authenticated frames (:mod:`runtimes.shell.protocol` holds the host's copy of the
frame kinds): the key first (the bootstrap made the process non-dumpable before the host sent
it), then the host's ``OPEN`` (protocol version, terminal, grace), after this driver's ``GREET``.

A command is written to ``<dir>/cmd`` and run by the line
``__vf_seq=NONCE; { . <dir>/cmd; } </dev/null ><dir>/out 2><dir>/err`` sent to the terminal
(pty mode: no redirections, the terminal is the output); ``<dir>`` is a private 0700
directory (under a root-owned sticky ``/tmp``, never ``$TMPDIR``: :func:`safe_parent`)
holding FIFOs the driver reads (and keeps a write end of, so it never sees EOF). The
command's end is the status line ``$? NONCE`` that the readonly ``PROMPT_COMMAND`` writes to
``<dir>/status``, accepted only with the random nonce of the command in flight and when the
shell holds the terminal again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import select
import signal
import stat
import struct
import tempfile
import termios
import time
from collections.abc import Mapping
from typing import NoReturn

from ..channel.agent.codec import FrameError, Opener, Sealer
from ..channel.agent.wire import KEY

SHELL_VERSION = 2
"""The shell protocol's version (:data:`runtimes.shell.protocol.VERSION`)."""
OPEN_FIELDS = struct.Struct(">IBHHd")
VERSION_FIELD = struct.Struct(">I")
# host -> driver
OPEN = 0x4E  # N: the first frame: version u32, pty u8, rows u16, cols u16, grace f64
RUN = 0x52  # R: payload the command's bytes
INPUT = 0x49  # I: bytes for the terminal (pty mode)
INTERRUPT = 0x43  # C: interrupt the command in flight
RESIZE = 0x57  # W: rows u16, cols u16
QUIT = 0x51  # Q: end the session
# driver -> host
GREET = 0x48  # H: the first frame: the driver's version u32
READY = 0x53  # S: the shell is ready; payload its pid
OUT = 0x4F  # O: stdout bytes (pty mode: everything the terminal wrote)
ERR = 0x45  # E: stderr bytes
END = 0x58  # X: the command ended; payload its status as ASCII
DEAD = 0x44  # D: the session is dead; payload the reason, UTF-8

READ_SIZE = 65536
MAX_COMMAND = 1 << 30
"""The longest frame the driver takes from the host (a command's bytes)."""
RETRY = 0.05
RESET_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGTERM, signal.SIGPIPE)
"""Set to their defaults for bash, which hands them on to its jobs as it got them."""
DEATH_MARGIN = 3.0
"""Seconds after the SIGKILL step (at least) before a command that still has not given the
shell back is declared uninterruptible and the session killed."""
SAFE_PARENTS = ("/tmp", "/var/tmp", "/dev/shm")
NO_SAFE_PARENT = (
    "no safe directory for the session's control files: none of /tmp, /var/tmp, /dev/shm is "
    "a real directory owned by root (or this user) and sticky or closed to others"
)
STATUS_MAX = 64
CLEAN_ENV = ("BASH_ENV", "ENV", "PROMPT_COMMAND", "PS0", "PS1", "PS2", "TMOUT", "HISTFILE")


def quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


def find_bash(env: Mapping[str, str]) -> str | None:
    """``bash`` on the absolute directories of PATH: an empty or relative entry would be the
    workdir, where the policy may have left a ``bash`` of its own."""
    for folder in env.get("PATH", "/usr/local/bin:/usr/bin:/bin").split(":"):
        if not folder.startswith("/"):
            continue
        path = os.path.join(folder, "bash")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def safe_parent() -> str | None:
    """Where the control directory may go: a directory no other account can rename our
    directory out of or replace (``$TMPDIR`` may point into the policy's files)."""
    for candidate in SAFE_PARENTS:
        ancestors = [candidate[:i] or "/" for i, c in enumerate(candidate) if c == "/"]
        if all(trusted_dir(path) for path in [*ancestors, candidate]):
            return candidate
    return None


def trusted_dir(path: str) -> bool:
    """A real directory (no link), ours or root's, that others cannot write (or sticky)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(info.st_mode) or info.st_uid not in (0, os.geteuid()):
        return False
    return not info.st_mode & 0o022 or bool(info.st_mode & stat.S_ISVTX)


def set_window(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


def echo_off(fd: int) -> None:
    attrs = termios.tcgetattr(fd)
    attrs[3] &= ~(termios.ECHO | termios.ECHONL)
    termios.tcsetattr(fd, termios.TCSANOW, attrs)


class Host:
    """Authenticated frames in from stdin, out to stdout (request id 0)."""

    def __init__(self, key: bytes) -> None:
        self.sealer = Sealer(key)
        self.opener = Opener(key, MAX_COMMAND)
        self.eof = False
        self.backlog: list[tuple[int, bytes]] = []
        """Frames read with the ``OPEN`` frame, handled once the session serves."""

    def send(self, kind: int, payload: bytes = b"") -> None:
        view = memoryview(self.sealer.seal(kind, 0, payload))
        while view:
            try:
                n = os.write(1, view)
            except InterruptedError:
                continue
            view = view[n:]

    def read_frames(self) -> list[tuple[int, bytes]]:
        """The frames one read completed.

        Raises:
            FrameError: a frame the host did not write (something else writes to stdin).
        """
        chunk = os.read(0, READ_SIZE)
        if not chunk:
            self.eof = True
            return []
        return [(kind, payload) for kind, _, payload in self.opener.feed(chunk)]

    def first_frame(self) -> tuple[int, bytes] | None:
        """The host's first frame (the others read with it wait in ``backlog``); None at EOF."""
        while not self.backlog and not self.eof:
            self.backlog += self.read_frames()
        return self.backlog.pop(0) if self.backlog else None


class Session:
    def __init__(
        self, host: Host, parent: str, use_pty: bool, rows: int, cols: int, grace: float
    ) -> None:
        self.host = host
        self.use_pty = use_pty
        self.grace = grace
        self.dir = tempfile.mkdtemp(prefix="vf-shell-", dir=parent)
        self.fifos: dict[str, int] = {}
        self.writers: list[int] = []
        for name in ("out", "err", "status"):
            self.fifos[name] = self.make_fifo(name, os.O_RDONLY | os.O_NONBLOCK)
            # a write end of our own: never EOF, select wakes only on data
            self.writers.append(os.open(self.join(name), os.O_WRONLY | os.O_NONBLOCK))
        self.ack = self.make_fifo("ack", os.O_RDWR | os.O_NONBLOCK) if use_pty else -1
        self.status_buf = b""
        self.pending = b""  # bytes waiting to go to the terminal
        self.nonce = secrets.token_hex(8)  # of the line typed last: only bash knows it
        self.running = False
        self.ready = False
        self.kill_at: float | None = None
        self.dead_at: float | None = None
        self.bash = -1  # set by start()
        self.master = -1
        self.terminal = -1
        self.bash_status = 0
        self.rows, self.cols = rows, cols

    # ---------------------------------------------------------------- start

    def start(self, bash: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
        env.setdefault("TERM", "xterm" if self.use_pty else "dumb")
        master, terminal = os.openpty()
        pid = os.fork()
        if pid == 0:  # the child: becomes bash, the pty its controlling terminal
            try:
                os.setsid()
                fcntl.ioctl(terminal, termios.TIOCSCTTY, 0)
                for fd in (0, 1, 2):
                    os.dup2(terminal, fd)
                # a host under nohup hands its commands SIGINT and SIGHUP ignored: a Ctrl-C or
                # the pty's hangup must reach the shell's jobs whatever the driver inherited
                for sig in RESET_SIGNALS:
                    signal.signal(sig, signal.SIG_DFL)
                echo_off(0)
                set_window(0, self.rows, self.cols)
                os.execve(bash, ["bash", "--noprofile", "--norc", "--noediting", "-i"], env)
            finally:
                os._exit(127)
        # the driver keeps the terminal's side too, to flush what was typed and not read
        self.bash, self.master, self.terminal = pid, master, terminal
        echo_off(master)
        set_window(master, self.rows, self.cols)
        os.set_blocking(master, False)
        status = quote(os.path.join(self.dir, "status"))
        # the leading newline ends any junk a program left in the FIFO
        report = 'builtin printf "\\n%s %s\\n" "$?" "${__vf_seq-}" >' + status
        if self.use_pty:
            # wait for the driver to flush unread input (it would run as the next command
            # line); keep the prompt empty (a venv's "(venv) " would land in the output)
            report += f"; builtin read -r __vf_ack <{self.path('ack')}; PS1='' PS2=''"
        init = (
            "PS1='' PS2='' PS0=''\n"
            "set +o history\n"
            "unset HISTFILE\n"
            # a terminal hangup (the driver killed) may end bash as an EOF, which does not
            # hang up its jobs: do it on every exit
            "trap 'for __vf_job in $(builtin jobs -p); do builtin kill -HUP -- -$__vf_job;"
            " done 2>/dev/null' EXIT\n"
            f"readonly __vf_dir={quote(self.dir)}\n"
            f"readonly PROMPT_COMMAND={quote(report)}\n"
        )
        self.write_file("init", init.encode())
        self.type_line(f"__vf_seq={self.nonce}; . {self.path('init')}")

    def join(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def make_fifo(self, name: str, flags: int) -> int:
        os.mkfifo(self.join(name), 0o600)
        return os.open(self.join(name), flags)

    def path(self, name: str) -> str:
        """``<dir>/name``, quoted for bash."""
        return quote(os.path.join(self.dir, name))

    def write_file(self, name: str, data: bytes) -> None:
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def type_line(self, line: str) -> None:
        self.pending += line.encode() + b"\n"
        self.flush_terminal()

    def flush_terminal(self) -> None:
        while self.pending:
            try:
                n = os.write(self.master, self.pending[:4096])
            except BlockingIOError:
                return
            except OSError:  # the terminal is gone: bash's end is reported by wait
                self.pending = b""
                return
            self.pending = self.pending[n:]

    # ---------------------------------------------------------------- commands

    def run(self, command: bytes) -> None:
        if self.running:
            return
        self.nonce = secrets.token_hex(8)
        self.write_file("cmd", command)
        line = f"__vf_seq={self.nonce}; {{ . {self.path('cmd')}; }}"
        if not self.use_pty:
            line += f" </dev/null >{self.path('out')} 2>{self.path('err')}"
        self.running = True
        self.kill_at = self.dead_at = None
        self.type_line(line)

    def foreground(self) -> int | None:
        try:
            return os.tcgetpgrp(self.master)
        except OSError:
            return None

    def interrupt(self) -> None:
        if not self.running or self.kill_at is not None:
            return
        self.signal_foreground(signal.SIGINT)
        self.kill_at = time.monotonic() + self.grace

    def signal_foreground(self, sig: signal.Signals) -> None:
        group = self.foreground()
        if group is None or group <= 1:
            return
        with contextlib.suppress(OSError):
            os.killpg(group, sig)

    def escalate(self, now: float) -> None:
        """After the grace: SIGKILL the foreground job and SIGINT bash, again every
        ``RETRY`` seconds (a loop around a program that ignores SIGINT starts the next one;
        bash aborts the loop only if the SIGINT reaches it between two programs), until a
        status arrives or ``dead_at``."""
        if self.kill_at is not None and now >= self.kill_at:
            self.kill_at = now + RETRY
            if self.dead_at is None:  # a starved machine may take seconds to reap and re-prompt
                self.dead_at = now + max(self.grace, DEATH_MARGIN)
            group = self.foreground()
            if group is not None and group != self.bash:
                self.signal_foreground(signal.SIGKILL)
            with contextlib.suppress(OSError):
                os.kill(self.bash, signal.SIGINT)
        if self.dead_at is not None and now >= self.dead_at:
            self.die("the command could not be interrupted; the session was killed")

    def on_status(self) -> None:
        try:
            chunk = os.read(self.fifos["status"], READ_SIZE)
        except BlockingIOError:
            return
        self.status_buf += chunk
        while b"\n" in self.status_buf:
            line, self.status_buf = self.status_buf.split(b"\n", 1)
            self.on_status_line(line)
        if len(self.status_buf) > STATUS_MAX:  # no status line is this long: a flood
            self.status_buf = b""

    def on_status_line(self, line: bytes) -> None:
        parts = line.split()
        if len(parts) != 2 or not parts[0].isdigit() or parts[1] != self.nonce.encode():
            return  # junk, or a forgery: the nonce is in no file and no environment
        if self.foreground() != self.bash:
            return  # not the shell's own prompt: a forgery from a job
        if self.use_pty:
            termios.tcflush(self.terminal, termios.TCIFLUSH)
            os.write(self.ack, b"\n")
        code = int(parts[0])
        if not self.ready:
            self.ready = True
            self.drain_all(forward=False)
            self.host.send(READY, str(self.bash).encode())
            return
        if not self.running:
            return  # bash prompted again (a SIGINT between commands)
        self.drain_all(forward=True)
        self.running = False
        self.kill_at = self.dead_at = None
        self.host.send(END, str(code).encode())

    # ---------------------------------------------------------------- output

    def forward(self, fd: int, kind: int) -> bool:
        """One read from ``fd``; False when it had nothing."""
        try:
            data = os.read(fd, READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # EIO: the terminal's last user is gone
            return False
        if not data:
            return False
        if self.running and self.ready:
            self.host.send(kind, data)
        return True

    def drain_all(self, forward: bool) -> None:
        sources = [(self.fifos["out"], OUT), (self.fifos["err"], ERR)]
        if self.use_pty:
            sources.append((self.master, OUT))
        else:  # the terminal only has bash's own noise (prompts, job notices)
            while self.forward_discard(self.master):
                pass
        for fd, kind in sources:
            if not forward:
                while self.forward_discard(fd):
                    pass
                continue
            while self.forward(fd, kind):
                pass

    def forward_discard(self, fd: int) -> bool:
        try:
            return bool(os.read(fd, READ_SIZE))
        except OSError:
            return False

    def on_master(self) -> None:
        if self.use_pty:
            self.forward(self.master, OUT)
        else:
            self.forward_discard(self.master)

    # ---------------------------------------------------------------- the end

    def bash_exited(self) -> bool:
        try:
            pid, status = os.waitpid(self.bash, os.WNOHANG)
        except ChildProcessError:
            return True
        if pid == 0:
            return False
        if os.WIFSIGNALED(status):
            self.bash_status = 128 + os.WTERMSIG(status)
        else:
            self.bash_status = os.WEXITSTATUS(status)
        return True

    def die(self, reason: str) -> NoReturn:
        if self.running:
            self.drain_all(forward=True)
        self.host.send(DEAD, reason.encode("utf-8", "replace"))
        self.cleanup()
        os._exit(0)

    def cleanup(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.bash, signal.SIGHUP)
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline and not self.bash_exited():
            time.sleep(0.01)
        self.kill_session()
        for name in ("out", "err", "status", "ack", "cmd", "init"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.dir, name))
        with contextlib.suppress(OSError):
            os.rmdir(self.dir)

    def kill_session(self) -> None:
        """SIGKILL every process in bash's session (its jobs, their children)."""
        for _ in range(3):
            found = False
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/stat", "rb") as stat:
                        fields = stat.read().rsplit(b")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[3]) == self.bash:  # field 6: session id
                    found = True
                    with contextlib.suppress(OSError):
                        os.kill(int(entry), signal.SIGKILL)
            if not found:
                return
            time.sleep(0.01)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass


def serve(session: Session, host: Host, wake: int) -> None:
    for kind, payload in host.backlog:
        handle(session, kind, payload)
    host.backlog = []
    while True:
        readers = [0, session.master, wake, *session.fifos.values()]
        writers = [session.master] if session.pending else []
        now = time.monotonic()
        waits = [t - now for t in (session.kill_at, session.dead_at) if t is not None]
        timeout = max(0.0, min(waits)) if waits else None
        try:
            readable, writable, _ = select.select(readers, writers, [], timeout)
        except InterruptedError:
            continue
        if writable:
            session.flush_terminal()
        if session.fifos["out"] in readable:
            session.forward(session.fifos["out"], OUT)
        if session.fifos["err"] in readable:
            session.forward(session.fifos["err"], ERR)
        if session.master in readable:
            session.on_master()
        if session.fifos["status"] in readable:
            session.on_status()
        if wake in readable:
            with contextlib.suppress(OSError):
                os.read(wake, 512)
            if session.bash_exited():
                what = f"the shell exited with status {session.bash_status}"
                if not session.ready:
                    what = f"the shell exited before it was ready (status {session.bash_status})"
                session.die(what)
        if 0 in readable:
            try:
                frames = host.read_frames()
            except FrameError as exc:
                session.die(f"a frame the host did not send: {exc}")
            for kind, payload in frames:
                handle(session, kind, payload)
            if host.eof:
                session.cleanup()
                return
        session.escalate(time.monotonic())


def handle(session: Session, kind: int, payload: bytes) -> None:
    if kind == RUN:
        session.run(payload)
    elif kind == INPUT:
        if session.running:  # typed after the command ended, it would run as a command line
            session.pending += payload
            session.flush_terminal()
    elif kind == INTERRUPT:
        session.interrupt()
    elif kind == RESIZE and len(payload) == 4:
        rows, cols = struct.unpack(">HH", payload)
        set_window(session.master, rows, cols)
        with contextlib.suppress(OSError):
            os.killpg(session.foreground() or session.bash, signal.SIGWINCH)
    elif kind == QUIT:
        session.cleanup()
        os._exit(0)


def read_exact(size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = os.read(0, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def opened(host: Host) -> tuple[bool, int, int, float] | None:
    """The session's terminal and grace from the host's ``OPEN``; None (after saying why) if
    it is not one of this version."""
    try:
        first = host.first_frame()
    except FrameError as exc:
        host.send(DEAD, f"a frame the host did not send: {exc}".encode())
        return None
    if first is None:
        return None
    kind, payload = first
    if kind != OPEN or len(payload) < VERSION_FIELD.size:
        host.send(DEAD, b"the host's first frame is not OPEN")
        return None
    (version,) = VERSION_FIELD.unpack_from(payload)
    if version != SHELL_VERSION or len(payload) != OPEN_FIELDS.size:
        reason = f"the host speaks shell protocol version {version}, this driver {SHELL_VERSION}"
        host.send(DEAD, reason.encode())
        return None
    _, use_pty, rows, cols, grace = OPEN_FIELDS.unpack(payload)
    return use_pty == 1, rows, cols, grace


def main() -> None:
    key = read_exact(KEY)  # sent once the bootstrap made this process non-dumpable
    if key is None:
        return
    host = Host(key)
    host.send(GREET, VERSION_FIELD.pack(SHELL_VERSION))
    params = opened(host)
    if params is None:
        return
    use_pty, rows, cols, grace = params
    bash = find_bash(os.environ)
    if bash is None:
        host.send(DEAD, b"no bash in the sandbox (searched PATH)")
        return
    parent = safe_parent()
    if parent is None:
        host.send(DEAD, NO_SAFE_PARENT.encode())
        return
    read_wake, write_wake = os.pipe()
    os.set_blocking(write_wake, False)
    signal.set_wakeup_fd(write_wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    session = Session(host, parent, use_pty, rows, cols, grace)
    try:
        session.start(bash)
        serve(session, host, read_wake)
    except BrokenPipeError:  # the host is gone
        session.cleanup()
    except BaseException:
        session.cleanup()
        raise


if __name__ in ("__main__", "__vf_sandbox_agent__"):
    main()
