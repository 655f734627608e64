"""The ``subprocess`` runtime: sandboxes that are local process trees. The embedded default.

NOT AN ISOLATION BOUNDARY. Commands run on the host, as the host user (or as ``user=``
when the host process is root), with the host's filesystem and network. What it gives:
a private working directory per sandbox (removed on close), every command in its own
process group and session (``timeout=``, output caps and cancellation kill the whole
group), and the same typed errors as every other backend. Use it for trusted code,
tests, and judges that only need a scratch directory; use Docker, SSH or Modal to
contain untrusted code.

A process that calls ``setsid`` itself leaves its group and escapes the tree kill.
``close()``, ``stop_processes()`` and the ``cleanup`` sweep find what is left with a
freeze-then-kill sweep of ``/proc`` (see :func:`_sweep`): every process started after the
sandbox that carries its environment mark, belongs to a session one of its commands
started, or has its cwd, root, executable, an open file or a mapping under the sandbox's
directories is stopped (SIGSTOP, through a pidfd), the scan repeats until a pass finds
nothing new, and then all of them are SIGKILLed - a fork loop cannot outrun it. The
sandbox's directory is then removed without ever following a symbolic link.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from typing import IO, Literal

import anyio
import anyio.abc
from pydantic import Field

from . import ownership
from .base import MARK_VAR, Runtime
from .config import RuntimeConfig
from .errors import (
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxPermissionError,
    error_for_errno,
)
from .models import ExecRequest, OutputSink, SandboxInfo, Stream
from .routes import HostRoute, RouteKind

log = logging.getLogger(__name__)

_META = "meta.json"
_READ_CHUNK = 64 * 1024


def default_root() -> str:
    return os.path.join(tempfile.gettempdir(), "vf-sandbox")


class SubprocessConfig(RuntimeConfig):
    """Config of the ``subprocess`` runtime.

    ``root`` is where sandbox directories are created (default: ``$TMPDIR/vf-sandbox``);
    each sandbox gets ``<root>/<id>/work`` as its workdir unless ``workdir`` is given, in
    which case that directory is used as is and left in place on close.
    ``inherit_env`` passes the host's whole environment to commands; by default they get
    only ``PATH``, ``LANG``, ``HOME`` (the workdir) and the config's ``env``.
    """

    type: Literal["subprocess"] = "subprocess"
    root: str | None = None
    inherit_env: bool = False
    user: str | None = Field(default=None, description="default user for exec (root host only)")

    def is_local(self) -> bool:
        return True


class SubprocessRuntime(Runtime):
    """A private directory on the host plus process-group discipline. Not isolation."""

    name = "subprocess"
    config_model = SubprocessConfig

    def __init__(self, config: RuntimeConfig):
        super().__init__(config)
        self.config: SubprocessConfig
        self._dir: Path | None = None
        self._owns_workdir = True
        self._sessions: dict[int, int] = {}  # session id (its leader's pid) -> leader start
        self._target: _Target | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of self._dir

    @property
    def sandbox_id(self) -> str | None:
        return self._dir.name if self._dir else None

    async def _start(self) -> str:
        return await anyio.to_thread.run_sync(self._make_dirs)

    def _make_dirs(self) -> str:
        root = Path(self.config.root or default_root())
        try:
            root.mkdir(parents=True, exist_ok=True)
            since = _boot_ticks() - _SINCE_MARGIN_TICKS
            self._dir = Path(tempfile.mkdtemp(prefix="sbx-", dir=root))
            st = os.lstat(self._dir)
            self._identity = (st.st_dev, st.st_ino)
            meta: dict[str, object] = {
                "labels": ownership.session_labels(self.name, self.config.labels),
                "mark": self._mark,
                "since": since,
            }
            if self.config.workdir:
                self._owns_workdir = False
                workdir = Path(self.config.workdir).absolute()
                workdir.mkdir(parents=True, exist_ok=True)
                meta["workdir"] = str(workdir)
            else:
                workdir = self._dir / "work"
                workdir.mkdir()
            self._target = _Target(
                mark=self._mark,
                dirs=_real_dirs(self._dir, workdir),
                sessions=self._sessions,
                since=since,
            )
            (self._dir / _META).write_text(json.dumps(meta))
        except OSError as exc:
            from .errors import ProvisioningError

            raise ProvisioningError(
                f"cannot create a sandbox directory under {root}: {exc}"
            ) from exc
        return str(workdir)

    async def _close(self) -> None:
        await anyio.to_thread.run_sync(self._teardown)

    def _close_at_exit(self) -> None:
        self._teardown()
        self._mark_closed()

    def _teardown(self) -> None:
        """Kill every process of the sandbox (freeze-then-kill), then remove its directory
        without following a link. Never raises: what could not be done is logged."""
        if self._target is not None:
            try:
                _killed, survivors = _sweep(self._target)
            except OSError as exc:  # /proc unreadable: fall back to the groups we started
                log.warning("%s: process sweep failed: %s", self.describe(), exc)
                survivors = []
                for pgid in list(self._sessions):
                    _kill_group(pgid)
            if survivors:
                log.warning(
                    "%s: processes still running after close(): %s", self.describe(), survivors
                )
            self._sessions.clear()
        if self._dir is not None:
            _remove_sandbox_dir(self._dir, self._identity)

    def _host_routes(self) -> tuple[RouteKind, ...]:
        return ("loopback",)  # the host's own network namespace

    async def _expose_host(self, port: int, via: RouteKind) -> HostRoute:
        return HostRoute("loopback", "127.0.0.1", port)

    async def _alive(self) -> bool:
        return self._workdir is not None and await anyio.Path(self._workdir).is_dir()

    # ------------------------------------------------------------------ exec

    def _base_env(self, request: ExecRequest, home: str) -> dict[str, str]:
        if self.config.inherit_env:
            env = dict(os.environ)
        else:
            env = {
                "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
                "LANG": os.environ.get("LANG", "C.UTF-8"),
                "HOME": home,
            }
        env.update(request.env)
        return env

    def _user_for(self, request: ExecRequest) -> str | None:
        user = request.user or self.config.user
        if user is None:
            return None
        try:
            entry = pwd.getpwnam(user) if not user.isdigit() else pwd.getpwuid(int(user))
        except KeyError:
            raise SandboxInvalidArgumentError(f"no such user in the sandbox: {user!r}") from None
        if entry.pw_uid == os.geteuid():
            return None
        if os.geteuid() != 0:
            raise SandboxPermissionError(
                request.argv[0], f"cannot run as user {user!r}: the host process is not root"
            )
        return entry.pw_name

    async def _exec(self, request: ExecRequest, sink: OutputSink) -> int:
        user = self._user_for(request)
        assert self._workdir is not None
        # Popen directly (no await until the handle is ours, so no cancellation can lose
        # the child), its pipes read with the event loop's own fd readiness and its exit
        # seen through a pidfd: no asyncio transports, no child-watcher thread per command.
        try:
            process = subprocess.Popen(  # noqa: ASYNC220 - fork+exec only, as asyncio does
                list(request.argv),
                stdin=subprocess.PIPE if request.stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=request.cwd,
                env=self._base_env(request, self._workdir),
                start_new_session=True,
                user=user,
            )
        except OSError as exc:
            raise _spawn_error(exc, request) from None
        self._sessions[process.pid] = _start_ticks(process.pid)
        exit_watch = _ExitWatch(process)
        assert process.stdout is not None and process.stderr is not None
        try:
            if _EPOLL:
                code = await _EpollPump(process, request.stdin, sink, exit_watch).run()
            else:
                async with anyio.create_task_group() as tg:
                    if process.stdin is not None:
                        tg.start_soon(_feed_stdin, process.stdin, request.stdin)
                    tg.start_soon(_drain, process.stderr.fileno(), sink, "stderr")
                    await _drain(process.stdout.fileno(), sink, "stdout")
                    code = await exit_watch.wait()
        except BaseException:
            # Timeout, output cap or caller cancellation: the whole group goes, now.
            with anyio.CancelScope(shield=True):
                _kill_group(process.pid)
                await exit_watch.wait()
            raise
        finally:
            exit_watch.close()
            for pipe in (process.stdin, process.stdout, process.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
        # Background processes the command left behind keep running until close().
        return 128 - code if code < 0 else code

    # ------------------------------------------------------------------ files

    async def _read(self, path: str, limit: int) -> bytes:
        return await anyio.to_thread.run_sync(_read_file, path, limit)

    async def _write(self, path: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(_write_file, path, data)

    async def _exists(self, path: str) -> bool:
        try:
            await anyio.to_thread.run_sync(os.lstat, path)
        except FileNotFoundError:
            return False
        except NotADirectoryError:
            return False
        except OSError as exc:
            raise error_for_errno(exc.errno, path, exc.strerror) from None
        return True

    async def _remove(self, path: str) -> None:
        await anyio.to_thread.run_sync(_remove_path, path)

    async def _upload(self, source: Path, remote: str) -> None:
        await anyio.to_thread.run_sync(_copy_tree, source, Path(remote), remote)

    async def _download(self, remote: str, local: Path, *, skip_unsafe: bool = False) -> None:
        await anyio.to_thread.run_sync(_download_tree, remote, local, self.config.read_limit)

    async def stop_processes(self) -> int:
        """Kill every process of this sandbox that is still running; return how many.

        Unlike the base implementation (an environment-mark scan), this freezes before it
        kills: every process started after the sandbox that carries its environment mark,
        belongs to a session one of its commands started, or has its cwd, root, executable,
        an open file or a mapping under the sandbox's directories is SIGSTOPped, the scan
        repeats until a pass finds nothing new, and then all are SIGKILLed. Processes that
        ``setsid`` or ``env -i`` and fork loops are caught; see the module's docstring and
        the README for what still escapes (a process that left every trace behind).

        Raises:
            SandboxUnavailableError: the sandbox is closed or dead.
            SandboxError: some process of the sandbox is still running after the sweep
                (it could not be signalled, or kept appearing until the sweep's deadline).
        """
        self._check_open()
        assert self._target is not None
        target = self._target
        with self._guard("stop_processes"):
            killed, survivors = await anyio.to_thread.run_sync(_sweep, target)
        if survivors:
            raise SandboxError(
                f"{self.describe()}: processes still running after stop_processes(): {survivors}"
            )
        return killed

    # ------------------------------------------------------------------ sweeping

    @classmethod
    async def list_sandboxes(cls, config: RuntimeConfig | None = None) -> list[SandboxInfo]:
        root = Path(getattr(config, "root", None) or default_root())
        return await anyio.to_thread.run_sync(_scan_root, root)

    @classmethod
    async def destroy_sandbox(cls, info: SandboxInfo, config: RuntimeConfig | None = None) -> None:
        root = Path(getattr(config, "root", None) or default_root())
        await anyio.to_thread.run_sync(_destroy_dir, root / info.id)


# ---------------------------------------------------------------------- exec helpers


class _ExitWatch:
    """Waits for a child's exit: readiness of a pidfd (Linux >= 5.3), else a worker thread."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        self.pidfd: int | None = None

    async def wait(self) -> int:
        process = self._process
        if (code := process.poll()) is not None:
            return code
        if self.pidfd is None:
            with contextlib.suppress(AttributeError, OSError):
                self.pidfd = os.pidfd_open(process.pid)
        if self.pidfd is None:
            return await anyio.to_thread.run_sync(process.wait, abandon_on_cancel=True)
        while (code := process.poll()) is None:
            await anyio.wait_readable(self.pidfd)
        return code

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


_EPOLL = hasattr(select, "epoll")
_EXIT_SPINS = 64
"""Polls of the exit status after the pipes closed before waiting on the event loop: the
kernel reports the exit microseconds after it closed the pipes."""


class _EpollPump:
    """Feeds stdin, drains stdout and stderr and waits for the exit in ONE task (Linux).

    The pipes (non-blocking) share an epoll instance, and the event loop watches that
    instance's own fd: one registration per wait instead of one per pipe, and no task
    group. Output over the sink's cap stops the reading and kills the group. Once the pipes
    closed, the exit is polled for a few microseconds before the pidfd is waited for.
    """

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        stdin: bytes | None,
        sink: OutputSink,
        exit_watch: _ExitWatch,
    ) -> None:
        assert process.stdout is not None and process.stderr is not None
        self._process = process
        self._sink = sink
        self._exit_watch = exit_watch
        self._epoll = select.epoll()
        self._outputs: dict[int, Stream] = {}
        for pipe, name in ((process.stdout, "stdout"), (process.stderr, "stderr")):
            self._watch(pipe.fileno(), select.EPOLLIN)
            self._outputs[pipe.fileno()] = name  # type: ignore[assignment]
        self._pending = memoryview(stdin or b"")
        self._stdin_fd: int | None = None
        if process.stdin is not None:
            self._stdin_fd = process.stdin.fileno()
            self._watch(self._stdin_fd, select.EPOLLOUT)

    def _watch(self, fd: int, events: int) -> None:
        os.set_blocking(fd, False)
        self._epoll.register(fd, events)

    async def run(self) -> int:
        try:
            while self._outputs or self._stdin_fd is not None:
                await self._step()
        finally:
            self._epoll.close()
        for _ in range(_EXIT_SPINS):
            if (code := self._process.poll()) is not None:
                return code
            os.sched_yield()
        return await self._exit_watch.wait()

    async def _step(self) -> None:
        events = self._epoll.poll(0)
        if not events:
            await anyio.wait_readable(self._epoll.fileno())
            return
        for fd, _ in events:
            if fd == self._stdin_fd:
                self._feed()
            elif fd in self._outputs:
                self._read(fd)

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            return
        if not data:
            self._epoll.unregister(fd)
            del self._outputs[fd]
        elif not self._sink.feed(self._outputs[fd], data):
            for watched in self._outputs:
                self._epoll.unregister(watched)
            self._outputs.clear()
            _kill_group(self._process.pid)

    def _feed(self) -> None:
        assert self._stdin_fd is not None and self._process.stdin is not None
        try:
            written = os.write(self._stdin_fd, self._pending[:_READ_CHUNK])
            self._pending = self._pending[written:]
        except BlockingIOError:
            return
        except OSError:  # EPIPE: the process exited or closed its stdin without reading it all
            self._pending = memoryview(b"")
        if not self._pending:
            self._epoll.unregister(self._stdin_fd)
            self._stdin_fd = None
            with contextlib.suppress(OSError):
                self._process.stdin.close()


