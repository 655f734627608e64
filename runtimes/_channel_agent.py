"""The channel agent: runs INSIDE a sandbox, serving one host over its stdin and stdout.

Standard library only, Python >= 3.8, one file: the host sends this source through the
stream it just opened (see ``BOOTSTRAP`` in :mod:`runtimes.channel`), so nothing is installed
and nothing costs a round trip per request. It never imports anything from ``runtimes``.

Framing, both directions: ``type (u8) | request id (u32) | length (u32) | payload | tag``,
integers big-endian; ``tag`` is HMAC-SHA256 (truncated to 16 bytes) under the per-start key
over the direction's frame sequence number (u64), the header and the payload. The key comes
over stdin right after the source (the bootstrap made the process non-dumpable first, and says
``ready``): it never appears in argv, the environment or a file. A frame from the host that
fails authentication makes the agent say ``ALERT`` and exit; see ``docs/channel.md``.

Everything is binary: data (stdin, file contents, output) travels raw, and request headers are
fixed fields plus ``text`` strings (``u32`` length + UTF-8 with surrogateescape), so no payload
byte is ever escaped. Requests are multiplexed: each runs in its own worker
thread, so a slow command or a blocked pipe never stalls the others, and the main thread only
reads frames and hands them out (and spawns commands, so they start at once).

Requests (host -> agent):

* ``EXEC``: ``u32 header length | header | inline stdin``; header = ``u8 flags`` (1: stdin
  follows, 2: stdin complete) ``| u64 output cap | text cwd | text user ("": the agent's) |
  u32 argc | argc x text | u32 envc | envc x (text name, text value)``. Answered by
  ``STARTED`` (``u32`` process group id: every command runs in its own session, ``setsid``),
  ``STDOUT`` / ``STDERR`` chunks as they arrive, then ``EXIT`` (``i32``; 128+N for a death by
  signal N), or by one ``ERROR`` if it could not start.
* ``DATA`` / ``EOF``: more stdin of an ``EXEC``, or more content of a ``WRITE``. Each chunk
  sent as ``DATA`` is acknowledged with ``ACK`` (``u32`` bytes consumed) once written: the
  host keeps a bounded window in flight, so memory here stays bounded whatever the size.
* ``KILL``: kill the request's whole process group (``EXEC``), or abandon a transfer.
* ``READ`` (``u64 cap | text path``): ``CHUNK`` frames, then ``DONE``; a file over the cap is
  refused before anything is sent.
* ``WRITE`` (``u32 header length | u8 flags (2: complete) | text path | inline data``):
  parents created, then ``DONE``.
* ``STAT`` (``text path``): ``DONE`` with one byte, 1 if something is there (``lstat``: a
  dangling link exists). ``REMOVE`` (``text path``): a file, a link or a tree, then ``DONE``.

``HELLO`` (request id 0, first frame): ``u32 version, pid, sid, uid, gid, flags | text python
| text executable`` (flags: 1 non-dumpable). ``DIGEST`` (request id 0, when the host asked at
the first start): sha256 of the interpreter, of every module loaded and of
``/etc/ld.so.preload`` (zeros: absent), for the host to verify before a restart.
``ERROR``: ``i32 errno | text what | text message``; ``what`` is ``prog``, ``cwd``, ``user``,
``path``, ``limit``, ``special`` (a FIFO or a socket where a file is expected: refused, never
waited on), ``internal`` (an unexpected failure, message attached) or ``unsupported`` (the
host then uses its plain path).

The relay (``LISTEN``, see :class:`Listener`): a TCP listener on the sandbox's loopback whose
connections are carried as streams over this channel to a port on the host (the model proxy),
each with a bounded window of unacknowledged bytes per direction.

On EOF of its stdin (the host closed the channel, or died) the agent kills the process group
of every command still running, closes every relayed connection, then exits.
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import os
import queue
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing and json import re: milliseconds of start-up for nothing
    from collections.abc import Callable
    from typing import Any

VERSION = 3

HEADER = struct.Struct(">BII")
SEQ = struct.Struct(">Q")
TAG = 16
"""Bytes of HMAC-SHA256 (truncated) after every frame's payload, both directions."""
KEY = 32
"""Bytes of the per-start key the host sends right after the bootstrap read the source."""
U8 = struct.Struct(">B")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
I32 = struct.Struct(">i")
HELLO_FIELDS = struct.Struct(">IIIIII")
NON_DUMPABLE = 1
"""HELLO flag: the agent made itself non-dumpable (no /proc/<pid>/fd, no ptrace)."""

