"""The wire between a :class:`~runtimes.shell.session.ShellSession` and its driver
(:mod:`runtimes.shell.driver`): the channel agent's, from the same code. The driver ships as the
agent does (:mod:`runtimes.channel.bootstrap`: ``python3 -I -S -B -c BOOTSTRAP``, which makes
the process non-dumpable, says ``ready`` and runs the source it reads from stdin); the host then
sends the per-start key, and every frame both ways is ``type u8 | request id u32 | length u32 |
payload | tag`` (:mod:`runtimes.channel.agent.codec`; request id always 0), tagged under that
key. The driver's first frame is ``GREET`` (its :data:`VERSION`), the host's ``OPEN`` (its
version and the session's terminal and grace). The frame kinds are the driver's own; the
driver's source holds the same numbers (``tests/shell/test_driver.py`` checks they agree); the
host never imports the driver, only ships its source."""

from __future__ import annotations

import secrets
import struct
from functools import cache
from pathlib import Path

from ..channel import agent, bootstrap
from ..channel.agent import wire
from ..channel.agent.codec import FrameError, Opener, Sealer

VERSION = 2
"""The shell protocol's version (1: the driver's own ``type u8 | length u32`` frames, shipped
as ``python3 -c <source>``). The driver refuses an ``OPEN`` of another version, the host a
``GREET`` of another version."""
HEADER = wire.HEADER
KEY = wire.KEY
TAG = wire.TAG
OPEN_FIELDS = struct.Struct(">IBHHd")
"""``OPEN``'s payload: ``u32 version | u8 pty | u16 rows | u16 cols | f64 interrupt grace``."""
VERSION_FIELD = struct.Struct(">I")

# host -> driver
OPEN = 0x4E
"""The first frame: :data:`OPEN_FIELDS`."""
RUN = 0x52
"""The command's bytes."""
INPUT = 0x49
"""Bytes for the terminal (pty sessions), while a command runs."""
INTERRUPT = 0x43
"""Interrupt the command in flight."""
RESIZE = 0x57
"""The terminal's rows and columns, u16 each."""
QUIT = 0x51
"""End the session."""
# driver -> host
GREET = 0x48
"""The first frame: the driver's protocol version, u32 (``HELLO`` is the agent's)."""
READY = 0x53
"""The shell is ready; the payload is its pid."""
OUT = 0x4F
"""Stdout bytes (pty: everything the terminal wrote)."""
ERR = 0x45
"""Stderr bytes."""
END = 0x58
"""The command ended; the payload is its status, in ASCII."""
DEAD = 0x44
"""The session is dead; the payload is the reason, UTF-8."""

DRIVER = Path(__file__).with_name("driver.py")
GREETING_MAX = max(len(bootstrap.READY), len(bootstrap.NO_PYTHON))
MAX_PAYLOAD = 1 << 20
"""The longest payload the host accepts from the driver (it sends at most 64 KiB at once): a
header announcing more is refused before anything of it is buffered."""


class DriverProtocolError(Exception):
    """The driver sent what the real one never sends (an oversize or forged frame, another
    version, a status that is not a number): the sandbox's ``python3`` may have been replaced.
    The session is killed."""


def resize_payload(rows: int, cols: int) -> bytes:
    return struct.pack(">HH", rows, cols)


def open_payload(*, pty: bool, rows: int, cols: int, grace: float, version: int = VERSION) -> bytes:
    return OPEN_FIELDS.pack(version, 1 if pty else 0, rows, cols, float(grace))


