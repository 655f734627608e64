"""The channel's wire format, the same bytes on both sides: frame layout, frame kinds, the
frame tag, and every request and answer header as a typed value with ``to_wire`` and
``from_wire``.

Shared: the host imports this module (:mod:`runtimes.channel.connection`), and it is the
first part of the agent's joined source (:mod:`runtimes.channel.agent`). Standard library
only, Python >= 3.8 syntax and API; see the package docstring for the protocol.
"""

from __future__ import annotations

import hmac
import struct

VERSION = 5

HEADER = struct.Struct(">BII")
"""Every frame: ``type (u8) | request id (u32) | payload length (u32)``, then the payload,
then the tag."""
SEQ = struct.Struct(">Q")
TAG = 16
"""Bytes of HMAC-SHA256 (truncated) after every frame's payload, both directions."""
KEY = 32
"""Bytes of the per-start key the host sends right after the bootstrap read the source."""
U8 = struct.Struct(">B")
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")
I32 = struct.Struct(">i")
HELLO_FIELDS = struct.Struct(">IIIIII")
NON_DUMPABLE = 1
"""HELLO flag: the agent made itself non-dumpable (no /proc/<pid>/fd, no ptrace)."""
DIGEST_SIZE = 32
"""Bytes of each sha256 in a DIGEST frame."""

# host -> agent
EXEC, DATA, EOF, KILL, READ, WRITE, STAT, REMOVE = 1, 2, 3, 4, 5, 6, 7, 8
# agent -> host
HELLO, STARTED, STDOUT, STDERR, EXIT, ERROR, CHUNK, DONE, ACK = 64, 65, 66, 67, 68, 69, 70, 71, 72
ALERT, DIGEST = 73, 74
"""Request id 0: ALERT (text reason): the agent received a frame that failed authentication
and exits; DIGEST (text path, 32-byte sha256, repeated): the files the agent runs from."""
STDIN_CLOSED = 76
"""Agent -> host, once per EXEC: the command no longer reads its stdin (it closed it or
exited); the host stops sending DATA for it."""
# the relay: LISTEN host -> agent, OPENED agent -> host, the rest both ways
LISTEN = 9
HALT = 10
"""Host -> agent, at close: freeze (``kill(-1, SIGSTOP)``), then SIGKILL every process the
agent may signal but itself and PID 1; ``DONE`` once none runs any more."""
SWEEP = 11
"""Host -> agent (``SweepHeader``): ``stop_processes()`` without forking: freeze, then kill
the matching processes, as ``scripts/sweep.sh`` does, then ``DONE`` (``u32`` killed)."""
LSTAT = 12
"""Host -> agent (``ReadHeader``): what is at a path, never following a link there
(``lstat``), and a regular file's first bytes up to the cap, read through ``O_NOFOLLOW``;
``DONE`` with a ``PathInfo``. The judge machinery's probes use it instead of ``sh``, ``stat``
and ``head``, which a root policy may have replaced."""
MKDIR = 13
"""Host -> agent (``MkdirHeader``): make one fresh directory (its parent a real directory,
never a link), with exactly this mode and owner; ``DONE``."""
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
"""The most output bytes the agent reads (and forwards) at once."""
EXIT_GRACE = 0.2
"""Seconds a command's output is still taken after the command itself exited (what its
background processes write to the pipes they inherited); later output is read and discarded
(the host's ``exec`` and the agent alike: ``docs/processes.md``)."""

STDIN_FOLLOWS = 1
"""EXEC flag: the command's stdin is a pipe fed by the request (inline, then DATA frames)."""
COMPLETE = 2
"""EXEC / WRITE flag: the inline bytes are all of the stdin / content (no DATA follows)."""


def mac(key: bytes, seq: int, header: bytes, payload: bytes) -> bytes:
    """A frame's tag: HMAC-SHA256 over the direction's sequence number, the header and the
    payload, truncated to TAG bytes. The sequence number makes a frame valid only at its
    place in the stream: nothing can be replayed, dropped or reordered unnoticed."""
    if len(payload) < 65536:
        return hmac.digest(key, SEQ.pack(seq) + header + payload, "sha256")[:TAG]
    digest = hmac.new(key, SEQ.pack(seq) + header, "sha256")
    digest.update(payload)
    return digest.digest()[:TAG]


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

    def raw(self, size: int) -> bytes:
        value = self.data[self.pos : self.pos + size]
        self.pos += size
        return value

    def more(self) -> bool:
        return self.pos < len(self.data)


def prefixed(header: bytes) -> bytes:
    """A header as it precedes inline data in EXEC and WRITE: ``u32 length | header``."""
    return U32.pack(len(header)) + header


