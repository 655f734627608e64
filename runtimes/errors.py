"""The error taxonomy shared by every backend.

Every error a runtime raises is a :class:`SandboxError`. Where a builtin exception
describes the same situation, the sandbox error is also a subclass of it, so code
written against the standard library (``except FileNotFoundError``) keeps working.

The three errors callers most need to tell apart are never conflated:

* :class:`SandboxFileNotFoundError` -- the sandbox is fine, the path is not there.
* :class:`SandboxUnavailableError` -- the sandbox itself is gone (dead, stopped,
  removed, closed, never started).
* :class:`SandboxTransportError` -- the sandbox may be fine, the channel to it failed.
"""

from __future__ import annotations

import errno as _errno
import os
import posixpath
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from .models import ExecResult

__all__ = [
    "BuildContextError",
    "ChannelTamperedError",
    "CommandFailedError",
    "ExecTimeoutError",
    "HostRouteError",
    "ListingLimitExceededError",
    "OutputLimitExceededError",
    "ProvisioningError",
    "SandboxError",
    "SandboxFileExistsError",
    "SandboxFileNotFoundError",
    "SandboxInvalidArgumentError",
    "SandboxIsADirectoryError",
    "SandboxNoSpaceError",
    "SandboxNotADirectoryError",
    "SandboxPermissionError",
    "SandboxProcessLimitError",
    "SandboxResourceError",
    "SandboxTransportError",
    "SandboxUnavailableError",
    "SandboxUserNotFoundError",
    "SandboxUserRefusedError",
    "UnsafeArchiveMemberError",
    "arg_too_long",
    "argument_list_too_long",
    "cannot_run_as",
    "error_for_errno",
    "names_the_program",
    "no_such_user",
]


class SandboxError(Exception):
    """Base of every error raised by a runtime."""


class _SandboxOSError(SandboxError, OSError):
    """A filesystem error inside the sandbox, shaped like the builtin ``OSError``.

    ``errno``, ``strerror`` and ``filename`` are set, so ``str(err)`` reads like the
    standard library's ``[Errno 2] No such file or directory: '/work/x'``.
    """

    default_errno: ClassVar[int] = 0

    def __init__(self, filename: str, detail: str | None = None, *, code: int | None = None):
        num = code if code is not None else self.default_errno
        strerror = _errno_message(num)
        if detail:
            strerror = f"{strerror} ({detail})"
        OSError.__init__(self, num, strerror, filename)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.filename, None), {"errno": self.errno, "strerror": self.strerror})


def _errno_message(num: int) -> str:
    return os.strerror(num) if num else "error"


class SandboxFileNotFoundError(_SandboxOSError, FileNotFoundError):
    """The path does not exist in a live sandbox."""

    default_errno = _errno.ENOENT


class SandboxIsADirectoryError(_SandboxOSError, IsADirectoryError):
    """A file operation was given a directory."""

    default_errno = _errno.EISDIR


class SandboxNotADirectoryError(_SandboxOSError, NotADirectoryError):
    """A path component (or a directory operation's target) is not a directory."""

    default_errno = _errno.ENOTDIR


class SandboxPermissionError(_SandboxOSError, PermissionError):
    """The path is not readable, writable or executable for the sandbox user."""

    default_errno = _errno.EACCES


class SandboxUserRefusedError(SandboxPermissionError):
    """``exec(user=...)`` (or a shell's ``user=``) cannot switch to that user here: the
    backend or the sandbox's own user lacks the privilege. ``filename`` is the program."""


class SandboxFileExistsError(_SandboxOSError, FileExistsError):
    """The target exists and the operation refuses to replace it."""

    default_errno = _errno.EEXIST


class SandboxNoSpaceError(_SandboxOSError):
    """A write of the runtime's own (``write``, ``upload``) ran out of room: the sandbox's
    disk quota (Docker's ``disk=``) or its filesystem is full. ``errno`` is ``ENOSPC``
    (``EDQUOT`` for a user's quota); nothing of the write was left behind where the backend
    writes through a temporary file. A command that runs out of room gets the same errno in
    its own output and exit code: that is a result, not this error."""

    default_errno = _errno.ENOSPC


class SandboxProcessLimitError(_SandboxOSError, BlockingIOError):
    """A command could not start: the sandbox is at its process limit (Docker's
    ``pids_limit``), so no process (or no thread to serve it) could be made. Like the
    ``BlockingIOError`` that ``fork`` raises there: ``errno`` is ``EAGAIN`` and
    ``filename`` the program. ``limit`` is ``"pids"``, ``setting`` the limit in force when
    the sandbox could tell (``"64"``), else ``None``. Nothing was started; the sandbox
    stays usable, and ``stop_processes()`` frees it."""

    default_errno = _errno.EAGAIN
    limit = "pids"

    def __init__(self, filename: str, setting: str | None = None) -> None:
        value = f" of {setting}" if setting else ""
        super().__init__(
            filename,
            f"the sandbox is at its process limit (pids_limit){value}: "
            "stop_processes() kills what fills it",
        )
        self.setting = setting

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.filename, self.setting))