async def _feed_stdin(pipe: IO[bytes], data: bytes | None) -> None:
    fd = pipe.fileno()
    os.set_blocking(fd, False)
    view = memoryview(data or b"")
    try:
        while view:
            try:
                view = view[os.write(fd, view[:_READ_CHUNK]) :]
            except BlockingIOError:
                await anyio.wait_writable(fd)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the process exited or closed its stdin without reading everything
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


async def _drain(fd: int, sink: OutputSink, name: Stream) -> None:
    os.set_blocking(fd, False)
    while True:
        try:
            data = os.read(fd, _READ_CHUNK)
        except BlockingIOError:
            await anyio.wait_readable(fd)
            continue
        if not data or not sink.feed(name, data):
            return


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _spawn_error(exc: OSError, request: ExecRequest) -> SandboxError:
    if exc.errno == errno.E2BIG:
        size = sum(len(a.encode()) + 1 for a in request.argv)
        return SandboxInvalidArgumentError(
            f"argument list too long for the kernel ({size} bytes); "
            "pass large data through stdin or a file"
        )
    filename = exc.filename if isinstance(exc.filename, str) else request.argv[0]
    return error_for_errno(exc.errno, filename, exc.strerror)


# ---------------------------------------------------------------------- file helpers


def _open_regular(path: str, flags: int) -> int:
    """Open a file without blocking on a FIFO or a socket (a read or write of one would
    wait for a peer for ever, in a thread nobody can cancel); those are refused."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, 0o666)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO without a reader, or a socket
            raise SandboxInvalidArgumentError(
                f"{path!r} is a FIFO or a socket, not a file"
            ) from None
        raise
    mode = os.fstat(fd).st_mode
    if stat.S_ISDIR(mode):
        os.close(fd)
        raise SandboxIsADirectoryError(path)
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        os.close(fd)
        raise SandboxInvalidArgumentError(f"{path!r} is a FIFO or a socket, not a file")
    os.set_blocking(fd, True)
    return fd


def _read_file(path: str, limit: int) -> bytes:
    from .errors import OutputLimitExceededError

    try:
        with os.fdopen(_open_regular(path, os.O_RDONLY), "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > limit:
                raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
            return fh.read(limit + 1)
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, path, None) from None


def _write_file(path: str, data: bytes) -> None:
    try:
        if os.path.isdir(path):
            raise SandboxIsADirectoryError(path)
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        with os.fdopen(_open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as fh:
            fh.write(data)
    except FileExistsError as exc:  # a parent exists as a file: makedirs says EEXIST
        raise error_for_errno(
            errno.ENOTDIR, path, f"parent is not a directory: {exc.filename}"
        ) from None
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, path, None) from None


def _remove_path(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError as exc:
        raise error_for_errno(exc.errno, path, None) from None


def _copy_tree(source: Path, target: Path, shown: str) -> None:
    try:
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True, symlinks=True)
        else:
            if target.is_dir():
                raise SandboxIsADirectoryError(shown)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    except FileExistsError:
        raise error_for_errno(errno.ENOTDIR, shown, "a parent is not a directory") from None
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, shown, None) from None


def _download_tree(remote: str, local: Path, limit: int) -> None:
    if not os.path.lexists(remote):
        raise SandboxFileNotFoundError(remote)
    try:
        if os.path.isdir(remote):
            shutil.copytree(remote, local, dirs_exist_ok=True, symlinks=True)
        else:
            data = _read_file(remote, limit)
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(data)
    except OSError as exc:
        if isinstance(exc, SandboxError):
            raise
        raise error_for_errno(exc.errno, remote, None) from None


# ---------------------------------------------------------------------- removal


def _remove_sandbox_dir(directory: Path, identity: tuple[int, int] | None) -> None:
    """Remove the sandbox's directory, never following a symbolic link. Never raises.

    Every directory is pinned by an ``O_PATH|O_NOFOLLOW|O_DIRECTORY`` descriptor before it
    is touched, made searchable and writable through that descriptor (``chmod`` of
    ``/proc/self/fd/N`` acts on the pinned inode, never on what a name points to), then
    emptied relative to its own descriptor; links and files are unlinked, never opened or
    chmodded; no mount point is crossed. ``identity`` ((st_dev, st_ino) at creation) must
    match, else the entry at that name is not the sandbox's and is left alone. A symbolic
    link planted at the sandbox's own name is unlinked.
    """
    errors: list[str] = []
    try:
        parent_fd = os.open(directory.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            log.warning("cannot remove %s: %s", directory, exc)
        return
    try:
        name = directory.name
        try:
            st = os.lstat(name, dir_fd=parent_fd)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode):
            if stat.S_ISLNK(st.st_mode) or identity is None:
                _unlink_at(parent_fd, name, str(directory), errors)
        elif identity is not None and (st.st_dev, st.st_ino) != identity:
            errors.append(f"{directory}: not the sandbox's directory any more, left alone")
        else:
            _remove_tree_at(parent_fd, name, str(directory), errors)
    finally:
        os.close(parent_fd)
    if errors:
        log.warning("could not remove all of %s: %s", directory, "; ".join(errors[:10]))


def _unlink_at(
    dir_fd: int, name: str, shown: str, errors: list[str], *, directory: bool = False
) -> None:
    """Unlink ``name`` of ``dir_fd`` (an empty directory with ``directory``); gone already
    is fine, any other failure is noted in ``errors``."""
    try:
        (os.rmdir if directory else os.unlink)(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        errors.append(f"{shown}: {exc.strerror}")


def _open_dir_at(parent_fd: int, name: str) -> int:
    """A readable descriptor of the real directory ``name`` (never a link), made u+rwx."""
    pinned = os.open(
        name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent_fd
    )
    try:
        via = f"/proc/self/fd/{pinned}"
        if stat.S_IMODE(os.fstat(pinned).st_mode) & 0o700 != 0o700:
            os.chmod(via, 0o700)  # the pinned inode: /proc's fd links are not path lookups
        return os.open(via, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    finally:
        os.close(pinned)


def _remove_tree_at(parent_fd: int, name: str, shown: str, errors: list[str]) -> None:
    """Remove directory ``name`` of ``parent_fd`` and everything in it (iteratively, so a
    deep tree does not exhaust the interpreter's stack)."""
    try:
        top = _open_dir_at(parent_fd, name)
    except OSError as exc:
        errors.append(f"{shown}: {exc.strerror}")
        return
    device = os.fstat(top).st_dev
    # Frames: (descriptor, name in the parent, display path, entries not yet removed).
    stack: list[tuple[int, str, str, list[str]]] = [(top, name, shown, _entries(top))]
    while stack:
        fd, own_name, own_shown, pending = stack[-1]
        if not pending:
            stack.pop()
            os.close(fd)
            parent = stack[-1][0] if stack else parent_fd
            _unlink_at(parent, own_name, own_shown, errors, directory=True)
            continue
        entry = pending.pop()
        entry_shown = f"{own_shown}/{entry}"
        try:
            st = os.lstat(entry, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            errors.append(f"{entry_shown}: {exc.strerror}")
            continue
        if not stat.S_ISDIR(st.st_mode):
            _unlink_at(fd, entry, entry_shown, errors)
        elif st.st_dev != device:
            errors.append(f"{entry_shown}: a mount point, not crossed")
        else:
            try:
                child = _open_dir_at(fd, entry)
            except OSError as exc:  # ELOOP/ENOTDIR: replaced by a link meanwhile
                errors.append(f"{entry_shown}: {exc.strerror}")
                continue
            stack.append((child, entry, entry_shown, _entries(child)))


def _entries(fd: int) -> list[str]:
    with os.scandir(fd) as it:
        return [entry.name for entry in it]


# ---------------------------------------------------------------------- process sweep

_SINCE_MARGIN_TICKS = 50
"""Clock ticks before the sandbox's creation from which a process may belong to it."""
_SWEEP_SECONDS = 10.0
"""How long the freezing passes may go on before the sweep kills what it has."""
_REAP_SECONDS = 3.0
"""How long a SIGKILLed process may take to die before it counts as a survivor."""
_SWEEP_ATTEMPTS = 3
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_DELETED = " (deleted)"


class _Target:
    """What identifies one sandbox's processes on the host.

    ``mark``: the value of ``VF_SANDBOX_RUNTIME`` its commands carry; ``dirs``: its
    directories (real paths); ``sessions``: session id -> start (clock ticks since boot)
    of the leader each command was started as; ``since``: processes started before this
    (clock ticks since boot) are never the sandbox's.
    """

    def __init__(
        self, mark: str | None, dirs: tuple[str, ...], sessions: dict[int, int], since: int
    ) -> None:
        self.mark = f"{MARK_VAR}={mark}".encode() if mark else None
        self.dirs = dirs
        self.sessions = sessions
        self.since = since

    def holds(self, path: str) -> bool:
        if path.endswith(_DELETED):
            path = path[: -len(_DELETED)]
        return any(path == d or path.startswith(d + "/") for d in self.dirs)


class _Stat:
    __slots__ = ("pgid", "ppid", "sid", "start", "state")

    def __init__(self, state: str, ppid: int, pgid: int, sid: int, start: int) -> None:
        self.state = state
        self.ppid = ppid
        self.pgid = pgid
        self.sid = sid
        self.start = start


def _boot_ticks() -> int:
    with open("/proc/uptime", "rb") as fh:
        return int(float(fh.read().split()[0]) * _CLK_TCK)


def _proc_stat(pid: int) -> _Stat | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # "pid (comm) state ppid pgrp session ... starttime(22)": comm may hold anything.
    fields = data[data.rfind(b")") + 2 :].split()
    try:
        return _Stat(
            fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])
        )
    except (IndexError, ValueError):
        return None