# host -> agent
EXEC, DATA, EOF, KILL, READ, WRITE, STAT, REMOVE = 1, 2, 3, 4, 5, 6, 7, 8
# agent -> host
HELLO, STARTED, STDOUT, STDERR, EXIT, ERROR, CHUNK, DONE, ACK = 64, 65, 66, 67, 68, 69, 70, 71, 72
ALERT, DIGEST = 73, 74
"""Request id 0: ALERT (text reason): the agent received a frame that failed authentication
and exits; DIGEST (text path, 32-byte sha256, repeated): the files the agent runs from."""
# the relay (see Listener): LISTEN host -> agent, OPENED agent -> host, the rest both ways
LISTEN = 9
OPENED = 75
R_DATA, R_ACK, R_EOF, R_CLOSE = 32, 33, 34, 35
RELAY_KINDS = frozenset((OPENED, R_DATA, R_ACK, R_EOF, R_CLOSE))
RELAY_BIT = 0x80000000
"""Relayed connections are numbered by the agent, with this bit set (the host's request ids
never have it): each is a stream of its own, with a window of unacknowledged bytes per
direction."""
RELAY_CHUNK = 64 * 1024

READ_CHUNK = 256 * 1024
PIPE_CHUNK = 64 * 1024
INPUT_CHUNK = 1024 * 1024
KILL_GRACE = 0.5
"""Seconds output is still read after a kill: a process that left the group may hold a pipe."""
UMASK = os.umask(0o022)
os.umask(UMASK)  # read once: os.umask cannot be read without setting it (process-wide)
ANNOUNCE_AFTER = 0.005
"""STARTED waits this long for the first output or the exit, to share a write with it: a
short command then costs the host one wake-up, not two."""


class Refused(Exception):
    """A request that could not start: answered with one ERROR frame."""

    def __init__(self, num: int, what: str, message: str = "") -> None:
        super().__init__(message)
        self.num = num
        self.what = what
        self.message = message or os.strerror(num)


def mac(key: bytes, seq: int, header: bytes, payload: bytes) -> bytes:
    """A frame's tag: HMAC-SHA256 over the direction's sequence number, the header and the
    payload, truncated to TAG bytes. The sequence number makes a frame valid only at its
    place in the stream: nothing can be replayed, dropped or reordered unnoticed."""
    if len(payload) < 65536:
        return hmac.digest(key, SEQ.pack(seq) + header + payload, "sha256")[:TAG]
    digest = hmac.new(key, SEQ.pack(seq) + header, "sha256")
    digest.update(payload)
    return digest.digest()[:TAG]


class Output:
    """The agent's stdout: whole authenticated frames, one writer at a time."""

    def __init__(self, fd: int, key: bytes) -> None:
        self._fd = fd
        self._key = key
        self._seq = 0
        self._lock = threading.Lock()
        self.broken = False

    def _frame(self, kind: int, rid: int, payload: bytes) -> bytes:
        header = HEADER.pack(kind, rid, len(payload))
        tag = mac(self._key, self._seq, header, payload)
        self._seq += 1
        return header + payload + tag

    def send(self, kind: int, rid: int, payload: bytes = b"", before: bytes = b"") -> None:
        """One frame, preceded in the same write by a STARTED frame of the same request
        carrying ``before`` (when not empty)."""
        with self._lock:
            if self.broken:
                return
            data = self._frame(STARTED, rid, before) if before else b""
            data += self._frame(kind, rid, payload)
            view = memoryview(data)
            try:
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
            except OSError:
                self.broken = True

    def error(self, rid: int, num: int, what: str, message: str) -> None:
        self.send(ERROR, rid, I32.pack(num) + text(what) + text(message))


