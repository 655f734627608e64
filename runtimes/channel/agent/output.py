"""The agent's stdout, and a request refused before it started (agent part).

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host.
"""

from __future__ import annotations

import os
import threading

from .codec import Sealer
from .wire import ERROR, STARTED, ErrorReport


class Refused(Exception):
    """A request that could not start: answered with one ERROR frame."""

    def __init__(self, num: int, what: str, message: str = "") -> None:
        super().__init__(message)
        self.num = num
        self.what = what
        self.message = message or os.strerror(num)


class Output:
    """The agent's stdout: whole authenticated frames, one writer at a time."""

    def __init__(self, fd: int, key: bytes) -> None:
        self._fd = fd
        self._sealer = Sealer(key)
        self._lock = threading.Lock()
        self.broken = False

    def send(self, kind: int, rid: int, payload: bytes = b"", before: bytes = b"") -> None:
        """One frame, preceded in the same write by a STARTED frame of the same request
        carrying ``before`` (when not empty)."""
        with self._lock:
            if self.broken:
                return
            data = self._sealer.seal(STARTED, rid, before) if before else b""
            data += self._sealer.seal(kind, rid, payload)
            view = memoryview(data)
            try:
                while view:
                    written = os.write(self._fd, view)
                    view = view[written:]
            except OSError:
                self.broken = True

    def error(self, rid: int, num: int, what: str, message: str) -> None:
        self.send(ERROR, rid, ErrorReport(num, what, message).to_wire())

    def refused(self, rid: int, refused: Refused) -> None:
        self.error(rid, refused.num, refused.what, refused.message)

    def os_error(self, rid: int, exc: OSError, what: str = "path") -> None:
        """An ``OSError`` as an ERROR frame (``what``: ``path`` unless said)."""
        self.error(rid, exc.errno or 0, what, exc.strerror or "")
