"""Who owns a sandbox: the labels every backend puts on what it creates.

The *creator* is the Python process that created a sandbox. Every sandbox carries labels
naming the owner (``user@host``), the creator (:data:`CREATOR_ID`, one id per process), the
host and the process (pid plus its start time, so a recycled pid is not mistaken for the
creator). ``vf-sandbox cleanup`` uses them to find sandboxes whose creator is dead. A sandbox
created with ``keep=True`` also carries :data:`KEEP`: it outlives its creator on purpose, and
only an explicit removal takes it.

The creator's label key is ``vf-sandbox.session``, and ``ls --json`` calls the field
``session``: both are kept from earlier releases so that sandboxes they created are still
recognised and scripts reading the JSON keep working.
"""

from __future__ import annotations

import datetime as _dt
import getpass
import os
import socket
import uuid
from collections.abc import Mapping

LABEL_PREFIX = "vf-sandbox."
OWNER = LABEL_PREFIX + "owner"
CREATOR = LABEL_PREFIX + "session"
CREATED = LABEL_PREFIX + "created"
HOST = LABEL_PREFIX + "host"
PID = LABEL_PREFIX + "pid"
PID_START = LABEL_PREFIX + "pid-start"
BACKEND = LABEL_PREFIX + "backend"
KEEP = LABEL_PREFIX + "keep"

CREATOR_ID = uuid.uuid4().hex


def proc_stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 2, which may hold
    spaces and parentheses): index 0 is the state (field 3), 19 the start time in clock
    ticks since boot (field 22). ``None`` when the process is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def _process_start_ticks(pid: int) -> str | None:
    """The process start time in clock ticks since boot."""
    fields = proc_stat_fields(pid)
    return fields[19].decode() if fields is not None and len(fields) > 19 else None


def _owner() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def ownership_labels(
    backend: str, extra: Mapping[str, str] | None = None, *, keep: bool = False
) -> dict[str, str]:
    """Labels for a sandbox created now by this process (``keep``: one that close() keeps)."""
    labels = {
        OWNER: _owner(),
        CREATOR: CREATOR_ID,
        CREATED: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        HOST: socket.gethostname(),
        PID: str(os.getpid()),
        PID_START: _process_start_ticks(os.getpid()) or "",
        BACKEND: backend,
    }
    if extra:
        labels.update(extra)
    if keep:
        labels[KEEP] = "true"
    return labels


def is_kept(labels: Mapping[str, str]) -> bool:
    """Whether a sandbox was created with ``keep=True`` (spared by every sweep but an
    explicit ``cleanup --kept`` / ``--all``)."""
    return labels.get(KEEP) == "true"


def creator_is_dead(labels: Mapping[str, str]) -> bool | None:
    """Whether the process that created a sandbox (its creator) has ended.

    ``None`` when it cannot be known from here (created on another host, or labels
    missing); callers treat that as alive unless told otherwise.
    """
    if labels.get(CREATOR) == CREATOR_ID:
        return False
    if labels.get(HOST) != socket.gethostname():
        return None
    try:
        pid = int(labels.get(PID, ""))
    except ValueError:
        return None
    started = _process_start_ticks(pid)
    if started is None:
        return True
    return bool(labels.get(PID_START)) and started != labels.get(PID_START)


def created_at(labels: Mapping[str, str]) -> _dt.datetime | None:
    text = labels.get(CREATED)
    if not text:
        return None
    try:
        return _dt.datetime.fromisoformat(text)
    except ValueError:
        return None
