"""Bookkeeping on a control channel: the scripts of :mod:`runtimes.ssh.scripts` that set up,
kill in, remove and list sandboxes (no wrapper: short, trusted programs), and the one-shot
connection ``list_sandboxes``/``destroy_sandbox`` use.
"""

from __future__ import annotations

import json
import logging
import posixpath
import shlex
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import anyio.to_thread

from .. import ownership
from ..base import sweep_argv
from ..errors import SandboxInvalidArgumentError, SandboxTransportError
from ..models import SandboxInfo
from ..scripts import load
from .client import _CHUNK, _answer_within, _connect
from .config import SSHConfig
from .process import _MARKER_VAR

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger("runtimes.ssh")

_SCRIPTS = "runtimes.ssh.scripts"
_SANDBOX_PREFIX = "vf-sandbox."
_META = "sandbox.json"


class _ControlScript(NamedTuple):
    """A script of :mod:`runtimes.ssh.scripts` and its positional arguments."""

    name: str
    args: tuple[str, ...] = ()

    @property
    def command(self) -> str:
        """The command line for the login shell: ``sh -c <script> sh <args>...``."""
        return shlex.join(["sh", "-c", load(self.name, _SCRIPTS), "sh", *self.args])


def _setup_script(workdir: str | None) -> _ControlScript:
    """Create the sandbox directory (metadata on stdin); prints it, the workdir and tools."""
    return _ControlScript("setup", (_SANDBOX_PREFIX, _META, workdir or ""))


def _kill_script(pgids: Iterable[int]) -> _ControlScript:
    """Kill process groups: each leader's pid first (the wrapper reports it before setsid()
    makes it a group), then the group."""
    targets = [(str(int(pgid)), f"-{int(pgid)}") for pgid in sorted(set(pgids))]
    return _ControlScript("kill", tuple(arg for pair in targets for arg in pair))


def _orphan_kill_script(pgids: Iterable[int], marker: str) -> _ControlScript:
    """Kill each process group whose leader's environment carries the marker."""
    groups = tuple(str(int(pgid)) for pgid in sorted(set(pgids)))
    return _ControlScript("orphan_kill", (f"{_MARKER_VAR}={marker}", *groups))


def _remove_script(directory: str, marker: str | None, home: str | None) -> _ControlScript:
    """Sweep (freeze, then kill) every process whose environment carries the marker or whose
    working directory is ``home``, then remove ``directory``."""
    sweep = sweep_argv("mark", f"{_MARKER_VAR}={marker}", home=home) if marker else []
    return _ControlScript("remove", (directory, *sweep))


def _list_script() -> _ControlScript:
    return _ControlScript("list", (_SANDBOX_PREFIX, _META))


def _valid_sandbox_dir(path: str) -> bool:
    name = posixpath.basename(path)
    return (
        path.startswith("/")
        and name.startswith(_SANDBOX_PREFIX)
        and "/" not in name
        and ".." not in path
    )


def _read_channel(recv: Callable[[int], bytes]) -> bytes:
    chunks = []
    while data := recv(_CHUNK):
        chunks.append(data)
    return b"".join(chunks)


def _run_control(
    transport: paramiko.Transport, script: _ControlScript, stdin: bytes | None, timeout: float
) -> tuple[int, bytes, bytes]:
    """Run a short bookkeeping script (no wrapper); returns (status, stdout, stderr)."""
    chan = transport.open_session(timeout=timeout)
    try:
        chan.settimeout(timeout)
        with _answer_within(chan, timeout):
            chan.exec_command(script.command)
        if stdin:
            chan.sendall(stdin)
        chan.shutdown_write()
        out = _read_channel(chan.recv)
        err = _read_channel(chan.recv_stderr)
        return chan.recv_exit_status(), out, err
    finally:
        chan.close()


async def _one_shot(config: SSHConfig, script: _ControlScript) -> tuple[int, bytes, bytes]:
    def run() -> tuple[int, bytes, bytes]:
        import paramiko

        transport = _connect(config, {})
        try:
            return _run_control(transport, script, None, config.io_timeout)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise SandboxTransportError(
                f"control command on {config.destination} failed: {exc}"
            ) from exc
        finally:
            transport.close()

    return await anyio.to_thread.run_sync(run)


def _parse_listing(out: bytes) -> list[SandboxInfo]:
    fields = out.split(b"\0")
    found = []
    for path_raw, meta_raw in zip(fields[0::2], fields[1::2], strict=False):
        path = path_raw.decode("utf-8", "replace")
        try:
            meta = json.loads(meta_raw)
            labels = {str(k): str(v) for k, v in dict(meta.get("labels", {})).items()}
        except (ValueError, TypeError, AttributeError):
            log.warning("skipping %s: unreadable %s", path, _META)
            continue
        found.append(
            SandboxInfo(
                backend="ssh",
                id=path,
                labels=labels,
                state="present",
                created=labels.get(ownership.CREATED),
            )
        )
    return found


async def list_host_sandboxes(config: SSHConfig) -> list[SandboxInfo]:
    """Sandbox directories on ``config``'s host (see :meth:`SSHRuntime.list_sandboxes`)."""
    code, out, err = await _one_shot(config, _list_script())
    if code != 0:
        raise SandboxTransportError(f"listing sandboxes on {config.destination} failed: {err!r}")
    return _parse_listing(out)


async def destroy_host_sandbox(info: SandboxInfo, config: SSHConfig) -> None:
    """Kill what still runs in a listed sandbox and remove its directory (see
    :meth:`SSHRuntime.destroy_sandbox`)."""
    if not _valid_sandbox_dir(info.id):
        raise SandboxInvalidArgumentError(f"not an ssh sandbox directory: {info.id!r}")
    script = _remove_script(info.id, posixpath.basename(info.id), f"{info.id}/work")
    code, _, err = await _one_shot(config, script)
    if code != 0:
        raise SandboxTransportError(f"removing {info.id} on {config.destination} failed: {err!r}")
