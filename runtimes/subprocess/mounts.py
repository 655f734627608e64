"""Whether a file operation may run in the event loop's own thread: every filesystem mounted
is one whose path lookups and page-cache reads never wait on another process or the network.

A thread hand-off costs more than a small file operation (0.1-0.3 ms, twice per call, the
most of a 1 KiB ``write`` + ``read``), so the subprocess backend does small operations on
regular files inline, and hands to a worker thread what may wait: a large file, anything but
a regular file (a FIFO is refused anyway, a terminal or ``/proc`` file may block), and every
operation while a filesystem of another kind is mounted anywhere (FUSE, NFS, CIFS, autofs...:
a lookup there can wait for a daemon or a server, possibly for ever, and a link can lead
there from anywhere). The mount table is read again only when the kernel says it changed
(``poll`` on ``/proc/self/mountinfo``), so the check is one ``poll`` call.

Not a security boundary (the subprocess sandbox's commands run as the host's user and could
stop the host process anyway): it keeps a host whose mounts may hang (a stale NFS server)
from having its event loop held by a file call.
"""

from __future__ import annotations

import os
import select
import threading

LOCAL_TYPES = frozenset(
    {
        "btrfs",
        "bpf",
        "cgroup",
        "cgroup2",
        "configfs",
        "debugfs",
        "devpts",
        "devtmpfs",
        "efivarfs",
        "erofs",
        "exfat",
        "ext2",
        "ext3",
        "ext4",
        "f2fs",
        "fusectl",
        "hugetlbfs",
        "iso9660",
        "mqueue",
        "nsfs",
        "ntfs3",
        "overlay",
        "proc",
        "pstore",
        "ramfs",
        "securityfs",
        "selinuxfs",
        "squashfs",
        "sysfs",
        "tmpfs",
        "tracefs",
        "udf",
        "vfat",
        "xfs",
        "zfs",
    }
)
"""Filesystem types whose lookups and cached reads never wait on another process or the
network. Any other type mounted anywhere sends every file operation to a worker thread."""

MOUNTINFO = "/proc/self/mountinfo"
INLINE_READ_BYTES = 16 * 1024 * 1024
"""A regular file up to this size is read in the event loop's thread (a page-cache copy:
about 1 ms for 16 MiB); a larger one in a worker thread."""
INLINE_WRITE_BYTES = 1024 * 1024
"""Data up to this size is written in the event loop's thread (a write past it may be held
by the kernel's dirty-page throttling)."""


class MountWatch:
    """The answer to "are all mounts local?", kept up to date by ``poll`` on the mount
    table. Thread-safe; a process that forked reopens the table."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid = -1
        self._fd = -1
        self._poller: select.poll | None = None
        self._local = False

    def all_local(self) -> bool:
        """Whether every mounted filesystem is of a :data:`LOCAL_TYPES` type (False when
        the mount table cannot be read)."""
        with self._lock:
            try:
                if self._pid != os.getpid():
                    self._open()
                elif self._poller is not None and self._poller.poll(0):
                    self._local = self._read()
            except OSError:
                self._local = False
            return self._local

    def _open(self) -> None:
        """Open the mount table afresh (first use, or in a forked child) and read it.

        Raises:
            OSError: the mount table cannot be opened or read.
        """
        if self._fd >= 0:
            os.close(self._fd)  # the parent's, inherited across a fork
            self._fd = -1
        self._pid = os.getpid()
        self._local = False
        self._poller = None
        fd = os.open(MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
        self._fd = fd
        poller = select.poll()
        poller.register(fd, select.POLLPRI | select.POLLERR)
        self._poller = poller
        self._local = self._read()

    def _read(self) -> bool:
        """Read the whole table from its start: whether every mount is local.

        Raises:
            OSError: the mount table cannot be read.
        """
        os.lseek(self._fd, 0, os.SEEK_SET)
        chunks = []
        while True:
            chunk = os.read(self._fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
        return all_local_types(b"".join(chunks))


def all_local_types(mountinfo: bytes) -> bool:
    """Whether every line of a ``mountinfo`` table names a :data:`LOCAL_TYPES` type (the
    field after the ``-`` separator)."""
    for line in mountinfo.splitlines():
        fields = line.split()
        try:
            kind = fields[fields.index(b"-") + 1]
        except (ValueError, IndexError):
            return False
        if kind.decode("ascii", "replace") not in LOCAL_TYPES:
            return False
    return True


WATCH = MountWatch()
"""This process's watch of its mount table."""
