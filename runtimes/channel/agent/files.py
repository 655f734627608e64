"""READ and WRITE in the agent: a file streamed out under the cap, a file written atomically
where it can be (agent part).

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import stat
from typing import TYPE_CHECKING

from .output import Refused
from .wire import ACK, CHUNK, DONE, READ_CHUNK, U32, ReadHeader, WriteHeader

if TYPE_CHECKING:
    from .serve import Agent

UMASK = os.umask(0o022)
os.umask(UMASK)  # read once: os.umask cannot be read without setting it (process-wide)


class Read:
    def __init__(self, agent: Agent, rid: int, header: ReadHeader) -> None:
        self.agent = agent
        self.rid = rid
        self.path = header.path
        self.limit = header.limit
        self.aborted = False

    def kill(self) -> None:
        self.aborted = True

    def feed(self, data: bytes | None) -> None:
        pass

    def run(self) -> None:
        out = self.agent.out
        try:
            fd = open_file(self.path, os.O_RDONLY)
        except (Refused, OSError) as exc:
            self.agent.refuse(self.rid, exc)
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
            out.os_error(self.rid, exc)
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

    def __init__(self, agent: Agent, rid: int, header: WriteHeader, inline: bytes) -> None:
        self.agent = agent
        self.rid = rid
        self.path = header.path
        self.data: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.data.put(inline)
        if header.complete:
            self.data.put(None)

    def kill(self) -> None:
        self.data.put(ABORT)

    def feed(self, data: bytes | None) -> None:
        self.data.put(data)

    def run(self) -> None:
        out = self.agent.out
        try:
            target, temp, fd = self.open()
        except (Refused, OSError) as exc:
            self.agent.refuse(self.rid, exc)
            return
        complete = False
        failure: OSError | None = None
        try:
            complete = self.copy(fd)
            os.close(fd)
            fd = -1
            if complete and temp is not None:
                replace(temp, target)
                temp = None
        except OSError as exc:
            failure = exc
            complete = False
        finally:
            if fd >= 0:
                os.close(fd)
            if temp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(temp)
            self.agent.finish(self.rid)
        # Answered only once the temporary file is gone: under a disk quota the host's
        # next write (after an ENOSPC) must find its room given back.
        if failure is not None:
            out.os_error(self.rid, failure)
        elif complete:
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
