"""Bookkeeping on a control channel: the scripts of :mod:`runtimes.ssh.scripts` that set up,
kill in, remove and list sandboxes (no wrapper: short, trusted programs), and the one-shot
connection ``list_sandboxes``/``destroy_sandbox`` use.
"""

from __future__ import annotations

import json
import logging
import posixpath
import re
import shlex
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import anyio.to_thread

from .. import ownership
from ..errors import SandboxInvalidArgumentError, SandboxTransportError
from ..models import SandboxInfo
from ..scripts import load
from ..snapshot import SandboxSnapshot, snapshot_from_labels
from ..subprocess import tree_copy
from ..sweep import MARK_VAR, kill_args, sweep_argv
from .client import CHUNK, answer_within, connect
from .config import SSHConfig
from .faults import paramiko_failures

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("runtimes.ssh")

_SCRIPTS = "runtimes.ssh.scripts"
_SANDBOX_PREFIX = "vf-sandbox."
_META = "sandbox.json"
_SNAPSHOT_PREFIX = "vf-snapshot."
_SNAPSHOT_META = "snapshot.json"
_MARK = re.compile(r"[0-9a-f]{32}")
"""A runtime's mark (``uuid4().hex``), the suffix of its sandbox directory's name."""

LEGACY_MARK_VAR = "VF_SANDBOX_ID"
"""The variable vf-sandbox releases before issue 33 marked an SSH sandbox's processes with
(value: the directory's name, ``vf-sandbox.`` and mktemp's ten characters). Only
:func:`directory_mark` still reads it, so cleanup finds what such a sandbox left running."""


class ControlScript(NamedTuple):
    """A script of :mod:`runtimes.ssh.scripts` and its positional arguments."""

    name: str
    args: tuple[str, ...] = ()
    package: str = _SCRIPTS

    @property
    def command(self) -> str:
        """The command line for the login shell: ``sh -c <script> sh <args>...``."""
        return shlex.join(["sh", "-c", load(self.name, self.package), "sh", *self.args])


def setup_script(
    mark: str, workdir: str | None, snapshot: str | None = None, passage: bool = False
) -> ControlScript:
    """Create the sandbox directory ``vf-sandbox.<mark>`` (metadata on stdin); prints it, the
    workdir and tools. ``mark``: the runtime's mark, which every process of the sandbox
    carries (so cleanup reads it back from the name: :func:`directory_mark`); ``snapshot``: a
    snapshot directory whose tree becomes the workdir; ``passage``: let the policy's account
    through the directory.

    Raises:
        SandboxInvalidArgumentError: ``mark`` is not a runtime's mark (32 hex digits).
    """
    if not _MARK.fullmatch(mark):
        raise SandboxInvalidArgumentError(f"not a runtime's mark: {mark!r}")
    name = _SANDBOX_PREFIX + mark
    args = (name, _META, workdir or "", snapshot or "", "1" if passage else "")
    return ControlScript("setup", args)


def directory_mark(directory: str) -> str:
    """The mark (``NAME=value``) the processes of the sandbox ``directory`` carry, read from
    its name: ``VF_SANDBOX_RUNTIME=<mark>`` for ``vf-sandbox.<mark>``; for a directory of an
    older release (any other name), ``VF_SANDBOX_ID=<its name>``."""
    name = posixpath.basename(directory)
    suffix = name.removeprefix(_SANDBOX_PREFIX)
    if _MARK.fullmatch(suffix):
        return f"{MARK_VAR}={suffix}"
    return f"{LEGACY_MARK_VAR}={name}"


def snapshot_script(workdir: str) -> ControlScript:
    """Copy the workdir into a new snapshot directory (metadata on stdin) with the host's
    ``python3`` running :mod:`runtimes.subprocess.tree_copy` (``cp -a`` without one); prints
    the directory."""
    args = (_SNAPSHOT_PREFIX, _SNAPSHOT_META, workdir, tree_copy.source_text())
    return ControlScript("snapshot", args)


def kill_script(pgids: Iterable[int], mark: str | None = None) -> ControlScript:
    """Kill process groups with the one kill (``runtimes/scripts/kill.sh``): each leader's pid
    first (the wrapper reports it before setsid() makes it a group), then the group; with
    ``mark`` (the runtime's, ``NAME=value``), only groups whose leader's environment still
    carries it."""
    args = kill_args(pgids, mark=mark)
    return ControlScript("kill", tuple(args), package="runtimes.scripts")


def remove_script(directory: str, mark: str | None, home: str | None) -> ControlScript:
    """Sweep (freeze, then kill) every process whose environment carries ``mark``
    (``NAME=value``) or whose working directory is ``home``, then remove ``directory``.

    ``home`` (``<directory>/work``) counts only as the directory its path names with no link
    on the way: the sandbox's code may have replaced it by a link (``work -> /``). The script
    resolves the directory holding ``directory`` and appends ``home`` so to the sweep's argv
    (given here without its last argument, the home)."""
    sweep = sweep_argv("mark", mark)[:-1] if mark else []
    return ControlScript("remove", (directory, home if mark and home else "", *sweep))


def _list_script() -> ControlScript:
    return ControlScript("list", (_SANDBOX_PREFIX, _META))


