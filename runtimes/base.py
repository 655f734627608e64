"""The :class:`Runtime` contract: one async API over every kind of sandbox.

Lifecycle (``start`` / ``close``) is kept apart from the operations on a live sandbox
(``exec``, ``read``, ``write``, ...). The public methods here validate arguments,
resolve paths, enforce timeouts and caps, and keep state; a backend implements the
small ``_``-prefixed primitives and never repeats that work.

Writing a backend: subclass :class:`Runtime`, set ``config_model``, implement
``_start``, ``_close``, ``_alive``, ``_exec``, ``_read`` and ``_write``. The defaults of
``_exists``, ``_remove``, ``_upload`` and ``_download`` go through ``_exec`` with POSIX
tools (``test``, ``rm``, ``tar``); override them where the transport does better. Then
run the conformance suite (:mod:`runtimes.testing`) against it.
"""

from __future__ import annotations

import abc
import atexit
import io
import logging
import os
import posixpath
import tarfile
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from types import TracebackType
from typing import ClassVar, Self

import anyio
import anyio.lowlevel

from ._extract import extract_archive
from .config import RuntimeConfig
from .errors import (
    ExecTimeoutError,
    HostRouteError,
    OutputLimitExceededError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxUnavailableError,
)
from .models import ExecRequest, ExecResult, OutputSink, SandboxInfo
from .policy import PolicyAccount
from .routes import HostRoute, RouteKind, choose_route

log = logging.getLogger("runtimes")

PathLike = str | os.PathLike[str]

_NEW, _STARTING, _OPEN, _CLOSING, _CLOSED = "new", "starting", "open", "closing", "closed"

_NAME_MAX = 255
_PATH_MAX = 4095
"""Linux's limits on one path component and on a whole path, in bytes."""

MARK_VAR = "VF_SANDBOX_RUNTIME"
"""Every command a runtime starts carries ``VF_SANDBOX_RUNTIME=<runtime mark>`` in its
environment, so :meth:`Runtime.stop_processes` can find what is left of them."""

SWEEP_SCRIPT = r"""
# Freeze, then kill: every matching process is sent SIGSTOP (which cannot be caught) until a
# whole pass over /proc finds none still running and no process it had not seen before, so a
# fork loop cannot outrun the sweep; then all of them get SIGKILL. Arguments: the mode, the
# mark (NAME=value), a pid whose session is spared (the channel agent, or ""), a user all of
# whose processes are the policy's ("").
# Modes: ``all``, every process outside session 1 (a container of ours: its keep-alive is
# session 1); ``since:T``, every process started at or after clock tick T (a sandbox of ours
# whose own processes predate T); ``mark``, processes carrying the mark in their environment
# or owned by the user, or whose working directory is $5 (the sandbox's own). The sweep's
# own session and its ancestors are always spared.
mode=$1 mark=$2 keep=$3 user=$4 home=$5
since=""; case $mode in since:*) since=${mode#since:} ;; esac
sid_of() {
  { read -r __s < "/proc/$1/stat"; } 2>/dev/null || return 1
  set -f; set -- ${__s##*) }; set +f; echo "$4"
}
ancestors() {
  __p=$1
  while [ -n "$__p" ] && [ "$__p" -gt 1 ] 2>/dev/null; do
    echo "$__p"
    { read -r __s < "/proc/$__p/stat"; } 2>/dev/null || return 0
    set -f; set -- ${__s##*) }; set +f; __p=$2
  done
}
mine=$(sid_of $$)
spare=""; [ -n "$keep" ] && spare=$(sid_of "$keep")
kept=" $(ancestors $$ | tr '\n' ' ') "
[ -n "$keep" ] && kept="$kept$(ancestors "$keep" | tr '\n' ' ') "
uid=""; if [ -n "$user" ]; then uid=$(id -u -- "$user" 2>/dev/null) || uid=""; fi
[ "$uid" = "$(id -u)" ] && uid=""
# look PID NEW: freeze PID if it matches; NEW=1 for a pid the pass before did not list.
look() {
  case $kept in *" $1 "*) return ;; esac
  if ! { read -r s < "/proc/$1/stat"; } 2>/dev/null; then unsure=$((unsure | $2)); return; fi
  set -f; set -- "$1" "$2" ${s##*) }; set +f
  state=$3 sid=$6 started=${22}
  case $state in Z|X|x) unsure=$((unsure | $2)); return ;; esac
  case $other in *" $1:$started "*) return ;; esac
  hit=1
  if [ "$sid" = "$mine" ] || { [ -n "$spare" ] && [ "$sid" = "$spare" ]; }; then hit=0
  elif [ "$mode" = all ]; then
    [ "$sid" = 1 ] && hit=0
  elif [ -n "$since" ]; then
    [ "$started" -ge "$since" ] || hit=0
  else
    hit=0
    if [ -n "$uid" ]; then
      while read -r k v r; do
        [ "$k" = Uid: ] && { [ "$v" = "$uid" ] && hit=1; break; }
      done 2>/dev/null < "/proc/$1/status"
    fi
    if [ "$hit" = 1 ]; then :
    elif [ -n "$home" ] && [ "/proc/$1/cwd" -ef "$home" ]; then hit=1
    elif tr '\0' '\n' 2>/dev/null < "/proc/$1/environ" | grep -qxF -- "$mark"; then hit=1; fi
  fi
  if [ "$hit" = 0 ]; then other="$other$1:$started "; return; fi
  case $seen in *" $1 "*) ;; *) seen="$seen$1 " ;; esac
  case $state in T|t) ;; *) kill -STOP "$1" 2>/dev/null && running=$((running + 1)) ;; esac
}
seen=" " other=" " listed=" " pass=0 quiet=0
while [ "$pass" -lt 500 ]; do
  pass=$((pass + 1)); running=0 unsure=0 before=$listed listed=" " new="" old=""
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    listed="$listed$p "
    case $before in *" $p "*) old="$old $p" ;; *) new="$new $p" ;; esac
  done
  # New processes first: a fork loop's live member is among them, and about to exit.
  for p in $new; do look "$p" 1; done
  for p in $old; do look "$p" 0; done
  # In a sandbox of our own (all, since): done once a pass froze nothing and read every
  # process new since the pass before: one that forked and exited in between (unreadable, or
  # a zombie) may have left a child only the next pass lists. Beside a host's other
  # processes (mark), which come and go all the time: three passes in a row that froze
  # nothing. Processes found not to match are not read again.
  if [ "$running" -eq 0 ]; then quiet=$((quiet + 1)); else quiet=0; fi
  if [ "$mode" = mark ]; then [ "$quiet" -ge 3 ] && break
  else [ "$running" -eq 0 ] && [ "$unsure" -eq 0 ] && [ "$pass" -gt 1 ] && break; fi
done
total=0
for p in $seen; do kill -KILL "$p" 2>/dev/null && total=$((total + 1)); done
echo "$total"
"""
"""The process sweep behind :meth:`Runtime.stop_processes` (POSIX ``sh``, ``/proc``)."""