def split_prefixed(payload: bytes) -> tuple[bytes, bytes]:
    """(header, inline data) of an EXEC or WRITE payload."""
    (size,) = U32.unpack_from(payload, 0)
    return payload[4 : 4 + size], payload[4 + size :]


class ExecHeader:
    """EXEC: ``u8 flags | u64 output cap | text cwd | text user ("": the agent's) | u32 argc |
    argc x text | u32 envc | envc x (text name, text value)``; inline stdin follows it."""

    def __init__(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        user: str | None,
        output_limit: int,
        has_stdin: bool,
        stdin_complete: bool,
    ) -> None:
        self.argv = argv
        self.cwd = cwd
        self.env = env
        self.user = user
        self.output_limit = output_limit
        self.has_stdin = has_stdin
        self.stdin_complete = stdin_complete

    def to_wire(self) -> bytes:
        flags = (STDIN_FOLLOWS if self.has_stdin else 0) | (COMPLETE if self.stdin_complete else 0)
        parts = [
            U8.pack(flags),
            U64.pack(self.output_limit),
            text(self.cwd),
            text(self.user or ""),
            U32.pack(len(self.argv)),
        ]
        parts += [text(arg) for arg in self.argv]
        parts.append(U32.pack(len(self.env)))
        for name, value in self.env.items():
            parts += (text(name), text(value))
        return b"".join(parts)

    @classmethod
    def from_wire(cls, data: bytes) -> ExecHeader:
        fields = Fields(data)
        flags = fields.number(U8)
        output_limit = fields.number(U64)
        cwd = fields.text()
        user = fields.text() or None
        argv = [fields.text() for _ in range(fields.number(U32))]
        env = {}
        for _ in range(fields.number(U32)):
            name = fields.text()
            env[name] = fields.text()
        return cls(
            argv, cwd, env, user, output_limit, bool(flags & STDIN_FOLLOWS), bool(flags & COMPLETE)
        )


class WriteHeader:
    """WRITE: ``u8 flags (COMPLETE) | text path``; inline content follows it."""

    def __init__(self, path: str, complete: bool) -> None:
        self.path = path
        self.complete = complete

    def to_wire(self) -> bytes:
        return U8.pack(COMPLETE if self.complete else 0) + text(self.path)

    @classmethod
    def from_wire(cls, data: bytes) -> WriteHeader:
        fields = Fields(data)
        flags = fields.number(U8)
        return cls(fields.text(), bool(flags & COMPLETE))


KINDS = ("absent", "file", "directory", "symlink", "other")
"""``PathInfo`` kinds, by their number on the wire."""


class PathInfo:
    """LSTAT's answer: ``u8 kind | u32 mode | u32 uid | u32 gid | u32 links | u64 size |
    text link target | content`` (the rest: a regular file's bytes, at most cap + 1)."""

    FIXED = struct.Struct(">BIIIIQ")

    def __init__(
        self,
        kind: str,
        mode: int = 0,
        uid: int = 0,
        gid: int = 0,
        links: int = 0,
        size: int = 0,
        target: str = "",
        content: bytes = b"",
    ) -> None:
        self.kind = kind
        self.mode = mode
        self.uid = uid
        self.gid = gid
        self.links = links
        self.size = size
        self.target = target
        self.content = content

    def to_wire(self) -> bytes:
        fixed = self.FIXED.pack(
            KINDS.index(self.kind), self.mode, self.uid, self.gid, self.links, self.size
        )
        return fixed + text(self.target) + self.content

    @classmethod
    def from_wire(cls, data: bytes) -> PathInfo:
        kind, mode, uid, gid, links, size = cls.FIXED.unpack_from(data, 0)
        fields = Fields(data)
        fields.pos = cls.FIXED.size
        target = fields.text()
        if kind >= len(KINDS) or fields.pos > len(data):
            raise ValueError("malformed path info")
        return cls(KINDS[kind], mode, uid, gid, links, size, target, data[fields.pos :])


class MkdirHeader:
    """MKDIR: ``u32 mode | i32 uid | i32 gid | text path`` (-1: the agent's own)."""

    def __init__(self, path: str, mode: int, uid: int = -1, gid: int = -1) -> None:
        self.path = path
        self.mode = mode
        self.uid = uid
        self.gid = gid

    def to_wire(self) -> bytes:
        return U32.pack(self.mode) + I32.pack(self.uid) + I32.pack(self.gid) + text(self.path)

    @classmethod
    def from_wire(cls, data: bytes) -> MkdirHeader:
        fields = Fields(data)
        mode = fields.number(U32)
        uid = fields.number(I32)
        gid = fields.number(I32)
        return cls(fields.text(), mode, uid, gid)


