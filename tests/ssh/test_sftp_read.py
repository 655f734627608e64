"""An SFTP read that a dying connection cuts short is the connection's failure, never a
shorter file.

paramiko's ``SFTPFile.read`` ends quietly at an ``EOFError``: that is how it meets the end
of a file, and also what its next request raises when the connection died under the read
(the prefetched chunks answered, the next one never sent). Taken at its word, a read racing
a dying transport returned the first part of the file as if it were all of it (seen once in
``test_transport_death.py``'s ``shutdown`` case). Here paramiko's file is replaced by one
that does exactly that, without a server.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from runtimes.ssh.files import sftp_read

FILE = bytes(range(256)) * 64  # 16 KiB


class _File:
    """An open SFTP file whose reads stop after ``served`` bytes, as paramiko's do when the
    connection died under them; ``stat()`` answers ``now`` or raises as a dead one does."""

    def __init__(self, served: int, now: int | None) -> None:
        self._data = FILE[:served]
        self._now = now

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def prefetch(self, size: int) -> None:
        return None

    def read(self, size: int) -> bytes:
        chunk, self._data = self._data[:size], self._data[size:]
        return chunk

    def stat(self) -> SimpleNamespace:
        if self._now is None:
            raise EOFError  # paramiko, on a connection that is gone
        return SimpleNamespace(st_size=self._now, st_mode=0o100644)


def _sftp(file: _File) -> Any:
    return SimpleNamespace(
        stat=lambda path: SimpleNamespace(st_size=len(FILE), st_mode=0o100644),
        open=lambda path, mode: file,
    )


def test_a_read_cut_short_by_a_dead_connection_raises() -> None:
    with pytest.raises(EOFError):
        sftp_read(cast(Any, _sftp(_File(served=4096, now=None))), "/w/f", 1 << 20)


def test_a_whole_read_and_a_file_that_shrank_are_read_as_they_are() -> None:
    assert sftp_read(_sftp(_File(served=len(FILE), now=None)), "/w/f", 1 << 20) == FILE
    # the file shrank between the stat and the read: what it holds now
    assert sftp_read(_sftp(_File(served=4096, now=4096)), "/w/f", 1 << 20) == FILE[:4096]