CLOCK_TICK_SCRIPT = 'read -r s < "/proc/$$/stat"; set -f; set -- ${s##*) }; echo "${20}"'
"""Prints the start time (clock ticks since boot) of the shell running it: every process
started later has a start time at least this large (the ``since:T`` sweep mode)."""


def sweep_argv(
    mode: str,
    mark: str,
    *,
    keep: int | None = None,
    user: str | None = None,
    home: str | None = None,
) -> list[str]:
    """The argv of one :data:`SWEEP_SCRIPT` run (see its comment for the arguments)."""
    return ["sh", "-c", SWEEP_SCRIPT, "sh", mode, mark, str(keep or ""), user or "", home or ""]


class Runtime(abc.ABC):
    """One sandbox, as an async context manager.

    ``async with SomeRuntime(config) as rt:`` creates the sandbox, and leaving the block
    destroys it (or, for runtimes that borrow an existing sandbox, lets it go).

    Every method documents the errors it raises. Beyond those listed, any method can
    raise :class:`~runtimes.errors.SandboxUnavailableError` when the sandbox is dead,
    stopped, removed or closed, and :class:`~runtimes.errors.SandboxTransportError` when
    the channel to it failed (after bounded retries for idempotent calls). Nothing a
    runtime raises is a bare ``Exception``: anything unexpected from a backend surfaces
    as :class:`~runtimes.errors.SandboxError` with the original chained.
    """

    name: ClassVar[str] = "runtime"
    config_model: ClassVar[type[RuntimeConfig]] = RuntimeConfig

    def __init__(self, config: RuntimeConfig):
        if not isinstance(config, self.config_model):
            raise SandboxInvalidArgumentError(
                f"{type(self).__name__} needs a {self.config_model.__name__}, "
                f"got {type(config).__name__}"
            )
        self.config = config
        self._state = _NEW
        self._workdir: str | None = None
        self._mark = uuid.uuid4().hex
        self._policy_account = PolicyAccount()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        """Create (or attach to) the sandbox and wait until it is ready.

        Creation is shielded from cancellation until the backend holds a handle on what
        it created; if the caller was cancelled meanwhile, the sandbox is closed again
        before the cancellation propagates, so nothing leaks.

        Raises:
            ProvisioningError: the sandbox could not be created (image missing, quota,
                authentication, unreachable host).
            SandboxUnavailableError: the runtime was already started or closed.
        """
        if self._state != _NEW:
            raise SandboxUnavailableError(f"{self.describe()} was already started ({self._state})")
        self._state = _STARTING
        try:
            with anyio.CancelScope(shield=True):
                self._workdir = await self._start()
                self._state = _OPEN
                _LIVE.add(self)
                _register_backstop_last()
            await anyio.lowlevel.checkpoint()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._close_quietly()
            raise
        return self

    async def close(self) -> None:
        """Destroy the sandbox (or release a borrowed one). Idempotent and shielded.

        Safe to call twice, from a cancelled task, or on a runtime that never started.

        Raises:
            SandboxTransportError: the backend could not confirm the sandbox is gone;
                the sandbox is left to ``vf-sandbox cleanup``.
        """
        with anyio.CancelScope(shield=True):
            if self._state in (_CLOSED, _CLOSING):
                return
            was = self._state
            self._state = _CLOSING
            _LIVE.discard(self)
            try:
                if was in (_STARTING, _OPEN):
                    await self._close()
            finally:
                self._state = _CLOSED

    async def _close_quietly(self) -> None:
        try:
            await self.close()
        except Exception:
            log.warning(
                "closing %s after a failed start also failed", self.describe(), exc_info=True
            )

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def workdir(self) -> str:
        """The sandbox's absolute working directory (the default ``cwd``)."""
        self._check_open()
        assert self._workdir is not None
        return self._workdir

    @property
    def closed(self) -> bool:
        return self._state == _CLOSED

    def describe(self) -> str:
        """A short human name for messages: backend plus sandbox id."""
        return f"{self.name} sandbox {self.sandbox_id or '(not started)'}"

    @property
    def sandbox_id(self) -> str | None:
        """The backend's id for this sandbox (container id, remote dir...), once started."""
        return None

    @property
    def policy_user(self) -> str | None:
        """The unprivileged user a rollout's policy runs its commands as (``exec(user=)``),
        apart from the sandbox's default user, which the host's own machinery uses (judge
        inputs, judges, harness installs, the channel agent). The policy cannot write to,
        signal or ptrace what runs as the default user.

        ``None`` when the backend keeps no separate policy identity: the policy then runs
        as the default user (``docs/security.md`` says what still holds).
        """
        return None

    async def prepare_policy_user(self) -> str | None:
        """Make the policy's account now (where it is made on first use) and hand it the
        workdir, as its first command would; return :attr:`policy_user`. Lets the host
        give the account something by name (``chown``) before the policy runs.

        Raises:
            ProvisioningError: the account could not be made.
        """
        if self.policy_user is not None:
            await self.exec(["true"], user=self.policy_user, timeout=60)
        return self.policy_user

    async def alive(self) -> bool:
        """Whether the sandbox answers. Never raises for a dead or closed sandbox.

        Raises:
            SandboxTransportError: liveness cannot be decided because the channel failed.
        """
        if self._state != _OPEN:
            return False
        with self._guard("alive"):
            return await self._alive()

    # ------------------------------------------------------------------ operations

    async def exec(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        cwd: PathLike | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes | str | None = None,
        user: str | None = None,
        output_limit: int | None = None,
    ) -> ExecResult:
        """Run ``argv`` (never a shell string) inside the sandbox and wait for it.

        Args:
            argv: program and arguments. Callers who want a shell pass ``["sh", "-c", ...]``.
            timeout: seconds; on expiry the whole process tree is killed.
            cwd: absolute, or relative to the workdir; defaults to the workdir.
            env: variables added to the sandbox's environment for this call only.
            stdin: bytes (or text, encoded as UTF-8) fed to the process, then closed.
            user: run as this user (backends that cannot switch raise ``SandboxPermissionError``).
            output_limit: cap on stdout + stderr together, bytes (default: the config's).

        Returns:
            The exit code (``128 + N`` for a death by signal N) and byte-exact output.
            A non-zero exit is a result, not an error.

        Raises:
            ProvisioningError: ``user`` is :attr:`policy_user` and its account could not be
                made or found at its first use.
            ExecTimeoutError: ``timeout`` expired; the tree was killed; partial output attached.
            OutputLimitExceededError: output went over the cap; the tree was killed;
                the output kept so far is attached.
            SandboxFileNotFoundError: the program or ``cwd`` does not exist.
            SandboxPermissionError: the program is not executable, or ``user`` is refused.
            SandboxNotADirectoryError: ``cwd`` is not a directory.
            SandboxInvalidArgumentError: empty argv, NUL bytes, bad env names, argv too large,
                text (argv, env, ``stdin``) with a lone surrogate that stands for no byte.

        Cancelling the awaiting task kills the process tree too, then lets the
        cancellation propagate.
        """
        self._check_open()
        request = self._exec_request(argv, timeout, cwd, env, stdin, user, output_limit)
        if request.user is not None and request.user == self.policy_user:
            await self._policy_account.ensure(
                request.user,
                self._run_as_machinery,
                self.workdir,
                create=self._creates_policy_user,
                through=self._policy_passage(),
            )
        started = time.monotonic()
        sink = OutputSink(request.output_limit)
        with anyio.CancelScope() as scope:
            sink.on_overflow = scope.cancel
            if timeout is not None:
                scope.deadline = anyio.current_time() + timeout
            with self._guard("exec", request.argv[0]):
                exit_code = await self._exec(request, sink)
        if sink.overflowed:
            raise OutputLimitExceededError(
                f"output of {request.argv[0]!r}",
                request.output_limit,
                stdout_bytes=bytes(sink.stdout),
                stderr_bytes=bytes(sink.stderr),
            )
        if scope.cancelled_caught:
            raise ExecTimeoutError(
                list(request.argv), timeout, bytes(sink.stdout), bytes(sink.stderr)
            )
        return ExecResult(
            exit_code, bytes(sink.stdout), bytes(sink.stderr), time.monotonic() - started
        )

    async def read(self, path: PathLike, *, max_bytes: int | None = None) -> bytes:
        """The exact bytes of a file.

        Raises:
            SandboxFileNotFoundError: no such file.
            SandboxIsADirectoryError: ``path`` is a directory.
            SandboxNotADirectoryError: a parent of ``path`` is not a directory.
            SandboxPermissionError: not readable.
            OutputLimitExceededError: the file is larger than ``max_bytes`` (default:
                the config's ``read_limit``); nothing is returned.
            SandboxInvalidArgumentError: a malformed path (NUL byte, empty).
        """
        self._check_open()
        resolved = self.resolve_path(path)
        limit = self.config.read_limit if max_bytes is None else max_bytes
        if limit < 0:
            raise SandboxInvalidArgumentError(f"max_bytes must be >= 0, got {limit}")
        with self._guard("read", resolved):
            data = await self._read(resolved, limit)
        if len(data) > limit:
            raise OutputLimitExceededError(f"read of {resolved!r}", limit, path=resolved)
        return data

    async def write(self, path: PathLike, data: bytes | str) -> None:
        """Write ``data`` to a file, creating parent directories, replacing any old content.

        Raises:
            SandboxIsADirectoryError: ``path`` is a directory.
            SandboxNotADirectoryError: a parent of ``path`` is a file.
            SandboxPermissionError: not writable.
            SandboxInvalidArgumentError: a malformed path (NUL byte, empty).
        """
        self._check_open()
        resolved = self.resolve_path(path)
        payload = _text_bytes(data, "data") if isinstance(data, str) else bytes(data)
        with self._guard("write", resolved):
            await self._write(resolved, payload)

    async def exists(self, path: PathLike) -> bool:
        """Whether anything (file, directory, symlink, even a dangling one) is at ``path``.

        A missing parent is ``False``, not an error.

        Raises:
            SandboxPermissionError: a parent directory cannot be searched.
            SandboxInvalidArgumentError: a malformed path.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        with self._guard("exists", resolved):
            return await self._exists(resolved)

    async def remove(self, path: PathLike, *, missing_ok: bool = False) -> None:
        """Remove a file, a symlink (not its target) or a whole directory tree.

        Raises:
            SandboxFileNotFoundError: nothing at ``path`` and not ``missing_ok``.
            SandboxPermissionError: not removable.
            SandboxInvalidArgumentError: a malformed path, or ``/``, the workdir or a
                parent of the workdir.
        """
        self._check_open()
        resolved = self.resolve_path(path)
        target = posixpath.normpath(resolved)
        workdir = posixpath.normpath(self.workdir)
        if target == "/":
            raise SandboxInvalidArgumentError("refusing to remove '/'")
        if target == workdir or workdir.startswith(target + "/"):
            raise SandboxInvalidArgumentError(
                f"refusing to remove the workdir {self.workdir!r} or a parent of it ({resolved!r})"
            )
        with self._guard("remove", resolved):
            if not await self._exists(resolved):
                if missing_ok:
                    return
                raise SandboxFileNotFoundError(resolved)
            await self._remove(resolved)

    async def upload(self, local: PathLike, remote: PathLike) -> None:
        """Copy a local file or directory tree to ``remote`` (created, parents included).

        A directory's contents land inside ``remote``; existing files are replaced.

        Raises:
            FileNotFoundError: the local source does not exist (a host-side error).
            SandboxInvalidArgumentError: a NUL byte in ``local``, a malformed ``remote``.
            SandboxNotADirectoryError / SandboxIsADirectoryError: kinds clash at ``remote``.
            SandboxPermissionError: not writable.
        """
        self._check_open()
        _check_local_path(local)
        source = Path(local)
        if not await anyio.Path(source).exists():
            raise FileNotFoundError(
                2, "No such file or directory (local upload source)", str(local)
            )
        resolved = self.resolve_path(remote)
        with self._guard("upload", resolved):
            await self._upload(source, resolved)

    async def download(
        self, remote: PathLike, local: PathLike, *, skip_unsafe: bool = False
    ) -> None:
        """Copy a sandbox file or directory tree to ``local`` (parents created).

        A directory's contents land inside ``local``. The sandbox is treated as hostile:
        its tree is unpacked on the host without ever following a symlink, and nothing
        outside ``local`` is created or changed. A member that would leave ``local`` (an
        absolute or ``..`` name, a path through a symlink, a symlink that is absolute or
        resolves outside ``local``, a hard link to anything this download did not
        extract, a device or FIFO) raises :class:`UnsafeArchiveMemberError` naming it;
        with ``skip_unsafe=True`` such members are left out instead, each logged as a
        warning on the ``runtimes`` logger, and the rest is downloaded. (The subprocess
        backend copies its own host tree and keeps symlinks as links, never following
        them; it is not a boundary.)

        Raises:
            SandboxFileNotFoundError: nothing at ``remote``.
            SandboxPermissionError: not readable.
            OutputLimitExceededError: the tree is larger than the config's ``read_limit``.
            UnsafeArchiveMemberError: an unsafe member (above), or more members or deeper
                paths than the extractor allows (the member count bound is never skipped).
            SandboxInvalidArgumentError: a NUL byte in ``local``, a malformed ``remote``.
            SandboxError: the sandbox's archive of the tree is malformed.
        """
        self._check_open()
        _check_local_path(local)
        resolved = self.resolve_path(remote)
        with self._guard("download", resolved):
            await self._download(resolved, Path(local), skip_unsafe=skip_unsafe)

    # ------------------------------------------------------------------ routes to the host

    def host_routes(self) -> tuple[RouteKind, ...]:
        """The routes by which a process in this sandbox can reach a port on the host,
        the default first (see :mod:`runtimes.routes`). Empty: none."""
        return self._host_routes() if self._state == _OPEN else ()

    async def plan_host_route(self, via: str | None = None) -> tuple[RouteKind, str]:
        """The route :meth:`expose_host` will take (``via``, or the default) and the host
        address the service must listen on for it (``127.0.0.1`` except for ``gateway``).

        Raises:
            HostRouteError: the sandbox has no such route (or none); the message says what
                to configure.
            SandboxUnavailableError: the sandbox is closed.
            SandboxError: probing the sandbox failed.
        """
        self._check_open()
        kind = choose_route(self._host_routes(), via, self.describe(), self._route_hint())
        with self._guard("planning a route to the host"):
            return kind, await self._host_bind_address(kind)

    async def expose_host(self, port: int, *, via: str | None = None) -> HostRoute:
        """Make ``port`` of the host (listening on :meth:`plan_host_route`'s address)
        reachable from inside the sandbox; close the returned route when done (the runtime's
        ``close()`` ends it too).

        Raises:
            HostRouteError: no such route, or it could not be made (the channel is down,
                the agent could not listen, the forward was refused).
            SandboxInvalidArgumentError: ``port`` is not a TCP port.
            SandboxUnavailableError: the sandbox is closed or stopped answering.
        """
        self._check_open()
        if not 0 < port < 65536:
            raise SandboxInvalidArgumentError(f"not a TCP port: {port}")
        kind = choose_route(self._host_routes(), via, self.describe(), self._route_hint())
        with self._guard("exposing a host port"):
            return await self._expose_host(port, kind)

    def _host_routes(self) -> tuple[RouteKind, ...]:
        """The routes this backend has now, the default first."""
        return ()

    def _route_hint(self) -> str:
        """What to configure for a route (for :class:`HostRouteError` messages)."""
        return ""

    async def _host_bind_address(self, via: RouteKind) -> str:
        """Where a host service must listen for ``via`` (one of :meth:`_host_routes`)."""
        return "127.0.0.1"

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        """Make the route (``via`` is one of :meth:`_host_routes`)."""
        raise HostRouteError(f"{self.describe()} cannot make a {via!r} route", via=via)

    async def stop_processes(self) -> int:
        """Kill every process this runtime's commands started that is still running;
        return how many.

        Background processes a command left behind (``nohup server &``) are found by the
        ``VF_SANDBOX_RUNTIME`` mark in their environment, which every ``exec`` sets; backends
        that own their sandbox find them however they detached (``setsid``, ``env -i``).
        Matches are frozen (``SIGSTOP``) until none is left running, then killed, so a fork
        loop cannot outrun the sweep. The placement layer calls this before a judge enters a
        rollout's sandbox, between its commands and before its verdict is read, so nothing
        the policy left can watch or tamper with the judge. ``docs/security.md`` says, per
        backend, which leftovers each sweep reaches.

        Raises:
            SandboxUnavailableError: the sandbox is closed or dead.
            SandboxError: the sweep itself failed (its stderr attached).
        """
        self._check_open()
        request, sink = self._internal(self._sweep_argv())
        with self._guard("stop_processes"):
            code = await self._exec(request, sink)
        return self._swept(code, sink)

    def _sweep_argv(self) -> list[str]:
        """The sweep :meth:`stop_processes` runs: by default, processes carrying the mark."""
        return sweep_argv("mark", f"{MARK_VAR}={self._mark}")

    def _swept(self, code: int, sink: OutputSink) -> int:
        """How many processes a sweep killed, from its output.

        Raises:
            SandboxError: the sweep failed.
        """
        text = bytes(sink.stdout).decode("utf-8", "replace").strip()
        if code != 0 or not text.isdigit():
            detail = bytes(sink.stderr).decode("utf-8", "replace").strip()
            raise SandboxError(f"{self.describe()}: could not stop processes: {detail}")
        return int(text)

    # ------------------------------------------------------------------ helpers

    def resolve_path(self, path: PathLike) -> str:
        """An absolute sandbox path: relative ones are joined to the workdir.

        Raises:
            SandboxInvalidArgumentError: empty, containing a NUL byte or a lone surrogate
                that stands for no byte, a component over 255 bytes (NAME_MAX) or the whole
                over 4095 bytes (PATH_MAX).
        """
        text = os.fspath(path)
        if not isinstance(text, str):
            raise SandboxInvalidArgumentError(f"sandbox paths are text, got {type(text).__name__}")
        if not text:
            raise SandboxInvalidArgumentError("empty path")
        if "\x00" in text:
            raise SandboxInvalidArgumentError(f"path contains a NUL byte: {text!r}")
        resolved = text if text.startswith("/") else posixpath.join(self.workdir, text)
        _check_path_length(resolved)
        return resolved

    def _exec_request(
        self,
        argv: Sequence[str],
        timeout: float | None,
        cwd: PathLike | None,
        env: Mapping[str, str] | None,
        stdin: bytes | str | None,
        user: str | None,
        output_limit: int | None,
    ) -> ExecRequest:
        if isinstance(argv, str | bytes):
            raise SandboxInvalidArgumentError(
                "argv must be a sequence of strings, not a shell string; "
                "pass ['sh', '-c', command] to use a shell"
            )
        args = tuple(argv)
        if not args:
            raise SandboxInvalidArgumentError("empty argv")
        for arg in args:
            if not isinstance(arg, str):
                raise SandboxInvalidArgumentError(
                    f"argv items must be str, got {type(arg).__name__}"
                )
            if "\x00" in arg:
                raise SandboxInvalidArgumentError(f"argv item contains a NUL byte: {arg[:60]!r}")
            _text_bytes(arg, "an argv item")
        merged_env = dict(self.config.env)
        merged_env[MARK_VAR] = self._mark
        for key, value in (env or {}).items():
            if not key or "=" in key or "\x00" in key or "\x00" in value:
                raise SandboxInvalidArgumentError(f"invalid environment variable {key!r}")
            _text_bytes(key, "an environment variable's name")
            _text_bytes(value, f"the value of environment variable {key!r}")
            merged_env[key] = value
        if timeout is not None and timeout <= 0:
            raise SandboxInvalidArgumentError(f"timeout must be > 0, got {timeout}")
        limit = self.config.output_limit if output_limit is None else output_limit
        if limit <= 0:
            raise SandboxInvalidArgumentError(f"output_limit must be > 0, got {limit}")
        data = _text_bytes(stdin, "stdin") if isinstance(stdin, str) else stdin
        return ExecRequest(
            argv=args,
            cwd=self.workdir if cwd is None else self.resolve_path(cwd),
            env=merged_env,
            stdin=data,
            user=user,
            timeout=timeout,
            output_limit=limit,
        )

    _creates_policy_user: ClassVar[bool] = True
    """Whether a missing policy account is added to the sandbox (ours) or refused (a host
    whose accounts are not ours to make)."""

    def _policy_passage(self) -> str:
        """A directory above the workdir the policy account must be able to pass, or ""."""
        return ""

    async def _run_as_machinery(self, argv: list[str]) -> tuple[int, bytes]:
        request, sink = self._internal(argv)
        with self._guard("preparing the policy's account"):
            code = await self._exec(request, sink)
        return code, bytes(sink.stderr)

    def _check_open(self) -> None:
        if self._state != _OPEN:
            what = {_NEW: "was never started", _STARTING: "is still starting"}.get(
                self._state, "is closed"
            )
            raise SandboxUnavailableError(f"{self.describe()} {what}")

    @contextmanager
    def _guard(self, operation: str, subject: str | None = None) -> Iterator[None]:
        """Let typed errors through; turn anything else from a backend into a SandboxError."""
        try:
            yield
        except SandboxError:
            raise
        except Exception as exc:
            about = f" {subject!r}" if subject else ""
            raise SandboxError(
                f"{self.describe()}: {operation}{about} failed unexpectedly: {exc!r}"
            ) from exc

    # ------------------------------------------------------------------ backend primitives

    @abc.abstractmethod
    async def _start(self) -> str:
        """Create or attach to the sandbox; return its absolute workdir.

        Runs shielded. Keep a handle on what was created before any further await, so
        that ``_close`` can remove it if readiness then fails.
        """

    @abc.abstractmethod
    async def _close(self) -> None:
        """Destroy (or release) the sandbox. Must cope with a half-finished ``_start``."""

    @abc.abstractmethod
    async def _alive(self) -> bool:
        """Liveness probe: ``False`` for a dead sandbox, never an exception for it."""

    @abc.abstractmethod
    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run the command, feeding output to ``sink``; return the exit code (128+N on signal).

        When cancelled (timeout, output cap, or the caller), kill the whole process tree
        inside the sandbox, shielded, then let the cancellation propagate.
        """

    @abc.abstractmethod
    async def _read(self, path: str, limit: int) -> bytes:
        """Read a file. May return more than ``limit`` bytes (the caller raises), or raise
        ``OutputLimitExceededError`` itself without transferring the content."""

    @abc.abstractmethod
    async def _write(self, path: str, data: bytes) -> None:
        """Write a file, creating parents."""

    async def _exists(self, path: str) -> bool:
        request, sink = self._internal(["sh", "-c", 'test -e "$1" || test -L "$1"', "sh", path])
        return await self._exec(request, sink) == 0

    async def _remove(self, path: str) -> None:
        request, sink = self._internal(["rm", "-rf", "--", path])
        if await self._exec(request, sink) != 0:
            raise shell_error(path, sink)

    async def _upload(self, source: Path, remote: str) -> None:
        if await anyio.Path(source).is_file():
            await self._write(remote, await anyio.Path(source).read_bytes())
            return
        archive = await anyio.to_thread.run_sync(_tar_directory, source)
        request, sink = self._internal(
            ["sh", "-c", 'mkdir -p -- "$1" && tar -x -f - -C "$1"', "sh", remote], stdin=archive
        )
        if await self._exec(request, sink) != 0:
            raise shell_error(remote, sink)

    async def _download(self, remote: str, local: Path, *, skip_unsafe: bool = False) -> None:
        """Copy ``remote`` to ``local``; a directory goes through :func:`_untar_into`,
        which treats the archive as hostile (``skip_unsafe``: leave unsafe members out)."""
        request, sink = self._internal(
            [
                "sh",
                "-c",
                'if [ -d "$1" ]; then exit 3; elif [ -e "$1" ]; then exit 4; else exit 2; fi',
                "sh",
                remote,
            ]
        )
        kind = await self._exec(request, sink)
        if kind == 2:
            raise SandboxFileNotFoundError(remote)
        if kind == 4:
            data = await self._read(remote, self.config.read_limit)
            await anyio.to_thread.run_sync(_write_local_file, local, data)
            return
        request, sink = self._internal(
            ["tar", "-c", "-f", "-", "-C", remote, "."], limit=self.config.read_limit
        )
        code = await self._exec(request, sink)
        if sink.overflowed:
            raise OutputLimitExceededError(
                f"download of {remote!r}", self.config.read_limit, path=remote
            )
        if code != 0:
            raise shell_error(remote, sink)
        await anyio.to_thread.run_sync(
            lambda: _untar_into(bytes(sink.stdout), local, skip_unsafe=skip_unsafe)
        )

    def _internal(
        self, argv: list[str], *, stdin: bytes | None = None, limit: int = 1 << 20
    ) -> tuple[ExecRequest, OutputSink]:
        """An exec request for the runtime's own bookkeeping commands."""
        return (
            ExecRequest(
                argv=tuple(argv),
                cwd=self._workdir or "/",
                env={},
                stdin=stdin,
                user=None,
                timeout=None,
                output_limit=limit,
            ),
            OutputSink(limit),
        )

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        """Every sandbox of this backend carrying vf-sandbox labels (for ``cleanup``/``ls``).

        Backends that cannot enumerate their sandboxes return an empty list.
        """
        return []

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        """Remove one sandbox found by :meth:`list_sandboxes`."""
        raise SandboxError(f"{cls.name} cannot remove sandboxes it did not open")

    def _close_at_exit(self) -> None:
        """The atexit backstop: close this runtime on a fresh event loop."""
        anyio.run(self.close)


def _text_bytes(text: str, what: str) -> bytes:
    """``text`` as the bytes the sandbox sees: UTF-8, where the lone surrogates Python
    uses for undecodable bytes (``os.fsdecode``, ``surrogateescape``) stand for those bytes.

    Raises:
        SandboxInvalidArgumentError: a lone surrogate that stands for no byte.
    """
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise SandboxInvalidArgumentError(
            f"{what} is not encodable text (a lone surrogate at position {exc.start}): "
            f"{text[:60]!r}"
        ) from None


def _check_path_length(path: str) -> None:
    encoded = _text_bytes(path, "a path")
    shown = path if len(path) <= 80 else f"{path[:80]}... ({len(encoded)} bytes)"
    if len(encoded) > _PATH_MAX:
        raise SandboxInvalidArgumentError(
            f"path longer than the kernel's {_PATH_MAX}-byte limit (PATH_MAX): {shown!r}"
        )
    if max(len(part) for part in encoded.split(b"/")) > _NAME_MAX:
        raise SandboxInvalidArgumentError(
            f"a path component is longer than the kernel's {_NAME_MAX}-byte limit "
            f"(NAME_MAX): {shown!r}"
        )


def _check_local_path(local: PathLike) -> None:
    if "\x00" in os.fspath(local):
        raise SandboxInvalidArgumentError(f"local path contains a NUL byte: {local!r}")


def shell_error(path: str, sink: OutputSink) -> SandboxError:
    """The typed error a failed shell file command reported on its stderr."""
    from .errors import error_for_errno

    message = bytes(sink.stderr).decode("utf-8", "replace").strip()
    lowered = message.lower()
    for needle, num in (
        ("no such file", 2),
        ("directory nonexistent", 2),  # dash: "cannot create x/y: Directory nonexistent"
        ("permission denied", 13),
        ("not a directory", 20),
        ("is a directory", 21),
        ("read-only file system", 30),
    ):
        if needle in lowered:
            return error_for_errno(num, path, message or None)
    return SandboxError(f"operation on {path!r} failed: {message or 'no message'}")


def _tar_directory(source: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in sorted(source.iterdir()):
            tar.add(entry, arcname=entry.name)
    return buf.getvalue()


def _untar_into(data: bytes, local: Path, *, skip_unsafe: bool = False) -> None:
    """Unpack a tar made in the sandbox into ``local``, never trusting it (see
    :mod:`runtimes._extract`)."""
    extract_archive(io.BytesIO(data), local, skip_unsafe=skip_unsafe)


def _write_local_file(local: Path, data: bytes) -> None:
    local.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=local.parent, prefix=".vf-download-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, local)
    except BaseException:
        with _suppress_os_error():
            os.unlink(tmp)
        raise


@contextmanager
def _suppress_os_error() -> Iterator[None]:
    with suppress(OSError):
        yield


# ---------------------------------------------------------------------- atexit backstop

# Strong references on purpose: a runtime nobody closed must still be reachable at exit.
_LIVE: set[Runtime] = set()
_LIVE_LOCK = threading.Lock()


def live_runtimes() -> list[Runtime]:
    """Runtimes of this process that are open right now."""
    with _LIVE_LOCK:
        return list(_LIVE)


def _close_leftovers() -> None:
    for runtime in live_runtimes():
        try:
            runtime._close_at_exit()
        except Exception:
            log.warning("atexit: could not close %s", runtime.describe(), exc_info=True)


def _register_backstop_last() -> None:
    """atexit runs the last-registered handler first. Backend SDKs imported lazily (in
    ``_start``) register handlers that tear down their own clients; re-registering after
    each start keeps the backstop ahead of them, while their clients still work."""
    atexit.unregister(_close_leftovers)
    atexit.register(_close_leftovers)


atexit.register(_close_leftovers)

__all__ = ["Runtime", "live_runtimes"]
