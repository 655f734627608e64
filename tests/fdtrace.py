"""Opt-in descriptor tracer: catches code that reads or closes a socket's descriptor by
number (``os.read`` / ``os.close`` / ``os.readv`` on an int fd that is a socket).

Nothing in this project reads or closes a socket through ``os``: sockets are read and
closed through their ``socket.socket`` object, which forgets its number on close. A call
that does is using a *stale* number (a pipe, pidfd or file it closed, now reused by a
socket): it steals bytes from, or closes, somebody else's socket. This is how an SSH
transport's inbound stream gets desynchronised (paramiko: "Invalid packet blocking").

Use it as a pytest plugin, with the log file in ``VF_FDTRACE``::

    VF_FDTRACE=/tmp/fdtrace.log .venv/bin/pytest -p tests.fdtrace tests/reliability/...

or call :func:`install` in any script. Each hit appends the call, the fd, what the fd
is now (``/proc/self/fd`` link) and the Python stack of the calling thread to the log. A
failed ``os.close`` (``EBADF``: a double close) is logged the same way. The cost is one
``fstat`` per traced call; leave it off in normal runs.
"""

from __future__ import annotations

import os
import stat
import threading
import traceback
from collections.abc import Callable
from typing import Any

_lock = threading.Lock()
_installed: dict[str, Callable[..., Any]] = {}


def _describe(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _is_socket(fd: int) -> bool:
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False


def _log(path: str, what: str, fd: int, target: str) -> None:
    stack = "".join(traceback.format_stack()[:-2])
    entry = f"=== {what} fd={fd} ({target}) thread={threading.current_thread().name}\n{stack}"
    with _lock, open(path, "a", encoding="utf-8") as log:
        log.write(entry)


def install(path: str) -> None:
    """Trace ``os.read``, ``os.readv`` and ``os.close`` on sockets, and failed closes, into
    ``path``. Idempotent."""
    if _installed:
        return
    real_read, real_readv, real_close = os.read, os.readv, os.close
    _installed.update(read=real_read, readv=real_readv, close=real_close)

    def read(fd: int, n: int) -> bytes:
        if _is_socket(fd):
            _log(path, "os.read", fd, _describe(fd))
        return real_read(fd, n)

    def readv(fd: int, buffers: Any) -> int:
        if _is_socket(fd):
            _log(path, "os.readv", fd, _describe(fd))
        return real_readv(fd, buffers)

    def close(fd: int) -> None:
        if _is_socket(fd):
            _log(path, "os.close", fd, _describe(fd))
        try:
            real_close(fd)
        except OSError as exc:
            _log(path, f"os.close failed: {exc.strerror}", fd, "-")
            raise

    os.read, os.readv, os.close = read, readv, close


def uninstall() -> None:
    """Put the real functions back."""
    if _installed:
        os.read = _installed.pop("read")
        os.readv = _installed.pop("readv")
        os.close = _installed.pop("close")


if os.environ.get("VF_FDTRACE"):
    install(os.environ["VF_FDTRACE"])
