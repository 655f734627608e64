"""The ``subprocess`` runtime: sandboxes that are local process trees. The embedded default.

NOT AN ISOLATION BOUNDARY. Commands run on the host, as the host user (or as ``user=``
when the host process is root), with the host's filesystem and network. What it gives:
a private working directory per sandbox (removed on close), every command in its own
process group and session (``timeout=``, output caps and cancellation kill the whole
group), and the same typed errors as every other backend. Use it for trusted code,
tests, and judges that only need a scratch directory; use Docker, SSH or Modal to
contain untrusted code.

A process that calls ``setsid`` itself leaves its group and escapes the tree kill;
``close()`` kills every process group the sandbox started, and the ``cleanup`` sweep
kills processes still running inside a dead session's workdir.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Literal

import anyio
import anyio.abc
from pydantic import Field

from . import session
from .base import Runtime
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
        self._groups: set[int] = set()

    @property
    def sandbox_id(self) -> str | None:
        return self._dir.name if self._dir else None

    async def _start(self) -> str:
        return await anyio.to_thread.run_sync(self._make_dirs)

    def _make_dirs(self) -> str:
        root = Path(self.config.root or default_root())
        try:
            root.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="sbx-", dir=root))
            meta: dict[str, object] = {
                "labels": session.session_labels(self.name, self.config.labels)
            }
            if self.config.workdir:
                self._owns_workdir = False
                workdir = Path(self.config.workdir).absolute()
                workdir.mkdir(parents=True, exist_ok=True)
                meta["workdir"] = str(workdir)
            else:
                workdir = self._dir / "work"
                workdir.mkdir()
            (self._dir / _META).write_text(json.dumps(meta))
        except OSError as exc:
            from .errors import ProvisioningError

            raise ProvisioningError(
                f"cannot create a sandbox directory under {root}: {exc}"
            ) from exc
        return str(workdir)

    async def _close(self) -> None:
        for pgid in list(self._groups):
            _kill_group(pgid)
        self._groups.clear()
        if self._dir is not None:
            target = self._dir
            await anyio.to_thread.run_sync(_remove_sandbox_dir, target, self._owns_workdir)

    def _close_at_exit(self) -> None:
        for pgid in list(self._groups):
            _kill_group(pgid)
        if self._dir is not None:
            _remove_sandbox_dir(self._dir, self._owns_workdir)
        self._state = "closed"

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
        self._groups.add(process.pid)
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

    async def _download(self, remote: str, local: Path) -> None:
        await anyio.to_thread.run_sync(_download_tree, remote, local, self.config.read_limit)

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


def _remove_sandbox_dir(directory: Path, owns_workdir: bool) -> None:
    if owns_workdir:
        _make_writable(directory)
    shutil.rmtree(directory, ignore_errors=True)


def _make_writable(directory: Path) -> None:
    """A command may have made files read-only (chmod 000): rmtree needs write on dirs."""
    for current, dirs, _files in os.walk(directory):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(current, name), 0o700)
        with contextlib.suppress(OSError):
            os.chmod(current, 0o700)


def _scan_root(root: Path) -> list[SandboxInfo]:
    found: list[SandboxInfo] = []
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        meta_file = entry / _META
        try:
            meta = json.loads(meta_file.read_text())
        except (OSError, ValueError):
            continue
        labels = {str(k): str(v) for k, v in meta.get("labels", {}).items()}
        found.append(
            SandboxInfo(
                backend="subprocess",
                id=entry.name,
                labels=labels,
                state="present",
                created=labels.get(session.CREATED),
            )
        )
    return found


def _destroy_dir(directory: Path) -> None:
    """Kill processes still running inside a leaked sandbox, then remove it."""
    workdir = directory / "work"
    try:
        meta = json.loads((directory / _META).read_text())
        workdir = Path(meta.get("workdir", workdir))
    except (OSError, ValueError):
        pass
    for pid in _pids_with_cwd_under(workdir):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    _remove_sandbox_dir(directory, owns_workdir=True)


def _pids_with_cwd_under(workdir: Path) -> list[int]:
    prefix = str(workdir)
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == prefix or cwd.startswith(prefix + "/"):
            pids.append(int(entry.name))
    return pids