def _start_ticks(pid: int) -> int:
    st = _proc_stat(pid)
    return st.start if st is not None else -1


def _real_dirs(*dirs: Path) -> tuple[str, ...]:
    return tuple(dict.fromkeys(os.path.realpath(d) for d in dirs))


def _protected() -> set[int]:
    """This process and its ancestors (and init): never signalled."""
    keep = {0, 1, os.getpid()}
    pid = os.getppid()
    while pid > 1 and pid not in keep:
        keep.add(pid)
        st = _proc_stat(pid)
        if st is None:
            break
        pid = st.ppid
    return keep


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _environ_marks(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    prefix = MARK_VAR.encode() + b"="
    return [item for item in data.split(b"\0") if item.startswith(prefix)]


def _located_under(pid: int, target: _Target, own_mnt: str | None) -> bool:
    """cwd, root, executable, an open file or a mapping under the sandbox's directories.
    Only in this process's mount namespace, where paths mean the same."""
    base = f"/proc/{pid}"
    if own_mnt is None or _readlink(f"{base}/ns/mnt") != own_mnt:
        return False
    for link in ("cwd", "root", "exe"):
        found = _readlink(f"{base}/{link}")
        if found is not None and target.holds(found):
            return True
    try:
        fds = os.listdir(f"{base}/fd")
    except OSError:
        fds = []
    for fd in fds:
        found = _readlink(f"{base}/fd/{fd}")
        if found is not None and found.startswith("/") and target.holds(found):
            return True
    try:
        with open(f"{base}/maps", "rb") as fh:
            maps = fh.read().decode("utf-8", "surrogateescape")
    except OSError:
        return False
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and target.holds(parts[5]):
            return True
    return False


_NOT_OURS, _DESCENDANT, _LOCATED = 0, 1, 2


def _belongs(pid: int, st: _Stat, target: _Target, own_mnt: str | None) -> int:
    """``_DESCENDANT``: started by the sandbox (its mark, or a session one of its commands
    started); ``_LOCATED``: cwd, root, executable, open file or mapping in its directories;
    else ``_NOT_OURS``. Processes started before the sandbox, and zombies, are not ours.
    The cheapest sufficient test (the cwd, one syscall) comes first: a fork loop's
    generation lives for a moment only."""
    if st.start < target.since or st.state in ("Z", "X"):
        return _NOT_OURS
    cwd = _readlink(f"/proc/{pid}/cwd")
    if cwd is not None and target.holds(cwd) and _same_mnt(pid, own_mnt):
        return _LOCATED
    if _descends(pid, st, target):
        return _DESCENDANT
    return _LOCATED if _located_under(pid, target, own_mnt) else _NOT_OURS


def _same_mnt(pid: int, own_mnt: str | None) -> bool:
    return own_mnt is not None and _readlink(f"/proc/{pid}/ns/mnt") == own_mnt


def _descends(pid: int, st: _Stat, target: _Target) -> bool:
    """Started by the sandbox: carries its mark, or is in a session one of its commands
    started (unless that session id was reused since: its leader alive but not the
    process we started, or the process marked as another sandbox's)."""
    marks = _environ_marks(pid)
    if marks and target.mark is not None and target.mark in marks:
        return True
    if st.sid in target.sessions and not marks:
        leader = _proc_stat(st.sid)
        if leader is None or leader.start == target.sessions[st.sid]:
            return True
    return False


def _pids_newest_first() -> list[tuple[int, int]]:
    """(pid, inode of /proc/<pid>), most recently allocated pid first: a fork loop's live
    generation is among the newest, and must be reached before it forks again and exits.
    Pids are allocated upwards from the last one (``/proc/loadavg``'s last field) and
    wrap. The inode tells a reused pid from the process once seen (procfs flushes a
    process's entry when it exits)."""
    with os.scandir("/proc") as it:
        pids = sorted(((int(e.name), e.inode()) for e in it if e.name.isdigit()), reverse=True)
    try:
        with open("/proc/loadavg", "rb") as fh:
            last = int(fh.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return pids
    return [p for p in pids if p[0] <= last] + [p for p in pids if p[0] > last]


_STARTS: dict[int, tuple[int, int]] = {}
"""pid -> (inode of /proc/<pid>, start in clock ticks since boot), kept across sweeps: a
process's start never changes, so each sweep reads the stat of new processes only."""


def _fresh_stat(pid: int, inode: int, since: int) -> _Stat | None:
    """The process's stat, or None if it is gone or started before ``since`` (known from
    the cache without reading anything)."""
    known = _STARTS.get(pid)
    if known is not None and known[0] == inode and known[1] < since:
        return None
    st = _proc_stat(pid)
    if st is not None:
        _STARTS[pid] = (inode, st.start)
        if st.start < since:
            return None
    return st


def _prune_starts(listing: list[tuple[int, int]]) -> None:
    if len(_STARTS) > 2 * len(listing) + 1024:
        live = dict(listing)
        for pid in list(_STARTS):
            if live.get(pid) != _STARTS.get(pid, (None,))[0]:
                _STARTS.pop(pid, None)


def _matching(target: _Target, keep: set[int]) -> dict[int, _Stat]:
    own_mnt = _readlink("/proc/self/ns/mnt")
    found: dict[int, _Stat] = {}
    listing = _pids_newest_first()
    for pid, inode in listing:
        if pid in keep:
            continue
        st = _fresh_stat(pid, inode, target.since)
        if st is not None and _belongs(pid, st, target, own_mnt):
            found[pid] = st
    _prune_starts(listing)
    return found


_SENT, _GONE, _DENIED = "sent", "gone", "denied"


def _signal(pid: int, start: int, sig: signal.Signals) -> str:
    """Signal the process ``pid`` started at ``start`` through a pidfd, so a reused pid is
    never hit: ``_SENT``, ``_GONE`` (exited, or the pid is another process now) or
    ``_DENIED`` (another user's process, e.g. a set-user-ID program)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return _GONE
    try:
        now = _proc_stat(pid)
        if now is None or now.start != start:
            return _GONE
        signal.pidfd_send_signal(pidfd, sig)
        return _SENT
    except ProcessLookupError:
        return _GONE
    except PermissionError:
        return _DENIED
    finally:
        os.close(pidfd)


_QUIET_PASSES = 3
"""Consecutive passes that must find nothing new before the sweep kills what it froze."""


def _sweep(target: _Target) -> tuple[int, list[int]]:
    """Freeze-then-kill every process of ``target``; return (killed, survivors' pids).

    Each pass walks /proc newest pid first and SIGSTOPs every matching process at once
    (through a pidfd) - and, for a process the sandbox started, its whole process group,
    atomically, so a loop forking within its group is stopped mid-fork. Passes repeat
    until several in a row find no new match (a stopped process cannot fork), then
    everything frozen is SIGKILLed and the scan repeated to verify. Raises OSError if
    /proc cannot be listed.
    """
    keep = _protected()
    keep_groups = {os.getpgrp()} | {st.pgid for p in keep if (st := _proc_stat(p)) is not None}
    keep_groups |= {0, 1}
    own_mnt = _readlink("/proc/self/ns/mnt")
    killed: set[tuple[int, int]] = set()
    denied: set[tuple[int, int]] = set()
    for _ in range(_SWEEP_ATTEMPTS):
        frozen: dict[int, int] = {}
        cleared: set[tuple[int, int]] = set()  # (pid, inode) judged not ours this attempt
        deadline = time.monotonic() + _SWEEP_SECONDS
        quiet = 0
        while quiet < _QUIET_PASSES and time.monotonic() < deadline:
            moving = False
            for pid, inode in _pids_newest_first():
                if pid in keep or (pid, inode) in cleared:
                    continue
                st = _fresh_stat(pid, inode, target.since)
                if st is None or (pid, st.start) in denied:
                    continue
                if frozen.get(pid) == st.start and st.state in ("T", "t"):
                    continue
                kind = _belongs(pid, st, target, own_mnt)
                if kind == _NOT_OURS:
                    cleared.add((pid, inode))  # the verifying scan looks again
                    continue
                moving = True
                outcome = _signal(pid, st.start, signal.SIGSTOP)
                if outcome == _SENT:
                    frozen[pid] = st.start
                elif outcome == _DENIED:
                    denied.add((pid, st.start))
                # The sandbox's own process: stop its whole group at once too, so that a
                # loop forking within it is caught mid-fork. (A group only holds processes
                # of its session, and every process of a session the sandbox started is
                # the sandbox's.)
                if st.pgid not in keep_groups and (
                    kind == _DESCENDANT or _descends(pid, st, target)
                ):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(st.pgid, signal.SIGSTOP)
            quiet = 0 if moving else quiet + 1
        for pid, start in frozen.items():
            if _signal(pid, start, signal.SIGKILL) == _SENT:
                killed.add((pid, start))
        _wait_gone(frozen)
        left = [pid for pid, st in _matching(target, keep).items() if (pid, st.start) not in denied]
        if not left:
            break
    survivors = sorted(pid for pid, _start in denied if _proc_stat(pid) is not None)
    if left:
        survivors = sorted({*survivors, *left})
    return len(killed), survivors


def _wait_gone(processes: dict[int, int]) -> None:
    deadline = time.monotonic() + _REAP_SECONDS
    pending = dict(processes)
    while pending and time.monotonic() < deadline:
        for pid, start in list(pending.items()):
            st = _proc_stat(pid)
            if st is None or st.start != start or st.state in ("Z", "X"):
                del pending[pid]
        if pending:
            time.sleep(0.005)


def _scan_root(root: Path) -> list[SandboxInfo]:
    found: list[SandboxInfo] = []
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        if entry.is_symlink() or not entry.is_dir():
            continue
        meta = _read_meta(entry)
        if not meta:
            continue
        raw_labels = meta.get("labels")
        if not isinstance(raw_labels, dict):
            raw_labels = {}
        labels = {str(k): str(v) for k, v in raw_labels.items()}
        found.append(
            SandboxInfo(
                backend="subprocess",
                id=entry.name,
                labels=labels,
                state="present",
                created=labels.get(ownership.CREATED),
            )
        )
    return found


def _destroy_dir(directory: Path) -> None:
    """Kill processes still running of a leaked sandbox (the same freeze-then-kill sweep as
    ``close()``, by the mark, start time and workdir its ``meta.json`` recorded, and by its
    directories), then remove it without following links."""
    meta = _read_meta(directory)
    workdir = directory / "work"
    declared = meta.get("workdir")
    if isinstance(declared, str) and declared.startswith("/") and declared.strip("/"):
        workdir = Path(declared)
    mark = meta.get("mark")
    since = meta.get("since")
    target = _Target(
        mark=mark if isinstance(mark, str) and mark else None,
        dirs=_real_dirs(directory, workdir),
        sessions={},
        since=since if isinstance(since, int) else 0,
    )
    try:
        _killed, survivors = _sweep(target)
    except OSError as exc:
        log.warning("%s: process sweep failed: %s", directory, exc)
    else:
        if survivors:
            log.warning("%s: processes still running after the sweep: %s", directory, survivors)
    _remove_sandbox_dir(directory, None)


def _read_meta(directory: Path) -> dict[str, object]:
    """The sandbox's ``meta.json``, read without following a link; {} if unreadable."""
    try:
        fd = os.open(directory / _META, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as fh:
            meta = json.loads(fh.read(1 << 20))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}
