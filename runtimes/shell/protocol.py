"""The framing between a :class:`~runtimes.shell.session.ShellSession` and its driver
(:mod:`runtimes.shell.driver`): ``type u8 | length u32 big-endian | payload`` both ways. The
driver runs in the sandbox and imports nothing from ``runtimes``, so it keeps its own copy of
these numbers (``tests/shell/test_driver.py`` checks the two agree); the host never imports
the driver, only ships its source."""

from __future__ import annotations

import struct
from functools import cache
from pathlib import Path

HEADER = struct.Struct(">BI")

# host -> driver
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


def frame(kind: int, payload: bytes = b"") -> bytes:
    """One frame, ready to write."""
    return HEADER.pack(kind, len(payload)) + payload


def resize_payload(rows: int, cols: int) -> bytes:
    return struct.pack(">HH", rows, cols)


MAX_PAYLOAD = 1 << 20
"""The longest payload the host accepts from the driver (it sends at most 64 KiB at once): a
header announcing more is refused before anything of it is buffered."""


class DriverProtocolError(Exception):
    """The driver sent what the real one never sends (an oversize frame, a status that is not
    a number): the sandbox's ``python3`` may have been replaced. The session is killed."""


class FrameParser:
    """Frames out of a byte stream cut anywhere."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The frames ``data`` completed, in order (a partial one waits for more).

        Raises:
            DriverProtocolError: a header announces more than :data:`MAX_PAYLOAD` bytes.
        """
        self._buffer += data
        frames: list[tuple[int, bytes]] = []
        offset = 0
        while len(self._buffer) - offset >= HEADER.size:
            kind, size = HEADER.unpack_from(self._buffer, offset)
            if size > MAX_PAYLOAD:
                raise DriverProtocolError(f"a frame of {size} bytes (at most {MAX_PAYLOAD})")
            end = offset + HEADER.size + size
            if len(self._buffer) < end:
                break
            frames.append((kind, bytes(self._buffer[offset + HEADER.size : end])))
            offset = end
        del self._buffer[:offset]
        return frames


def number(payload: bytes) -> int:
    """A READY or END payload: a pid or a status, in ASCII digits.

    Raises:
        DriverProtocolError: anything else.
    """
    if not payload.isdigit() or len(payload) > 10:
        raise DriverProtocolError(f"not a number: {payload[:40]!r}")
    return int(payload)


@cache
def driver_source() -> str:
    """The driver's source, shipped as ``python3 -c``."""
    return DRIVER.read_text(encoding="utf-8")


def driver_argv(*, pty: bool, rows: int, cols: int, grace: float) -> list[str]:
    """argv that starts the driver: isolated mode (no ``PYTHON*`` variables, no user site,
    no ``.pyc`` writes), so nothing planted in the sandbox's environment runs first."""
    return [
        "python3",
        "-I",
        "-S",
        "-B",
        "-c",
        driver_source(),
        "1" if pty else "0",
        str(rows),
        str(cols),
        repr(float(grace)),
    ]