class FrameParser:
    """The driver's frames out of its stdout cut anywhere, authenticated under ``key``."""

    def __init__(self, key: bytes) -> None:
        self._opener = Opener(key, MAX_PAYLOAD)

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not complete yet."""
        return len(self._opener.buffer)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """``(kind, payload)`` of each frame ``data`` completed, in order.

        Raises:
            DriverProtocolError: a header announces more than :data:`MAX_PAYLOAD` bytes, a
                frame fails authentication or names a request.
        """
        try:
            frames = self._opener.feed(data)
        except FrameError as exc:
            raise DriverProtocolError(str(exc)) from None
        for _, rid, _ in frames:
            if rid != 0:
                raise DriverProtocolError(f"a frame of request {rid} (the driver has none)")
        return [(kind, payload) for kind, _, payload in frames]


class Link:
    """The host's end of one driver's stream, without I/O: what to write first (the driver's
    source, for the bootstrap), the bootstrap's ``ready`` answered with the key and ``OPEN``,
    the driver's ``GREET`` checked, then its frames."""

    def __init__(self, *, pty: bool, rows: int, cols: int, grace: float) -> None:
        self._key = secrets.token_bytes(KEY)
        """Sent only after the bootstrap made the driver non-dumpable; never in argv, the
        environment or a file."""
        self._sealer = Sealer(self._key)
        self._parser = FrameParser(self._key)
        self._open = open_payload(pty=pty, rows=rows, cols=cols, grace=grace)
        self._head = b""
        self.keyed = False
        """The bootstrap said ``ready`` and was sent the key: frames may go out."""
        self.greeted = False
        self.no_python = False
        """The probe found no usable ``python3`` (and said so)."""

    def opening(self) -> bytes:
        """The bytes the driver's stdin starts with: its source, for the bootstrap."""
        return driver_source()

    def seal(self, kind: int, payload: bytes = b"") -> bytes:
        """A frame to the driver; nothing before it was keyed (it reads no frame then)."""
        return self._sealer.seal(kind, 0, payload) if self.keyed else b""

    def feed(self, data: bytes) -> tuple[bytes, list[tuple[int, bytes]]]:
        """(bytes to write to the driver now, the frames ``data`` completed after ``GREET``).

        Raises:
            DriverProtocolError: the stream does not begin with the bootstrap's ``ready``
                and a ``GREET`` of this version, or a frame is not the driver's.
        """
        reply = b""
        if not self.keyed:
            rest = self._greet(data)
            if rest is None:
                return b"", []
            data = rest
            reply = self._key + self._sealer.seal(OPEN, 0, self._open)
        frames = self._parser.feed(data)
        if frames and not self.greeted:
            kind, payload = frames.pop(0)
            self._check_hello(kind, payload)
        return reply, frames

    def _greet(self, data: bytes) -> bytes | None:
        """What follows the bootstrap's ``ready`` line once it is all here (else None)."""
        if self.no_python:
            return None
        head = self._head + data[:GREETING_MAX]
        if head.startswith(bootstrap.NO_PYTHON) or bootstrap.NO_PYTHON.startswith(head):
            self.no_python = head.startswith(bootstrap.NO_PYTHON)
            self._head = head
            return None
        if not (head.startswith(bootstrap.READY) or bootstrap.READY.startswith(head)):
            raise DriverProtocolError(f"the driver began with {head[:40]!r}")
        if len(head) < len(bootstrap.READY):
            self._head = head
            return None
        self.keyed = True
        return data[len(bootstrap.READY) - len(self._head) :]

    def _check_hello(self, kind: int, payload: bytes) -> None:
        if kind != GREET or len(payload) != VERSION_FIELD.size:
            raise DriverProtocolError(f"the driver's first frame is not its greeting (type {kind})")
        (version,) = VERSION_FIELD.unpack(payload)
        if version != VERSION:
            raise DriverProtocolError(
                f"the driver speaks shell protocol version {version}, not {VERSION}"
            )
        self.greeted = True


def number(payload: bytes) -> int:
    """A READY or END payload: a pid or a status, in ASCII digits.

    Raises:
        DriverProtocolError: anything else.
    """
    if not payload.isdigit() or len(payload) > 10:
        raise DriverProtocolError(f"not a number: {payload[:40]!r}")
    return int(payload)


DRIVER_PROLOGUE = (
    '"""The vf-sandbox shell driver, joined from runtimes/channel/agent/wire.py, codec.py and '
    'runtimes/shell/driver.py (see docs/shell.md)."""\n\nfrom __future__ import annotations\n\n'
)
DRIVER_PARTS = (
    Path(agent.__file__).with_name("wire.py"),
    Path(agent.__file__).with_name("codec.py"),
    DRIVER,
)


@cache
def driver_source() -> bytes:
    """The driver's one source (the agent's wire and codec, then the driver), prefixed with
    its length as the bootstrap reads it."""
    return bootstrap.shipped(agent.join_sources(list(DRIVER_PARTS), DRIVER_PROLOGUE))


def driver_command(interpreter: str | None = None) -> list[str]:
    """argv that starts the driver, as the agent starts (:func:`bootstrap.agent_command`):
    ``/bin/sh -c PROBE`` with a ``PATH`` search for ``python3`` run isolated (``-I -S -B``: no
    ``PYTHON*`` variables, no site, no ``.pyc`` writes), or ``interpreter`` by absolute path."""
    return bootstrap.agent_command(interpreter, shell="/bin/sh")