class SandboxInvalidArgumentError(SandboxError, ValueError):
    """An argument can never be valid: a NUL byte in a path, an empty argv, a bad env name."""


class SandboxUserNotFoundError(SandboxInvalidArgumentError):
    """``exec(user=...)`` named a user the sandbox does not have."""


class _CarriesOutput:
    """An error that holds a command's output so far, as bytes and as text."""

    stdout_bytes: bytes
    stderr_bytes: bytes

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")


class ExecTimeoutError(_CarriesOutput, SandboxError, TimeoutError):
    """``exec(timeout=...)`` expired, or the awaiting task was cancelled mid-exec.

    The whole process tree inside the sandbox was killed before this was raised (from a shell
    session's ``run``: the command was interrupted and the shell lives; ``outcome`` says which).
    ``stdout_bytes`` / ``stderr_bytes`` hold the output captured up to that point.
    """

    def __init__(
        self,
        argv: list[str],
        timeout: float | None,
        stdout_bytes: bytes = b"",
        stderr_bytes: bytes = b"",
        outcome: str = "process tree killed",
    ):
        self.argv = argv
        self.timeout = timeout
        self.stdout_bytes = stdout_bytes
        self.stderr_bytes = stderr_bytes
        self.outcome = outcome
        super().__init__(f"command {_short_argv(argv)} timed out after {timeout}s; {outcome}")

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.argv, self.timeout, self.stdout_bytes, self.stderr_bytes, self.outcome),
        )


class CommandFailedError(_CarriesOutput, SandboxError):
    """``exec(..., check=True)``: the command ran and exited non-zero.

    ``result`` is the :class:`~runtimes.models.ExecResult` ``exec`` would have returned;
    ``argv``, ``exit_code``, ``stdout_bytes`` / ``stderr_bytes`` (and their text) are
    copied from it. The message ends with the last lines of stderr, where the reason
    usually is.
    """

    def __init__(self, argv: list[str], result: ExecResult):
        self.argv = argv
        self.result = result
        self.exit_code = result.exit_code
        self.stdout_bytes = result.stdout_bytes
        self.stderr_bytes = result.stderr_bytes
        tail = result.stderr.rstrip()[-_FAILED_TAIL:]
        said = f": {tail}" if tail else ""
        super().__init__(f"command {_short_argv(argv)} exited {result.exit_code}{said}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.argv, self.result))


_FAILED_TAIL = 500
"""Characters of stderr's end a :class:`CommandFailedError`'s message quotes."""


class OutputLimitExceededError(_CarriesOutput, SandboxError):
    """Output of an exec, or the content of a read, went over its cap.

    For exec the process tree was killed; ``stdout_bytes`` / ``stderr_bytes`` hold the
    output kept (at most ``limit`` bytes together). For read, ``path`` is set and no
    content is returned.
    """

    def __init__(
        self,
        what: str,
        limit: int,
        *,
        stdout_bytes: bytes = b"",
        stderr_bytes: bytes = b"",
        path: str | None = None,
    ):
        self.what = what
        self.limit = limit
        self.stdout_bytes = stdout_bytes
        self.stderr_bytes = stderr_bytes
        self.path = path
        super().__init__(f"{what} exceeded the limit of {limit} bytes")

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_output_limit,
            (self.what, self.limit, self.stdout_bytes, self.stderr_bytes, self.path),
        )


def _rebuild_output_limit(
    what: str, limit: int, out: bytes, err: bytes, path: str | None
) -> OutputLimitExceededError:
    return OutputLimitExceededError(what, limit, stdout_bytes=out, stderr_bytes=err, path=path)


