"""One authenticated frame stream, either end, without I/O: :class:`Sealer` numbers and tags
the frames one side writes, :class:`Opener` takes the frames the other side wrote off a byte
stream cut anywhere. The layout and the tag are :mod:`.wire`'s: ``type (u8) | request id
(u32) | length (u32) | payload | tag``, the tag HMAC-SHA256 (truncated) under the per-start key
over the direction's sequence number, the header and the payload.

Shared: the shell driver's joined source (:mod:`runtimes.shell.driver`, shipped by the same
bootstrap as the channel agent) and the host's end of it (:mod:`runtimes.shell.protocol`)
both use these two classes. Standard library only, Python >= 3.8 (it may be joined into a
program that runs in a sandbox); it imports nothing but :mod:`.wire`.
"""

from __future__ import annotations

import hmac

from .wire import HEADER, TAG, mac


class FrameError(Exception):
    """The stream is not what the other end writes: a frame that fails authentication, or a
    header announcing more than the reader accepts. Nothing after it may be trusted."""


class Sealer:
    """The frames one side writes, each tagged at its place in the stream."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.seq = 0

    def seal(self, kind: int, rid: int, payload: bytes = b"") -> bytes:
        """One whole frame, ready to write (and numbered: write them in this order)."""
        header = HEADER.pack(kind, rid, len(payload))
        tag = mac(self.key, self.seq, header, payload)
        self.seq += 1
        return header + payload + tag


class Opener:
    """Whole authenticated frames off a byte stream cut anywhere; at most ``limit`` bytes of
    payload a frame (a header announcing more is refused before anything of it is kept)."""

    def __init__(self, key: bytes, limit: int) -> None:
        self.key = key
        self.limit = limit
        self.seq = 0
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """``(kind, request id, payload)`` of each frame ``data`` completed, in order (a
        partial one waits for more).

        Raises:
            FrameError: a frame failed authentication, or announced more than ``limit``
                bytes; the frames before it are not returned either (the stream is over).
        """
        self.buffer += data
        frames = []
        pos = 0
        buf = self.buffer
        while len(buf) - pos >= HEADER.size:
            kind, rid, size = HEADER.unpack_from(buf, pos)
            if size > self.limit:
                raise FrameError(f"a frame of {size} bytes (at most {self.limit})")
            end = pos + HEADER.size + size
            if end + TAG > len(buf):
                break
            header = bytes(buf[pos : pos + HEADER.size])
            payload = bytes(buf[pos + HEADER.size : end])
            expected = mac(self.key, self.seq, header, payload)
            if not hmac.compare_digest(expected, bytes(buf[end : end + TAG])):
                raise FrameError(f"frame #{self.seq} (type {kind}) failed authentication")
            self.seq += 1
            frames.append((kind, rid, payload))
            pos = end + TAG
        del buf[:pos]
        return frames