def valid_sandbox_dir(path: str, prefix: str = _SANDBOX_PREFIX) -> bool:
    name = posixpath.basename(path)
    return path.startswith("/") and name.startswith(prefix) and "/" not in name and ".." not in path


def valid_snapshot_dir(path: str) -> bool:
    """Whether ``path`` has the form of a snapshot directory this backend makes."""
    return valid_sandbox_dir(path, _SNAPSHOT_PREFIX)


def _read_channel(recv: Callable[[int], bytes]) -> bytes:
    chunks = []
    while data := recv(CHUNK):
        chunks.append(data)
    return b"".join(chunks)


def run_control(
    transport: paramiko.Transport, script: ControlScript, stdin: bytes | None, timeout: float
) -> tuple[int, bytes, bytes]:
    """Run a short bookkeeping script (no wrapper); returns (status, stdout, stderr)."""
    chan = transport.open_session(timeout=timeout)
    try:
        chan.settimeout(timeout)
        with answer_within(chan, timeout):
            chan.exec_command(script.command)
        if stdin:
            chan.sendall(stdin)
        chan.shutdown_write()
        out = _read_channel(chan.recv)
        err = _read_channel(chan.recv_stderr)
        return chan.recv_exit_status(), out, err
    finally:
        chan.close()


async def _one_shot(config: SSHConfig, script: ControlScript) -> tuple[int, bytes, bytes]:
    def run() -> tuple[int, bytes, bytes]:
        transport = connect(config, {})
        try:
            return run_control(transport, script, None, config.io_timeout)
        except paramiko_failures() as exc:
            raise SandboxTransportError(
                f"control command on {config.destination} failed: {exc}"
            ) from exc
        finally:
            transport.close()

    return await anyio.to_thread.run_sync(run)


def _parse_labels(out: bytes, meta_name: str) -> list[tuple[str, dict[str, str]]]:
    """The (directory, labels) pairs of a listing by ``list.sh``."""
    fields = out.split(b"\0")
    found = []
    for path_raw, meta_raw in zip(fields[0::2], fields[1::2], strict=False):
        path = path_raw.decode("utf-8", "replace")
        try:
            meta = json.loads(meta_raw)
            labels = {str(k): str(v) for k, v in dict(meta.get("labels", {})).items()}
        except (ValueError, TypeError, AttributeError):
            log.warning("skipping %s: unreadable %s", path, meta_name)
            continue
        found.append((path, labels))
    return found


def _parse_listing(out: bytes) -> list[SandboxInfo]:
    return [
        SandboxInfo(
            backend="ssh",
            id=path,
            labels=labels,
            state="present",
            created=labels.get(ownership.CREATED),
        )
        for path, labels in _parse_labels(out, _META)
    ]


async def list_host_sandboxes(config: SSHConfig) -> list[SandboxInfo]:
    """Sandbox directories on ``config``'s host (see :meth:`SSHBackend.list_sandboxes`)."""
    code, out, err = await _one_shot(config, _list_script())
    if code != 0:
        raise SandboxTransportError(f"listing sandboxes on {config.destination} failed: {err!r}")
    return _parse_listing(out)


async def destroy_host_sandbox(info: SandboxInfo, config: SSHConfig) -> None:
    """Kill what still runs in a listed sandbox and remove its directory (see
    :meth:`SSHBackend.destroy_sandbox`)."""
    if not valid_sandbox_dir(info.id):
        raise SandboxInvalidArgumentError(f"not an ssh sandbox directory: {info.id!r}")
    script = remove_script(info.id, directory_mark(info.id), f"{info.id}/work")
    code, _, err = await _one_shot(config, script)
    if code != 0:
        raise SandboxTransportError(f"removing {info.id} on {config.destination} failed: {err!r}")


async def list_host_snapshots(config: SSHConfig) -> list[SandboxSnapshot]:
    """Snapshot directories on ``config``'s host (see :meth:`SSHBackend.list_snapshots`)."""
    script = ControlScript("list", (_SNAPSHOT_PREFIX, _SNAPSHOT_META))
    code, out, err = await _one_shot(config, script)
    if code != 0:
        raise SandboxTransportError(f"listing snapshots on {config.destination} failed: {err!r}")
    return [
        snapshot_from_labels("ssh", path, labels, "workdir")
        for path, labels in _parse_labels(out, _SNAPSHOT_META)
    ]


def remove_snapshot_script(snapshot: SandboxSnapshot) -> ControlScript:
    """Remove a snapshot directory (nothing runs in it: no sweep).

    Raises:
        SandboxInvalidArgumentError: ``snapshot.id`` is not a snapshot directory.
    """
    if not valid_snapshot_dir(snapshot.id):
        raise SandboxInvalidArgumentError(f"not an ssh snapshot directory: {snapshot.id!r}")
    return ControlScript("remove", (snapshot.id, ""))


async def destroy_host_snapshot(snapshot: SandboxSnapshot, config: SSHConfig) -> None:
    """Remove a snapshot directory (see :meth:`SSHBackend.destroy_snapshot`)."""
    code, _, err = await _one_shot(config, remove_snapshot_script(snapshot))
    if code != 0:
        raise SandboxTransportError(
            f"removing {snapshot.id} on {config.destination} failed: {err!r}"
        )