def text(value: str) -> bytes:
    """A string field: u32 length, then UTF-8 (surrogateescape: any bytes round-trip)."""
    data = value.encode("utf-8", "surrogateescape")
    return U32.pack(len(data)) + data


class Fields:
    """Reads a binary header: fixed-size numbers and ``text`` strings, in order."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def number(self, kind: struct.Struct) -> int:
        (value,) = kind.unpack_from(self.data, self.pos)
        self.pos += kind.size
        return int(value)

    def text(self) -> str:
        size = self.number(U32)
        value = self.data[self.pos : self.pos + size].decode("utf-8", "surrogateescape")
        self.pos += size
        return value


def split_header(payload: bytes) -> tuple[Fields, bytes]:
    (size,) = U32.unpack_from(payload, 0)
    return Fields(payload[4 : 4 + size]), payload[4 + size :]


def exec_header(payload: bytes) -> tuple[dict[str, Any], bytes]:
    fields, inline = split_header(payload)
    flags = fields.number(U8)
    header: dict[str, Any] = {
        "s": bool(flags & 1),
        "x": bool(flags & 2),
        "l": fields.number(U64),
        "c": fields.text(),
        "u": fields.text() or None,
    }
    header["a"] = [fields.text() for _ in range(fields.number(U32))]
    env = {}
    for _ in range(fields.number(U32)):
        name = fields.text()
        env[name] = fields.text()
    header["e"] = env
    return header, inline


def write_header(payload: bytes) -> tuple[dict[str, Any], bytes]:
    fields, inline = split_header(payload)
    flags = fields.number(U8)
    return {"x": bool(flags & 2), "p": fields.text()}, inline


def read_header(payload: bytes) -> dict[str, Any]:
    fields = Fields(payload)
    limit = fields.number(U64)
    return {"l": limit, "p": fields.text()}


def path_header(payload: bytes) -> dict[str, Any]:
    return {"p": Fields(payload).text()}


class Workers:
    """Threads reused across requests; a new one only when none is idle."""

    def __init__(self) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[..., None], tuple[Any, ...]]]
        self._tasks = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        self._tasks.put((fn, args))
        if spawn:
            threading.Thread(target=self._work, daemon=True).start()

    def _work(self) -> None:
        while True:
            fn, args = self._tasks.get()
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a bug in one request must not end the agent
                import traceback

                traceback.print_exc(file=sys.stderr)
            with self._lock:
                self._idle += 1


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
        buf = bytearray()
        seq = 0
        key = self.key
        while True:
            try:
                data = os.read(self.in_fd, INPUT_CHUNK)
            except InterruptedError:
                continue
            except OSError:
                break
            if not data:
                break
            buf += data
            pos = 0
            size_buf = len(buf)
            while size_buf - pos >= HEADER.size:
                kind, rid, size = HEADER.unpack_from(buf, pos)
                end = pos + HEADER.size + size
                if end + TAG > size_buf:
                    break
                payload = bytes(buf[pos + HEADER.size : end])
                expected = mac(key, seq, bytes(buf[pos : pos + HEADER.size]), payload)
                if not hmac.compare_digest(expected, bytes(buf[end : end + TAG])):
                    # Someone else writes to this stream: nothing it says may be obeyed,
                    # and nothing more may be trusted. Say so (authenticated), then stop.
                    self.out.send(ALERT, 0, text(f"a forged frame (type {kind}) at #{seq}"))
                    self.shutdown()
                seq += 1
                try:
                    self.dispatch(kind, rid, payload)
                except Exception as exc:  # noqa: BLE001 - one bad request must not end the agent
                    self.finish(rid)
                    self.out.error(rid, 0, "internal", f"{type(exc).__name__}: {exc}")
                pos = end + TAG
            del buf[:pos]
        self.shutdown()

    def hello(self) -> bytes:
        ids = HELLO_FIELDS.pack(
            VERSION, os.getpid(), os.getsid(0), os.geteuid(), os.getegid(), self.flags
        )
        python = ".".join(str(n) for n in sys.version_info[:3])
        return ids + text(python) + text(os.path.realpath(sys.executable))

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
            header, inline = exec_header(payload)
            command = Exec(self, rid, header, inline)
            with self.lock:
                self.requests[rid] = command
            # Spawned right here: the worker that pumps its output wakes up while the
            # command already runs, instead of before it starts.
            if command.launch():
                self.workers.submit(command.run)
        elif kind == WRITE:
            header, inline = write_header(payload)
            self.start(rid, Write(self, rid, header, inline))
        elif kind == READ:
            self.start(rid, Read(self, rid, read_header(payload)))
        elif kind in (R_DATA, R_ACK, R_EOF, R_CLOSE):
            with self.lock:
                conn = self.requests.get(rid)
            if conn is not None:
                conn.on_frame(kind, payload)
        elif kind == LISTEN:
            listener = Listener(self, rid, payload)
            with self.lock:
                self.requests[rid] = listener
            listener.open()
        elif kind == STAT:
            self.workers.submit(self.stat, rid, path_header(payload))
        elif kind == REMOVE:
            self.workers.submit(self.remove, rid, path_header(payload))
        else:
            self.out.error(rid, errno.EINVAL, "unsupported", f"unknown frame type {kind}")

    def start(self, rid: int, request: Any) -> None:
        with self.lock:
            self.requests[rid] = request
        self.workers.submit(request.run)

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

    # ------------------------------------------------------------------ small requests

    def stat(self, rid: int, header: dict[str, Any]) -> None:
        path = header["p"]
        try:
            os.lstat(path)
            exists = True
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                self.out.error(rid, exc.errno or 0, "path", exc.strerror or "")
                return
            exists = False
        self.out.send(DONE, rid, b"\x01" if exists else b"\x00")

    def remove(self, rid: int, header: dict[str, Any]) -> None:
        path = header["p"]
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                import shutil

                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError as exc:
            self.out.error(rid, exc.errno or 0, "path", exc.strerror or "")
            return
        self.out.send(DONE, rid)


# ---------------------------------------------------------------------- exec


class Exec:
    def __init__(self, agent: Agent, rid: int, header: dict[str, Any], inline: bytes) -> None:
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
        if header.get("s"):
            self.stdin = queue.SimpleQueue()
            if inline:
                self.stdin.put(inline)
            if header.get("x"):
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
            self.agent.out.error(self.rid, refused.num, refused.what, refused.message)
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
        return True

    def run(self) -> None:
        """Pump the started command's output, then report its exit (a worker thread)."""
        proc = self.proc
        assert proc is not None
        try:
            if self.stdin is not None:
                assert proc.stdin is not None
                self.agent.workers.submit(self.pump_stdin, proc.stdin)
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

    def release(self) -> None:
        self.agent.finish(self.rid)
        with self.lock:
            self.closed = True
            os.close(self.wake_r)
            os.close(self.wake_w)

    def spawn(self) -> subprocess.Popen[bytes]:
        header = self.header
        argv = list(header["a"])
        cwd = header["c"]
        env = dict(self.agent.env)
        env.update(header["e"])
        switch, home = user_switch(header.get("u"))
        if home and "HOME" not in header["e"]:
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
            if self.inline_first:
                self.inline_first = False  # inline bytes are not counted in the host's window
            elif data:
                self.agent.out.send(ACK, self.rid, U32.pack(len(data)))
        with contextlib.suppress(OSError):
            pipe.close()

    def pump_output(self, proc: subprocess.Popen[bytes]) -> None:
        out = self.agent.out
        assert proc.stdout is not None and proc.stderr is not None
        kinds = {proc.stdout.fileno(): STDOUT, proc.stderr.fileno(): STDERR}
        poller = select.poll()
        for fd in kinds:
            poller.register(fd, select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        limit = int(self.header["l"])
        total = 0
        capped = False
        give_up: float | None = None
        while kinds:
            if give_up is not None:
                timeout: float | None = max(0.0, give_up - time.monotonic()) * 1000
            else:
                timeout = ANNOUNCE_AFTER * 1000 if self.pending_start else None
            events = poller.poll(timeout)
            if not events and give_up is not None:
                break  # killed, and something outside the group still holds a pipe
            if not events and self.pending_start:
                out.send(STARTED, self.rid, self.take_start())
                continue
            for fd, _ in events:
                if fd == self.wake_r:
                    os.read(self.wake_r, 64)
                    if give_up is None:
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
        proc.stdout.close()
        proc.stderr.close()


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


# ---------------------------------------------------------------------- relay


class Listener:
    """``LISTEN`` (``u32 max connections | u32 window | u16 port``, 0: any free port): a
    TCP listener on the sandbox's loopback, answered with ``DONE`` (``u16`` port) or one
    ``ERROR``. Each accepted connection is announced with ``OPENED`` (request id: the
    connection's own, ``RELAY_BIT`` set; payload: ``u32`` the listener's id) and then relayed
    as ``R_DATA`` / ``R_ACK`` / ``R_EOF`` / ``R_CLOSE`` frames; connections beyond the
    maximum are closed at once. ``KILL`` on the listener's id closes it and its connections.
    The bytes are opaque: the agent never reads them, the host's service answers them."""

    def __init__(self, agent: Agent, rid: int, payload: bytes) -> None:
        fields = Fields(payload)
        self.agent = agent
        self.rid = rid
        self.limit = fields.number(U32)
        self.window = fields.number(U32)
        self.port = fields.number(struct.Struct(">H"))
        self.sock: socket.socket | None = None
        self.conns: dict[int, Conn] = {}
        self.lock = threading.Lock()
        self.closed = False

    def open(self) -> None:
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", self.port))
            sock.listen(64)
        except OSError as exc:
            self.agent.finish(self.rid)
            self.agent.out.error(self.rid, exc.errno or 0, "path", exc.strerror or "")
            return
        sock.set_inheritable(False)
        self.sock = sock
        self.agent.out.send(DONE, self.rid, struct.pack(">H", sock.getsockname()[1]))
        self.agent.workers.submit(self.accept_loop)

    def accept_loop(self) -> None:
        sock = self.sock
        assert sock is not None
        while not self.closed:
            try:
                accepted, _ = sock.accept()
            except OSError:
                if self.is_closed():
                    return
                time.sleep(0.01)  # EMFILE or an aborted handshake: go on accepting
                continue
            with self.lock:
                if self.closed or len(self.conns) >= self.limit:
                    accepted.close()  # the client sees its connection closed: it fails fast
                    continue
                self.agent.next_conn = self.agent.next_conn % 0x7FFFFFFF + 1
                cid = RELAY_BIT | self.agent.next_conn
                conn = Conn(self, cid, accepted)
                self.conns[cid] = conn
            with self.agent.lock:
                self.agent.requests[cid] = conn
            self.agent.out.send(OPENED, cid, U32.pack(self.rid))
            conn.start()

    def is_closed(self) -> bool:
        return self.closed

    def forget(self, cid: int) -> None:
        with self.lock:
            self.conns.pop(cid, None)
        self.agent.finish(cid)

    def feed(self, data: bytes | None) -> None:
        pass

    def kill(self) -> None:
        with self.lock:
            self.closed = True
            conns = list(self.conns.values())
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
            self.sock.close()
        for conn in conns:
            conn.abort(False)
        self.agent.finish(self.rid)


class Conn:
    """One relayed connection: socket -> host as ``R_DATA`` while the host's window allows
    (``R_ACK`` reopens it), host -> socket from a queue; ``R_EOF`` half-closes, ``R_CLOSE``
    aborts. Two worker threads; the main thread only queues."""

    def __init__(self, listener: Listener, cid: int, sock: socket.socket) -> None:
        self.listener = listener
        self.out = listener.agent.out
        self.cid = cid
        self.sock = sock
        self.credit = listener.window
        self.cond = threading.Condition()
        self.incoming: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.closed = False
        self.halves = 0
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def start(self) -> None:
        workers = self.listener.agent.workers
        workers.submit(self.pump_out)
        workers.submit(self.pump_in)

    def on_frame(self, kind: int, payload: bytes) -> None:
        if kind == R_DATA:
            self.incoming.put(payload)
        elif kind == R_EOF:
            self.incoming.put(None)
        elif kind == R_ACK:
            with self.cond:
                self.credit += U32.unpack(payload)[0]
                self.cond.notify()
        elif kind == R_CLOSE:
            self.abort(False)

    def feed(self, data: bytes | None) -> None:
        pass

    def is_closed(self) -> bool:
        return self.closed

    def kill(self) -> None:
        self.abort(False)

    def pump_out(self) -> None:
        """The client's bytes to the host, never more than the window unacknowledged."""
        while True:
            with self.cond:
                while self.credit <= 0 and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                size = min(self.credit, RELAY_CHUNK)
            try:
                data = self.sock.recv(size)
            except OSError:
                self.abort(True)
                return
            if self.is_closed():
                return
            if not data:
                self.out.send(R_EOF, self.cid)
                self.half_closed()
                return
            with self.cond:
                self.credit -= len(data)
            self.out.send(R_DATA, self.cid, data)

    def pump_in(self) -> None:
        """The host's bytes to the client, acknowledged once written."""
        while True:
            data = self.incoming.get()
            if self.closed:
                return
            try:
                if data is None:
                    self.sock.shutdown(socket.SHUT_WR)
                else:
                    self.sock.sendall(data)
            except OSError:
                self.abort(True)
                return
            if data is None:
                self.half_closed()
                return
            self.out.send(R_ACK, self.cid, U32.pack(len(data)))

    def half_closed(self) -> None:
        with self.cond:
            self.halves += 1
            done = self.halves == 2 and not self.closed
            if done:
                self.closed = True
        if done:
            self.sock.close()
            self.listener.forget(self.cid)

    def abort(self, tell_host: bool) -> None:
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.cond.notify_all()
        self.incoming.put(b"")  # wakes pump_in
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes pump_out
        self.sock.close()
        self.listener.forget(self.cid)
        if tell_host:
            self.out.send(R_CLOSE, self.cid)


# ---------------------------------------------------------------------- files


class Read:
    def __init__(self, agent: Agent, rid: int, header: dict[str, Any]) -> None:
        self.agent = agent
        self.rid = rid
        self.path = header["p"]
        self.limit = int(header["l"])
        self.aborted = False

    def kill(self) -> None:
        self.aborted = True

    def feed(self, data: bytes | None) -> None:
        pass

    def run(self) -> None:
        out = self.agent.out
        try:
            fd = open_file(self.path, os.O_RDONLY)
        except Refused as refused:
            out.error(self.rid, refused.num, refused.what, refused.message)
            self.agent.finish(self.rid)
            return
        except OSError as exc:
            out.error(self.rid, exc.errno or 0, "path", exc.strerror or "")
            self.agent.finish(self.rid)
            return
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                out.error(self.rid, errno.EISDIR, "path", os.strerror(errno.EISDIR))
                return
            if stat.S_ISREG(info.st_mode) and info.st_size > self.limit:
                out.error(self.rid, errno.EFBIG, "limit", f"{info.st_size} bytes")
                return
            total = 0
            while not self.aborted:
                data = os.read(fd, READ_CHUNK)
                if not data:
                    out.send(DONE, self.rid)
                    return
                total += len(data)
                if total > self.limit:
                    out.error(self.rid, errno.EFBIG, "limit", f"more than {self.limit} bytes")
                    return
                out.send(CHUNK, self.rid, data)
        except OSError as exc:
            out.error(self.rid, exc.errno or 0, "path", exc.strerror or "")
        finally:
            os.close(fd)
            self.agent.finish(self.rid)


ABORT = b"abort"
"""Put on a Write's queue (by identity) when the host gave up on it: nothing is replaced."""


class Write:
    """A file written atomically where it can be: into a fresh temporary file next to the
    target, renamed over it once every byte is in, so a reader (or a crash, a kill of the
    sandbox, a dropped connection) sees the old content or the new, never a mix. The target
    keeps its mode and owner; a symlink is written through. Where a rename cannot keep those
    (the directory is not writable, the file belongs to another user and the agent is not
    root, the name is too long), the file is rewritten in place instead."""

    def __init__(self, agent: Agent, rid: int, header: dict[str, Any], inline: bytes) -> None:
        self.agent = agent
        self.rid = rid
        self.path = header["p"]
        self.data: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.data.put(inline)
        if header.get("x"):
            self.data.put(None)

    def kill(self) -> None:
        self.data.put(ABORT)

    def feed(self, data: bytes | None) -> None:
        self.data.put(data)

    def run(self) -> None:
        out = self.agent.out
        try:
            target, temp, fd = self.open()
        except Refused as refused:
            out.error(self.rid, refused.num, refused.what, refused.message)
            self.agent.finish(self.rid)
            return
        except OSError as exc:
            out.error(self.rid, exc.errno or 0, "path", exc.strerror or "")
            self.agent.finish(self.rid)
            return
        complete = False
        try:
            complete = self.copy(fd)
            os.close(fd)
            fd = -1
            if complete and temp is not None:
                replace(temp, target)
                temp = None
        except OSError as exc:
            out.error(self.rid, exc.errno or 0, "path", exc.strerror or "")
            complete = False
        finally:
            if fd >= 0:
                os.close(fd)
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            self.agent.finish(self.rid)
        if complete:
            out.send(DONE, self.rid)

    def copy(self, fd: int) -> bool:
        """Write the queued chunks; ``False`` if the host abandoned the write."""
        out = self.agent.out
        inline_first = True
        while True:
            data = self.data.get()
            if data is None:
                return True
            if data is ABORT:
                return False
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if inline_first:
                inline_first = False  # inline bytes are not counted in the host's window
            elif data:
                out.send(ACK, self.rid, U32.pack(len(data)))

    def open(self) -> tuple[str, str | None, int]:
        """(target, temporary file or None for in place, fd to write)."""
        target = os.path.realpath(self.path) if os.path.islink(self.path) else self.path
        try:
            info: os.stat_result | None = os.stat(target)
        except FileNotFoundError:
            info = None
            make_parents(target)
        if info is not None:
            if stat.S_ISDIR(info.st_mode):
                raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), target)
            os.close(open_file(target, os.O_WRONLY))  # writable? (a FIFO is refused here)
            if not stat.S_ISREG(info.st_mode) or (
                os.geteuid() not in (0, info.st_uid)
            ):  # a device, or a rename would change the owner: in place
                return target, None, open_file(target, os.O_WRONLY | os.O_TRUNC)
        directory = os.path.dirname(target) or "/"
        temp = os.path.join(directory, f".vf-sandbox-write-{os.getpid()}-{self.rid}")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError:  # not writable, read-only, too long...: in place
            return target, None, open_file(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            if info is not None:
                os.fchmod(fd, stat.S_IMODE(info.st_mode))
                if os.geteuid() == 0 and (info.st_uid, info.st_gid) != (0, 0):
                    os.fchown(fd, info.st_uid, info.st_gid)
            else:
                os.fchmod(fd, 0o666 & ~UMASK)
        except OSError:
            os.close(fd)
            os.unlink(temp)
            raise
        return target, temp, fd


def replace(temp: str, target: str) -> None:
    """Rename ``temp`` over ``target``; a target that is a mount point (docker bind-mounts
    /etc/hosts, /etc/hostname...) cannot be renamed over: its content is rewritten."""
    try:
        os.replace(temp, target)
        return
    except OSError as exc:
        if exc.errno not in (errno.EBUSY, errno.EXDEV):
            raise
    source = os.open(temp, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sink = open_file(target, os.O_WRONLY | os.O_TRUNC)
        try:
            while chunk := os.read(source, READ_CHUNK):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(sink, view) :]
        finally:
            os.close(sink)
    finally:
        os.close(source)
        os.unlink(temp)


def make_parents(path: str) -> None:
    parent = os.path.dirname(path) or "/"
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError:  # a parent is a file
        raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), parent) from None