class ReadHeader:
    """READ: ``u64 cap | text path``."""

    def __init__(self, path: str, limit: int) -> None:
        self.path = path
        self.limit = limit

    def to_wire(self) -> bytes:
        return U64.pack(self.limit) + text(self.path)

    @classmethod
    def from_wire(cls, data: bytes) -> ReadHeader:
        fields = Fields(data)
        limit = fields.number(U64)
        return cls(fields.text(), limit)


class PathHeader:
    """STAT and REMOVE: ``text path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def to_wire(self) -> bytes:
        return text(self.path)

    @classmethod
    def from_wire(cls, data: bytes) -> PathHeader:
        return cls(Fields(data).text())


class SweepHeader:
    """SWEEP: ``text mode | text mark | text user | text home``: the arguments of
    ``scripts/sweep.sh`` (mode ``all``, ``since:T`` or ``mark``; ``""``: none), whose spared
    session is always the agent's own."""

    def __init__(self, mode: str, mark: str, user: str = "", home: str = "") -> None:
        self.mode = mode
        self.mark = mark
        self.user = user
        self.home = home

    def to_wire(self) -> bytes:
        return text(self.mode) + text(self.mark) + text(self.user) + text(self.home)

    @classmethod
    def from_wire(cls, data: bytes) -> SweepHeader:
        fields = Fields(data)
        mode, mark, user = fields.text(), fields.text(), fields.text()
        return cls(mode, mark, user, fields.text())


class ListenHeader:
    """LISTEN: ``u32 max connections | u32 window | u16 port`` (0: any free port)."""

    def __init__(self, max_connections: int, window: int, port: int) -> None:
        self.max_connections = max_connections
        self.window = window
        self.port = port

    def to_wire(self) -> bytes:
        return U32.pack(self.max_connections) + U32.pack(self.window) + U16.pack(self.port)

    @classmethod
    def from_wire(cls, data: bytes) -> ListenHeader:
        fields = Fields(data)
        return cls(fields.number(U32), fields.number(U32), fields.number(U16))


class Hello:
    """HELLO (request id 0, the agent's first frame): ``u32 version, pid, sid, uid, gid,
    flags | text python | text executable`` (flags: NON_DUMPABLE)."""

    def __init__(
        self,
        version: int,
        pid: int,
        sid: int,
        uid: int,
        gid: int,
        flags: int,
        python: str,
        executable: str,
    ) -> None:
        self.version = version
        self.pid = pid
        self.sid = sid
        self.uid = uid
        self.gid = gid
        self.flags = flags
        self.python = python
        self.executable = executable

    def to_wire(self) -> bytes:
        ids = HELLO_FIELDS.pack(self.version, self.pid, self.sid, self.uid, self.gid, self.flags)
        return ids + text(self.python) + text(self.executable)

    @classmethod
    def from_wire(cls, data: bytes) -> Hello:
        """Raises ``ValueError`` (``struct.error``) or ``IndexError`` when malformed."""
        version, pid, sid, uid, gid, flags = HELLO_FIELDS.unpack_from(data, 0)
        fields = Fields(data[HELLO_FIELDS.size :])
        python = fields.text()
        return cls(version, pid, sid, uid, gid, flags, python, fields.text())


class ErrorReport:
    """ERROR: ``i32 errno | text what | text message``. ``what`` is ``prog``, ``cwd``,
    ``user``, ``path``, ``limit``, ``special`` (a FIFO or a socket where a file is expected),
    ``pids`` (no process or thread could be made: the sandbox is at its process limit;
    ``EAGAIN``, the message is the cgroup's ``pids.max`` or ``""``), ``internal`` (an
    unexpected failure, message attached) or ``unsupported`` (the host then uses its plain
    path)."""

    def __init__(self, num: int, what: str, message: str) -> None:
        self.num = num
        self.what = what
        self.message = message

    def to_wire(self) -> bytes:
        return I32.pack(self.num) + text(self.what) + text(self.message)

    @classmethod
    def from_wire(cls, data: bytes) -> ErrorReport:
        fields = Fields(data)
        num = fields.number(I32)
        what = fields.text()
        return cls(num, what, fields.text())


def digests_to_wire(digests: list[tuple[str, bytes]]) -> bytes:
    """DIGEST: ``(text path, 32-byte sha256)`` repeated (zeros: the file is absent)."""
    return b"".join(text(path) + digest for path, digest in digests)


def digests_from_wire(data: bytes) -> dict[str, bytes]:
    fields = Fields(data)
    digests = {}
    while fields.more():
        path = fields.text()
        digests[path] = fields.raw(DIGEST_SIZE)
    return digests
