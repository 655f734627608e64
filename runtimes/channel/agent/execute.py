"""EXEC in the agent: a command in its own session, stdin fed under the host's window, its
output forwarded as it comes (agent part).

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .output import Refused
from .sweep import pids_limit
from .wire import (
    ACK,
    EXIT,
    EXIT_GRACE,
    I32,
    PIPE_CHUNK,
    STARTED,
    STDERR,
    STDIN_CLOSED,
    STDOUT,
    U32,
    ExecHeader,
)

if TYPE_CHECKING:
    from .serve import Agent

KILL_GRACE = 0.5
"""Seconds output is still read after a kill: a process that left the group may hold a pipe."""
EXIT_POLL = 0.05
"""Seconds between looks at a command's exit where no pidfd tells of it (Linux < 5.3,
Python < 3.9)."""
ANNOUNCE_AFTER = 0.005
"""STARTED waits this long for the first output or the exit, to share a write with it: a
short command then costs the host one wake-up, not two."""


class Exec:
    """One EXEC: answered by ``STARTED`` (``u32`` process group id), ``STDOUT`` / ``STDERR``
    chunks as they arrive, then ``EXIT`` (``i32``; 128+N for a death by signal N), or by one
    ``ERROR`` if it could not start."""

    def __init__(self, agent: Agent, rid: int, header: ExecHeader, inline: bytes) -> None:
        self.agent = agent
        self.rid = rid
        self.header = header
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed = False
        self.closed = False
        self.pending_start = b""
        """The STARTED frame until it is sent (with the first output, the exit, or after
        ANNOUNCE_AFTER)."""
        self.wake_r, self.wake_w = os.pipe()
        self.stdin: queue.SimpleQueue[bytes | None] | None = None
        self.inline_first = bool(inline)
        if header.has_stdin:
            self.stdin = queue.SimpleQueue()
            if inline:
                self.stdin.put(inline)
            if header.stdin_complete:
                self.stdin.put(None)

    def feed(self, data: bytes | None) -> None:
        if self.stdin is not None:
            self.stdin.put(data)

    def kill(self) -> None:
        with self.lock:
            self.killed = True
            if self.closed:
                return
            if self.proc is not None:
                kill_group(self.proc.pid)
            with contextlib.suppress(OSError):
                os.write(self.wake_w, b"k")

    def launch(self) -> bool:
        """Start the command; ``False`` (and one ERROR frame sent) if it cannot start."""
        try:
            proc = self.spawn()
        except Refused as refused:
            self.agent.out.refused(self.rid, refused)
            self.release()
            return False
        except Exception as exc:  # noqa: BLE001 - e.g. SubprocessError: reported, not fatal
            self.agent.out.error(self.rid, 0, "internal", f"{type(exc).__name__}: {exc}")
            self.release()
            return False
        with self.lock:
            self.proc = proc
            killed = self.killed
        if killed:
            kill_group(proc.pid)
        self.pending_start = U32.pack(proc.pid)
        if self.stdin is not None and not self.inline_first and not self.header.stdin_complete:
            # Stdin comes as the host's caller yields it, pulled once this arrives: at once.
            self.agent.out.send(STARTED, self.rid, self.take_start())
        return True

    def run(self) -> None:
        """Pump the started command's output, then report its exit (a worker thread)."""
        proc = self.proc
        assert proc is not None
        try:
            if self.stdin is not None:
                assert proc.stdin is not None
                try:
                    self.agent.workers.submit(self.pump_stdin, proc.stdin)
                except Refused as refused:
                    self.abandon(refused)
                    return
            self.pump_output(proc)
            code = proc.wait()
            if self.stdin is not None:
                self.stdin.put(None)  # ends the stdin pump if the host never sent EOF
            code = 128 - code if code < 0 else code
            # Off the books before the host hears of the exit: a host that then goes away
            # (stdin EOF) must not have the command's background processes killed.
            self.agent.finish(self.rid)
            self.agent.out.send(EXIT, self.rid, I32.pack(code), before=self.take_start())
        finally:
            self.release()

    def abandon(self, refused: Refused) -> None:
        """The started command cannot be served (no thread for it at the process limit):
        kill and reap it, then report why instead of its exit."""
        proc = self.proc
        assert proc is not None
        kill_group(proc.pid)
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        self.agent.finish(self.rid)
        self.agent.out.refused(self.rid, refused)

    def release(self) -> None:
        self.agent.finish(self.rid)
        with self.lock:
            self.closed = True
            os.close(self.wake_r)
            os.close(self.wake_w)

    def spawn(self) -> subprocess.Popen[bytes]:
        header = self.header
        argv = list(header.argv)
        cwd = header.cwd
        env = dict(self.agent.env)
        env.update(header.env)
        switch, home = user_switch(header.user)
        if home and "HOME" not in header.env:
            env["HOME"] = home  # as docker exec -u and su do
        check_cwd(cwd)
        options: dict[str, Any] = {
            "cwd": cwd,
            "env": env,
            "stdin": subprocess.PIPE if self.stdin is not None else subprocess.DEVNULL,
            "stdout": subprocess.PIPE,
            "stderr": subprocess.PIPE,
            "start_new_session": True,
            "close_fds": True,
        }
        options.update(switch)
        try:
            return subprocess.Popen(argv, **options)
        except OSError as exc:
            num = exc.errno or 0
            if num == errno.ENOEXEC:
                # What execvp(3) and sh do with a script lacking a #! line: run it with sh.
                found = find_program(argv[0], env.get("PATH"), cwd)
                if found is not None:
                    try:
                        return subprocess.Popen(["/bin/sh", found, *argv[1:]], **options)
                    except OSError as again:
                        num = again.errno or 0
            if num == errno.EAGAIN:  # fork failed: the sandbox is at its process limit
                raise Refused(num, "pids", pids_limit()) from None
            if num == errno.EACCES and exc.filename == cwd and not os.access(cwd, os.X_OK):
                raise Refused(num, "cwd") from None
            raise Refused(num, "prog", exc.strerror or "") from None

    def take_start(self) -> bytes:
        start, self.pending_start = self.pending_start, b""
        return start

    def pump_stdin(self, pipe: Any) -> None:
        assert self.stdin is not None
        fd = pipe.fileno()
        broken = False
        while True:
            data = self.stdin.get()
            if data is None:
                break
            if not broken:
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view) :]
                except OSError:
                    broken = True  # the command exited or closed its stdin: the rest is dropped
                    self.agent.out.send(STDIN_CLOSED, self.rid)
            if self.inline_first:
                self.inline_first = False  # inline bytes are not counted in the host's window
            elif data:
                self.agent.out.send(ACK, self.rid, U32.pack(len(data)))
        with contextlib.suppress(OSError):
            pipe.close()

    def pump_output(self, proc: subprocess.Popen[bytes]) -> None:
        """Forward the output until the pipes close, or until EXIT_GRACE after the command
        itself exited: background processes may hold its pipes for their whole life, and
        what they write later is read and discarded (:func:`discard`), so they neither
        block nor die of SIGPIPE."""
        out = self.agent.out
        assert proc.stdout is not None and proc.stderr is not None
        kinds = {proc.stdout.fileno(): STDOUT, proc.stderr.fileno(): STDERR}
        poller = select.poll()
        for fd in kinds:
            poller.register(fd, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        pidfd = open_pidfd(proc.pid)
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        limit = self.header.output_limit
        total = 0
        capped = False
        give_up: float | None = None
        exited = False
        while kinds:
            timeout = self.poll_timeout(give_up, exited or pidfd is not None)
            events = poller.poll(timeout)
            if give_up is not None and time.monotonic() >= give_up:
                break  # killed or exited, and something outside the group holds a pipe
            told = pidfd is None or any(fd == pidfd for fd, _ in events)
            if not exited and told and proc.poll() is not None:
                exited = True
                if give_up is None:
                    give_up = time.monotonic() + EXIT_GRACE
                if pidfd is not None:
                    poller.unregister(pidfd)
            if not events and self.pending_start:
                out.send(STARTED, self.rid, self.take_start())
                continue
            for fd, _ in events:
                if fd == self.wake_r:
                    os.read(self.wake_r, 64)
                    give_up = time.monotonic() + KILL_GRACE
                    continue
                if fd not in kinds:
                    continue
                try:
                    data = os.read(fd, PIPE_CHUNK)
                except OSError:
                    data = b""
                if not data:
                    poller.unregister(fd)
                    del kinds[fd]
                    continue
                if capped:
                    continue
                total += len(data)
                out.send(kinds[fd], self.rid, data, before=self.take_start())
                if total > limit:
                    capped = True  # the host keeps exactly the cap and reports the overflow
                    self.kill()
        if pidfd is not None:
            os.close(pidfd)
        lingering = [pipe for pipe in (proc.stdout, proc.stderr) if pipe.fileno() in kinds]
        if lingering and not self.killed:
            discard(lingering)
        else:
            for pipe in lingering:
                pipe.close()
        for pipe in (proc.stdout, proc.stderr):
            if pipe not in lingering:
                pipe.close()

    def poll_timeout(self, give_up: float | None, exit_told: bool) -> float | None:
        """Milliseconds the next poll may wait: to the give-up time, the STARTED frame's
        delay, or the next look at the exit when nothing else tells of it."""
        waits = []
        if give_up is not None:
            waits.append(max(0.0, give_up - time.monotonic()))
        if self.pending_start:
            waits.append(ANNOUNCE_AFTER)
        if not exit_told:
            waits.append(EXIT_POLL)
        return min(waits) * 1000 if waits else None


def open_pidfd(pid: int) -> int | None:
    """A pidfd of ``pid`` (readable once it exited), ``None`` where the system has none."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


def discard(pipes: list[Any]) -> None:
    """Read ``pipes`` to their end in a thread of their own, dropping what comes, then close
    them: the processes still writing them keep running unblocked. A thread that cannot
    start (the sandbox's process limit) closes them instead."""

    def drain() -> None:
        poller = select.poll()
        open_fds = {pipe.fileno(): pipe for pipe in pipes}
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        while open_fds:
            for fd, _ in poller.poll():
                try:
                    data = os.read(fd, PIPE_CHUNK)
                except OSError:
                    data = b""
                if not data:
                    poller.unregister(fd)
                    open_fds.pop(fd).close()

    try:
        threading.Thread(target=drain, name="discard", daemon=True).start()
    except RuntimeError:
        for pipe in pipes:
            pipe.close()


def kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def check_cwd(cwd: str) -> None:
    try:
        mode = os.stat(cwd).st_mode
    except OSError as exc:
        raise Refused(exc.errno or 0, "cwd", exc.strerror or "") from None
    if not stat.S_ISDIR(mode):
        raise Refused(errno.ENOTDIR, "cwd")


def find_program(name: str, path: str | None, cwd: str) -> str | None:
    if "/" in name:
        return name if os.path.isabs(name) else os.path.join(cwd, name)
    for directory in (path if path is not None else os.defpath).split(os.pathsep):
        candidate = os.path.join(directory or ".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def user_switch(spec: str | None) -> tuple[dict[str, Any], str | None]:
    """Popen options that run the command as ``spec`` (``user``, ``uid``, ``user:group``),
    and that user's home directory."""
    if not spec:
        return {}, None
    import pwd

    name, _, group = spec.partition(":")
    try:
        entry: Any = pwd.getpwuid(int(name)) if name.isdigit() else pwd.getpwnam(name)
    except KeyError:
        if not name.isdigit():
            raise Refused(errno.EINVAL, "user", f"no such user: {spec!r}") from None
        entry = None
    uid = int(name) if entry is None else entry.pw_uid
    gid = entry.pw_gid if entry is not None else 0
    if group:
        gid = resolve_group(group, spec)
    if uid == os.geteuid() and (not group or gid == os.getegid()):
        return {}, None
    if os.geteuid() != 0 or sys.version_info < (3, 9):
        raise Refused(errno.EOPNOTSUPP, "unsupported", f"cannot switch to {spec!r} here")
    groups = os.getgrouplist(entry.pw_name, gid) if entry is not None else [gid]
    home = entry.pw_dir if entry is not None else None
    return {"user": uid, "group": gid, "extra_groups": groups}, home


def resolve_group(group: str, spec: str) -> int:
    if group.isdigit():
        return int(group)
    import grp

    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise Refused(errno.EINVAL, "user", f"no such group in {spec!r}") from None