class SandboxResourceError(_CarriesOutput, SandboxError):
    """A command was killed by a resource limit of the sandbox: today its memory limit (the
    sandbox's out-of-memory killer), where the backend can tell from outside the sandbox.

    ``limit`` names the limit (``"memory"``), ``setting`` its configured value (``"64MiB"``,
    ``None`` when not known), ``exit_code`` is the command's (137: SIGKILL), and
    ``stdout_bytes`` / ``stderr_bytes`` hold the output it wrote before. The sandbox itself
    stays usable. A process killed by anything else (``kill -9``) is a result, not this.
    """

    def __init__(
        self,
        limit: str,
        argv: list[str],
        exit_code: int,
        stdout_bytes: bytes = b"",
        stderr_bytes: bytes = b"",
        *,
        setting: str | None = None,
    ):
        self.limit = limit
        self.argv = argv
        self.exit_code = exit_code
        self.stdout_bytes = stdout_bytes
        self.stderr_bytes = stderr_bytes
        self.setting = setting
        value = f" ({limit}={setting})" if setting else ""
        super().__init__(
            f"command {_short_argv(argv)} was killed by the sandbox's {limit} limit{value}; "
            f"exit code {exit_code}"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (
            _rebuild_resource_error,
            (
                self.limit,
                self.argv,
                self.exit_code,
                self.stdout_bytes,
                self.stderr_bytes,
                self.setting,
            ),
        )


def _rebuild_resource_error(
    limit: str, argv: list[str], code: int, out: bytes, err: bytes, setting: str | None
) -> SandboxResourceError:
    return SandboxResourceError(limit, argv, code, out, err, setting=setting)


class SandboxUnavailableError(SandboxError):
    """The sandbox is dead, stopped, removed, closed or was never started.

    Not a missing file and not a flaky connection: retrying the same call on the same
    runtime will not help.
    """


class SandboxTransportError(SandboxError, ConnectionError):
    """The channel to a (possibly live) sandbox failed.

    Idempotent calls are retried with bounded backoff before this surfaces.
    """


class ChannelTamperedError(SandboxTransportError):
    """The persistent channel to the sandbox's agent carried something the agent did not
    send, or that it may not send (a frame failing authentication, an oversize frame,
    more data than the request allows): something inside the sandbox tampered with it.

    The request fails (it is not retried through the channel); the channel is closed for
    the sandbox's life and later calls take the backend's plain path
    (``runtime.channel_info.state == "distrusted"``, ``reason`` says why).
    """


class HostRouteError(SandboxError):
    """A port on the host cannot be made reachable from inside the sandbox by the route
    asked for (or by any route): the message says which routes this sandbox has and what to
    configure. Also raised by a route's ``check()`` once a channel relay died under it."""

    def __init__(self, message: str, *, via: str | None = None):
        super().__init__(message)
        self.via = via


class ShellSessionError(SandboxError):
    """A shell session (:meth:`runtimes.Runtime.shell`) is dead or could not start: its shell
    exited (``exit``, ``exec``, a signal), a command could not be interrupted and the session
    was killed, the sandbox lacks ``bash`` or ``python3``, or the sandbox went away. The
    message says which; ``reason`` holds it; every later ``run`` on the session raises it
    again. ``stdout_bytes`` / ``stderr_bytes`` hold what the command in flight printed."""

    def __init__(self, reason: str, stdout_bytes: bytes = b"", stderr_bytes: bytes = b""):
        super().__init__(reason)
        self.reason = reason
        self.stdout_bytes = stdout_bytes
        self.stderr_bytes = stderr_bytes

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.reason, self.stdout_bytes, self.stderr_bytes))


class BlockingCallInEventLoopError(SandboxError, RuntimeError):
    """A blocking :class:`~runtimes.sync.SyncRuntime` method was called from a thread that
    runs an event loop (an ``async def``, an ``on_output`` callback in the portal thread).

    Blocking there would stall that loop, or deadlock when the call needs it: use the async
    :class:`~runtimes.base.Runtime` (``open_runtime``) in async code, or call the facade from
    a worker thread (``anyio.to_thread.run_sync``). A ``RuntimeError`` like
    ``asyncio.run()``'s refusal of the same mistake."""


class ProvisioningError(SandboxError):
    """The sandbox could not be created: image missing, quota, authentication, bad host."""


class BuildContextError(ProvisioningError):
    """A Docker ``build`` context the host refuses to send to the engine: a symlink whose
    target is absolute or leaves the context, a device, FIFO or socket, a path that changed
    while it was read, or more than the context's size bound (``build.max_context``).
    ``path`` is the offending path relative to the context ("" for the context itself)."""

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.path))


class ListingLimitExceededError(SandboxError):
    """A listing (``list``, ``glob``) found more entries than its ``max_entries``, or its
    answer went over the config's ``read_limit`` in bytes. Nothing is returned; ``path``
    is what was listed, ``limit`` the bound and ``unit`` (``"entries"`` or ``"bytes"``)
    which one."""

    def __init__(self, path: str, limit: int, unit: str = "entries"):
        self.path = path
        self.limit = limit
        self.unit = unit
        hint = "max_entries" if unit == "entries" else "read_limit"
        super().__init__(
            f"listing of {path!r} exceeded the limit of {limit} {unit} (raise {hint} for more)"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.path, self.limit, self.unit))