def open_file(path: str, flags: int) -> int:
    """Open for a read or a write without ever waiting on a FIFO or a socket (a peer may
    never come): those are refused, as on every backend's plain path."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, or a socket
            raise Refused(errno.ENXIO, "special", "a FIFO or a socket, not a file") from None
        raise
    mode = os.fstat(fd).st_mode
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        os.close(fd)
        raise Refused(errno.ENXIO, "special", "a FIFO or a socket, not a file")
    os.set_blocking(fd, True)
    return fd


# ---------------------------------------------------------------------- entry point


def main() -> None:
    # Private copies of the stream; fds 0 and 1 point at /dev/null so that nothing written
    # to sys.stdout by accident can corrupt the framing.
    in_fd = os.dup(0)
    out_fd = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    for fd in (in_fd, out_fd):
        os.set_inheritable(fd, False)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # The bootstrap made the process non-dumpable before it read anything (set in the
    # namespace it runs this source in); the key arrives only after it said so.
    flags = NON_DUMPABLE if globals().get("_vf_nodump") else 0
    opening = read_exact(in_fd, KEY + 1)
    agent = Agent(in_fd, out_fd, opening[:KEY], flags)
    files = open_own_files() if opening[KEY] & 1 else None
    if files is not None:
        # Opened before HELLO (before any command can run): a file replaced afterwards is a
        # new inode, and the running interpreter cannot be rewritten in place (ETXTBSY).
        threading.Thread(target=report_digests, args=(agent, files), daemon=True).start()
    agent.serve()


def read_exact(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            os._exit(3)
        data += chunk
    return data


def own_files() -> list[str]:
    """The files this agent's code comes from: the interpreter, every module loaded (source
    and cached bytecode), and the dynamic loader's preload list (absent or not)."""
    paths = [os.path.realpath(sys.executable), "/etc/ld.so.preload"]
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        for name in (getattr(spec, "origin", None), getattr(spec, "cached", None)):
            if name and os.path.isabs(name) and name not in paths:
                paths.append(name)
    return paths


def open_own_files() -> list[tuple[str, int]]:
    opened = []
    for path in own_files():
        try:
            opened.append((path, os.open(path, os.O_RDONLY | os.O_CLOEXEC)))
        except OSError:
            opened.append((path, -1))  # absent (a bytecode cache, the preload list)
    return opened


def report_digests(agent: Agent, files: list[tuple[str, int]]) -> None:
    import hashlib

    payload = []
    for path, fd in files:
        if fd < 0:
            payload.append(text(path) + bytes(32))
            continue
        digest = hashlib.sha256()
        try:
            while chunk := os.read(fd, READ_CHUNK):
                digest.update(chunk)
        except OSError:
            continue
        finally:
            os.close(fd)
        payload.append(text(path) + digest.digest())
    agent.out.send(DIGEST, 0, b"".join(payload))


if __name__ in ("__main__", "__vf_sandbox_agent__"):
    main()
