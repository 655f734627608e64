"""The agent's main loop: frames read from the host, authenticated, handed to the request
they belong to; each request runs in a worker thread (agent part).

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import signal
import stat
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from .codec import FrameError, Opener
from .execute import Exec
from .files import Read, Write
from .output import Output, Refused
from .paths import make_dir, path_info
from .procs import container_command, kill_running
from .relay import Listener
from .sweep import Sweep, pids_limit
from .wire import (
    ALERT,
    DATA,
    DONE,
    EOF,
    EXEC,
    HALT,
    HELLO,
    KILL,
    LISTEN,
    LSTAT,
    MKDIR,
    R_ACK,
    R_CLOSE,
    R_DATA,
    R_EOF,
    READ,
    REMOVE,
    STAT,
    SWEEP,
    U32,
    VERSION,
    WRITE,
    ExecHeader,
    Hello,
    ListenHeader,
    MkdirHeader,
    PathHeader,
    ReadHeader,
    SweepHeader,
    WriteHeader,
    split_prefixed,
    text,
)

if TYPE_CHECKING:
    from collections.abc import Callable

HALT_SETTLE = 1.5
"""Seconds HALT waits for the killed processes to be gone (the host waits ``HALT_WAIT``)."""
INPUT_CHUNK = 1024 * 1024


class Workers:
    """Threads reused across requests; a new one only when none is idle. At the sandbox's
    process limit no thread can be made (threads are tasks too): :meth:`submit` refuses,
    and nothing of the request is left queued."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]]
        self._tasks = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` in a worker thread.

        Raises ``Refused`` (``pids``) when a new thread is needed and cannot be made.
        """
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if not spawn:
            self._tasks.put((fn, args))
            return
        try:  # the new thread's first task is handed to it, never queued for another
            threading.Thread(target=self._work, args=((fn, args),), daemon=True).start()
        except RuntimeError:  # "can't start new thread": EAGAIN from clone
            raise Refused(errno.EAGAIN, "pids", pids_limit()) from None

    def _work(self, first: tuple[Callable[..., None], tuple[Any, ...]]) -> None:
        task = first
        while True:
            fn, args = task
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a bug in one request must not end the agent
                import traceback

                traceback.print_exc(file=sys.stderr)
            with self._lock:
                self._idle += 1
            task = self._tasks.get()


class Agent:
    def __init__(self, in_fd: int, out_fd: int, key: bytes, flags: int = 0) -> None:
        self.in_fd = in_fd
        self.key = key
        self.flags = flags
        self.out = Output(out_fd, key)
        self.workers = Workers()
        self.requests: dict[int, Any] = {}
        self.lock = threading.Lock()
        self.env = dict(os.environ)
        self.next_conn = 0

    # ------------------------------------------------------------------ the main loop

    def serve(self) -> None:
        self.out.send(HELLO, 0, self.hello())
        frames = Opener(self.key, 1 << 32)
        while True:
            try:
                data = os.read(self.in_fd, INPUT_CHUNK)
            except InterruptedError:
                continue
            except OSError:
                break
            if not data:
                break
            try:
                received = frames.feed(data)
            except FrameError as exc:
                # Someone else writes to this stream: nothing it says may be obeyed, and
                # nothing more may be trusted. Say so (authenticated), then stop.
                self.out.send(ALERT, 0, text(f"a forged frame: {exc}"))
                self.shutdown()
            for kind, rid, payload in received:
                try:
                    self.dispatch(kind, rid, payload)
                except Exception as exc:  # noqa: BLE001 - one bad request must not end the agent
                    self.finish(rid)
                    self.out.error(rid, 0, "internal", f"{type(exc).__name__}: {exc}")
        self.shutdown()

    def hello(self) -> bytes:
        python = ".".join(str(n) for n in sys.version_info[:3])
        hello = Hello(
            VERSION,
            os.getpid(),
            os.getsid(0),
            os.geteuid(),
            os.getegid(),
            self.flags,
            python,
            os.path.realpath(sys.executable),
        )
        return hello.to_wire()

    def dispatch(self, kind: int, rid: int, payload: bytes) -> None:
        if kind in (DATA, EOF, KILL):
            with self.lock:
                request = self.requests.get(rid)
            if request is None:
                return  # finished or refused meanwhile: late frames are dropped
            if kind == KILL:
                request.kill()
            else:
                request.feed(payload if kind == DATA else None)
            return
        if kind == EXEC:
            header, inline = split_prefixed(payload)
            command = Exec(self, rid, ExecHeader.from_wire(header), inline)
            with self.lock:
                self.requests[rid] = command
            # Spawned right here: the worker that pumps its output wakes up while the
            # command already runs, instead of before it starts.
            if command.launch():
                try:
                    self.workers.submit(command.run)
                except Refused as refused:
                    command.abandon(refused)
                    command.release()
        elif kind == WRITE:
            header, inline = split_prefixed(payload)
            self.start(rid, Write(self, rid, WriteHeader.from_wire(header), inline))
        elif kind == READ:
            self.start(rid, Read(self, rid, ReadHeader.from_wire(payload)))
        elif kind in (R_DATA, R_ACK, R_EOF, R_CLOSE):
            with self.lock:
                conn = self.requests.get(rid)
            if conn is not None:
                conn.on_frame(kind, payload)
        elif kind == LISTEN:
            listener = Listener(self, rid, ListenHeader.from_wire(payload))
            with self.lock:
                self.requests[rid] = listener
            listener.open()
        elif kind == STAT:
            self.submit(rid, self.stat, rid, PathHeader.from_wire(payload))
        elif kind == REMOVE:
            self.submit(rid, self.remove, rid, PathHeader.from_wire(payload))
        elif kind == LSTAT:
            self.submit(rid, self.lstat, rid, ReadHeader.from_wire(payload))
        elif kind == MKDIR:
            self.submit(rid, self.mkdir, rid, MkdirHeader.from_wire(payload))
        elif kind == HALT:
            self.halt(rid)
        elif kind == SWEEP:
            # On this thread: at the process limit no worker thread may be had.
            killed = Sweep(SweepHeader.from_wire(payload)).run()
            self.out.send(DONE, rid, U32.pack(killed))
        else:
            self.out.error(rid, errno.EINVAL, "unsupported", f"unknown frame type {kind}")

    def start(self, rid: int, request: Any) -> None:
        with self.lock:
            self.requests[rid] = request
        self.submit(rid, request.run)

    def submit(self, rid: int, fn: Callable[..., None], *args: Any) -> None:
        """Serve request ``rid`` in a worker thread, or refuse it when none can be made."""
        try:
            self.workers.submit(fn, *args)
        except Refused as refused:
            self.refuse(rid, refused)

    def refuse(self, rid: int, exc: Refused | OSError) -> None:
        """A request that could not start: one ERROR frame, then off the books."""
        if isinstance(exc, Refused):
            self.out.refused(rid, exc)
        else:
            self.out.os_error(rid, exc)
        self.finish(rid)

    def finish(self, rid: int) -> None:
        with self.lock:
            self.requests.pop(rid, None)

    def shutdown(self) -> None:
        """Stdin ended: nobody will read results any more. Kill what still runs, exit."""
        with self.lock:
            running = list(self.requests.values())
        for request in running:
            request.kill()
        sys.stderr.flush()
        os._exit(0)

    def halt(self, rid: int) -> None:
        """Kill everything but this agent and PID 1 (the sandbox is closing); confirm only
        once nothing of it runs any more.

        ``kill(-1, SIGSTOP)`` first: one call the kernel makes atomic against ``fork``, after
        which no other process runs or forks. Then every process is SIGKILLed but the
        keep-alive (whose exit would end the container, and this agent, before it could
        confirm: frozen, it waits), until ``/proc`` lists none but zombies — ``kill`` returns
        once the signal is queued, a process dies when it next runs, and on a loaded host
        that can be milliseconds later. ``DONE``; then the keep-alive goes, and with it the
        container. ``ETIMEDOUT`` if a process outlives ``HALT_SETTLE`` seconds.
        """
        try:
            os.kill(-1, signal.SIGSTOP)
        except OSError as exc:
            if exc.errno != errno.ESRCH:  # ESRCH: nothing else was running
                self.out.os_error(rid, exc)
                return
        keep_alive = container_command()
        spared = {1, os.getpid(), keep_alive or 1}
        deadline = time.monotonic() + HALT_SETTLE
        while (survivor := kill_running(spared)) is not None:
            if time.monotonic() > deadline:
                self.out.os_error(
                    rid, OSError(errno.ETIMEDOUT, f"process {survivor} outlived SIGKILL")
                )
                return
            time.sleep(0.001)
        self.out.send(DONE, rid, b"")
        if keep_alive is not None:
            with contextlib.suppress(OSError):
                os.kill(keep_alive, signal.SIGKILL)

    # ------------------------------------------------------------------ small requests

    def stat(self, rid: int, header: PathHeader) -> None:
        try:
            os.lstat(header.path)
            exists = True
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                self.out.os_error(rid, exc)
                return
            exists = False
        self.out.send(DONE, rid, b"\x01" if exists else b"\x00")

    def lstat(self, rid: int, header: ReadHeader) -> None:
        try:
            info = path_info(header.path, header.limit)
        except OSError as exc:
            self.out.os_error(rid, exc)
            return
        self.out.send(DONE, rid, info.to_wire())

    def mkdir(self, rid: int, header: MkdirHeader) -> None:
        try:
            make_dir(header)
        except OSError as exc:
            self.out.os_error(rid, exc)
            return
        self.out.send(DONE, rid)

    def remove(self, rid: int, header: PathHeader) -> None:
        path = header.path
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                import shutil

                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError as exc:
            self.out.os_error(rid, exc)
            return
        self.out.send(DONE, rid)