class UnsafeArchiveMemberError(SandboxError):
    """A directory download's archive holds a member that would not stay inside the
    destination, or that the host refuses to create.

    The archive was produced inside the sandbox, which may be hostile: an absolute or
    ``..`` name, a symlink whose target is absolute or climbs out of the destination, a
    path through a symlink, a hard link to anything not extracted by this download, a
    device or FIFO, or more members (or deeper paths) than the extractor allows.
    ``member`` is the member's name as the archive spells it, ``reason`` says why, and
    ``hint`` (in the message too) which ``download()`` option would take the member
    (``skip_unsafe=True``, ``links="keep"``). Nothing was created or changed on the host:
    a failed download leaves its destination exactly as it was.
    """

    def __init__(self, member: str, reason: str, hint: str = ""):
        self.member = member
        self.reason = reason
        self.hint = hint
        super().__init__(f"unsafe archive member {member!r}: {reason}")

    def __str__(self) -> str:
        message = f"unsafe archive member {self.member!r}: {self.reason}"
        return f"{message} ({self.hint})" if self.hint else message

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.member, self.reason, self.hint))


_ERRNO_CLASSES: dict[int, type[_SandboxOSError]] = {
    _errno.ENOENT: SandboxFileNotFoundError,
    _errno.EISDIR: SandboxIsADirectoryError,
    _errno.ENOTDIR: SandboxNotADirectoryError,
    _errno.EACCES: SandboxPermissionError,
    _errno.EPERM: SandboxPermissionError,
    _errno.EROFS: SandboxPermissionError,
    _errno.EEXIST: SandboxFileExistsError,
    _errno.ENOTEMPTY: SandboxFileExistsError,
    _errno.ENOSPC: SandboxNoSpaceError,
    _errno.EDQUOT: SandboxNoSpaceError,
}


def error_for_errno(num: int | None, filename: str, detail: str | None = None) -> SandboxError:
    """Map an errno seen inside the sandbox to the typed error for ``filename``.

    An errno with no typed counterpart becomes a plain :class:`SandboxError` that still
    names the file and the errno, never a bare ``Exception``.
    """
    if num is not None and num in _ERRNO_CLASSES:
        return _ERRNO_CLASSES[num](filename, detail, code=num)
    text = _errno_message(num or 0)
    suffix = f" ({detail})" if detail else ""
    return SandboxError(f"[Errno {num}] {text}: {filename!r}{suffix}")


def argument_list_too_long(size: int) -> SandboxInvalidArgumentError:
    """An argv (with its environment) of ``size`` bytes over the kernel's limit (E2BIG)."""
    return SandboxInvalidArgumentError(
        f"argument list too long for the kernel ({size} bytes); "
        "pass large data through stdin or a file"
    )


def arg_too_long(size: int) -> SandboxInvalidArgumentError:
    """One argv item or environment entry of ``size`` bytes over the kernel's 128 KiB limit
    for a single string (MAX_ARG_STRLEN)."""
    return SandboxInvalidArgumentError(
        f"an argument or environment entry of {size} bytes is over the kernel's "
        "128 KiB limit for one string; pass large data through stdin or a file"
    )


def no_such_user(user: str | None, detail: str | None = None) -> SandboxUserNotFoundError:
    """``exec(user=...)`` named a user the sandbox does not have."""
    suffix = f" ({detail})" if detail else ""
    return SandboxUserNotFoundError(f"no such user in the sandbox: {user!r}{suffix}")


def cannot_run_as(program: str, user: str | None, reason: str) -> SandboxUserRefusedError:
    """``exec(user=...)`` cannot switch to ``user`` here; ``reason`` says why."""
    return SandboxUserRefusedError(program, f"cannot run as user {user!r}: {reason}")


def names_the_program(
    exc: SandboxFileNotFoundError | SandboxPermissionError,
    argv: Sequence[str],
    cwd: str | os.PathLike[str] | None,
    workdir: str,
) -> bool:
    """Whether ``exc``, raised by ``exec(argv, cwd=cwd)`` in a sandbox whose workdir is
    ``workdir``, is about the program ``argv[0]`` rather than the working directory.

    Both raise the same classes; only the filename tells them apart: the program's error
    names ``argv[0]`` exactly as given, the working directory's names it resolved against
    the workdir (``None``: the workdir itself). Basenames cannot: a missing cwd ``sub/ls``
    and a program ``ls`` share one.
    """
    if exc.filename != argv[0]:
        return False
    where = workdir if cwd is None else posixpath.join(workdir, os.fspath(cwd))
    return exc.filename not in (where, posixpath.normpath(where))


def _short_argv(argv: list[str], limit: int = 120) -> str:
    text = " ".join(argv)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return repr(text)
