"""The one exec wrapper of the plain paths (``runtimes/scripts/exec.sh``): its arguments,
its report line, and the typed errors a report maps to.

Docker, SSH and Modal run every command of their plain path as
``sh -c <exec.sh> sh <arguments> <argv>`` (:func:`wrapper_argv`). Before any output of
the command the wrapper writes exactly one line on stderr: ``vf-sandbox-<nonce>:ok:<pgid>``
once the command runs in its own process group, or ``vf-sandbox-<nonce>:<errno>:<what>``
when nothing ran (:func:`parse_report`, read incrementally by :class:`ReportReader`).
:func:`report_error` is the one mapping from ``(errno, what)`` to the typed errors; the
channel agent reports its exec failures as the same pair.
"""

from __future__ import annotations

import errno as _errno
import secrets
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from . import scripts
from .arguments import text_bytes
from .errors import (
    SandboxError,
    SandboxFileNotFoundError,
    SandboxPermissionError,
    arg_too_long,
    argument_list_too_long,
    cannot_run_as,
    error_for_errno,
    no_such_user,
)
from .models import ExecRequest

__all__ = [
    "ARG_MAX",
    "CONTROL_DIR",
    "MAX_ARG_STRLEN",
    "PREAMBLE_LIMIT",
    "REPORT_WHATS",
    "WRAPPER_FAILED",
    "LaunchMode",
    "ReportReader",
    "UserSwitch",
    "WrapperReport",
    "argv_size",
    "check_argv_size",
    "env_pieces",
    "new_nonce",
    "parse_report",
    "report_error",
    "spool_argv",
    "wrapper_argv",
]

LaunchMode = Literal["exec", "wait", "track"]
"""``exec``: the wrapper becomes the command (Docker: docker exec made it a session leader,
so pid == pgid, and the exit status is the program's). ``wait``: the command runs under
``setsid`` in a session of its own; the wrapper waits and exits with its status (128+N for
a death by signal N); the report can come before ``setsid()`` has run, so a kill signals
the reported pid, then its group. ``track``: ``wait``, plus the group id in
``CONTROL_DIR/<nonce>.pgid`` and the cancel marker ``CONTROL_DIR/<nonce>.cancel`` (Modal's
kill protocol)."""

UserSwitch = Literal["setpriv", "runuser"]
"""How root switches to ``user``: ``setpriv`` (falling back to ``runuser``) keeps the
environment as it is; ``runuser`` also sets ``HOME``, ``SHELL``, ``USER`` and ``LOGNAME``."""

CONTROL_DIR = "/tmp/.vf-sandbox"
"""Where ``track`` mode keeps ``<nonce>.pgid`` and ``<nonce>.cancel`` (fixed in exec.sh)."""

WRAPPER_FAILED = 255
"""The wrapper's exit status after an ``<errno>:<what>`` report (nothing ran)."""

REPORT_WHATS = frozenset({"cwd", "prog", "user", "argv", "setsid"})
"""What a failure report can name: the working directory, the program, the user, the
spooled argument file, the ``setsid`` tool."""

MAX_ARG_STRLEN = 128 * 1024
"""Linux's limit on one argv item or environment entry, in bytes with its NUL."""

ARG_MAX = 2 * 1024 * 1024
"""The usual limit on argv plus environment together (a quarter of an 8 MiB stack)."""

_PREFIX = b"vf-sandbox-"
_FIXED = 8
"""Arguments of exec.sh before the environment's count and pieces."""
_SPOOL = 6
_SHELL_HEAD = 4
"""``sh -c <script> sh`` before the wrapper's own arguments."""
_REPORT_MAX = 64
"""Bytes a report line can have after its ``vf-sandbox-<nonce>:`` tag."""
PREAMBLE_LIMIT = 64 * 1024
"""Bytes of stderr a :class:`ReportReader` waits through for the report (login noise)."""
_IDENTIFIER_START = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")
_IDENTIFIER = _IDENTIFIER_START | frozenset("0123456789")
_NONCE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")


# ---------------------------------------------------------------------- arguments


def new_nonce() -> str:
    """A fresh nonce for one exec: it names the report line and the control files."""
    return "vf" + secrets.token_hex(12)


def wrapper_argv(
    request: ExecRequest,
    nonce: str,
    *,
    mode: LaunchMode,
    user: str | None = None,
    switch: UserSwitch = "setpriv",
    tools: Sequence[str] = (),
    shell: str = "sh",
) -> list[str]:
    """The argv that runs ``request`` through the wrapper: ``shell -c <exec.sh> sh ...``.

    ``user``: switch to this user (``None``: run as the wrapper runs; Docker's engine
    switches itself). ``tools``: directories holding setsid/setpriv/runuser/env/id (SSH:
    those found at start; empty: the usual system directories). The caller's ``env`` is
    carried in the arguments and applied last, so the wrapper runs with the sandbox's own
    environment: pass no environment to the engine or SDK.

    Raises:
        ValueError: a nonce that is not ``[A-Za-z0-9]+`` (a programming error).
    """
    if not nonce or not set(nonce) <= _NONCE:
        raise ValueError(f"a wrapper nonce is [A-Za-z0-9]+, got {nonce!r}")
    env = request.env
    search = f"PATH={env['PATH']}" if "PATH" in env else ""
    pieces = env_pieces(env)
    fixed = [nonce, request.cwd, user or "", switch, ":".join(tools), search, "", mode]
    return [
        shell,
        "-c",
        scripts.load("exec"),
        "sh",
        *fixed,
        str(len(pieces)),
        *pieces,
        *request.argv,
    ]


def spool_argv(argv: Sequence[str], path: str) -> tuple[list[str], bytes]:
    """For a wrapper argv too big for the transport: the short argv that has the wrapper
    read its arguments from ``path``, and the bytes to write there first (the wrapper
    removes the file once read).
    """
    head, args = list(argv[:_SHELL_HEAD]), list(argv[_SHELL_HEAD:])
    content = "set -- " + " ".join(shlex.quote(arg) for arg in args) + "\n"
    short = args[:_FIXED]
    short[_SPOOL] = path
    return [*head, *short, "0"], text_bytes(content, "the wrapper's arguments")


def env_pieces(env: Mapping[str, str]) -> list[str]:
    """The caller's environment as pieces of shell code the wrapper runs just before the
    command, one argument each (so no argument is bigger than one variable): ``export``
    for a shell identifier, ``env(1)`` in front of the command for any other name."""
    pieces = [
        f'set -- {shlex.quote(f"{n}={v}")} "$@"' for n, v in env.items() if not _is_identifier(n)
    ]
    if pieces:
        pieces.append('set -- "$__vf_env" -- "$@"')
    pieces += [f"export {n}={shlex.quote(v)}" for n, v in env.items() if _is_identifier(n)]
    return pieces


def _is_identifier(name: str) -> bool:
    return bool(name) and name[0] in _IDENTIFIER_START and set(name) <= _IDENTIFIER


def argv_size(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """Bytes the kernel counts for ``argv`` (and ``env``): each string with its NUL."""
    size = sum(len(text_bytes(arg, "an argv item")) + 1 for arg in argv)
    for name, value in (env or {}).items():
        size += len(text_bytes(f"{name}={value}", "an environment entry")) + 1
    return size


def check_argv_size(argv: Sequence[str], env: Mapping[str, str]) -> None:
    """Refuse what the kernel would refuse with E2BIG, before anything runs.

    Raises:
        SandboxInvalidArgumentError: one string over 128 KiB (MAX_ARG_STRLEN), or argv and
            environment together over 2 MiB (ARG_MAX).
    """
    sizes = [argv_size([arg]) for arg in argv]
    sizes += [argv_size([], {name: value}) for name, value in env.items()]
    if max(sizes, default=0) > MAX_ARG_STRLEN:
        raise arg_too_long(max(sizes) - 1)
    if sum(sizes) > ARG_MAX:
        raise argument_list_too_long(sum(sizes))


# ---------------------------------------------------------------------- the report


@dataclass(frozen=True)
class WrapperReport:
    """The wrapper's one line: the command runs in process group ``pgid`` (``ok``), or
    nothing ran because of ``errno`` on ``what`` (one of :data:`REPORT_WHATS`)."""

    pgid: int | None = None
    errno: int = 0
    what: str = ""

    @property
    def ok(self) -> bool:
        return self.pgid is not None

    def error(self, request: ExecRequest, *, where: str | None = None) -> SandboxError:
        """The typed error of a failure report (see :func:`report_error`)."""
        return report_error(self.errno, self.what, request, where=where)


def parse_report(line: bytes, nonce: str) -> WrapperReport | None:
    """The report in ``line`` (with or without its newline), ``None`` if ``line`` is not
    exactly a report of the exec with this ``nonce``."""
    tag = _PREFIX + nonce.encode("ascii") + b":"
    line = line.removesuffix(b"\n")
    if not line.startswith(tag):
        return None
    head, sep, tail = line[len(tag) :].partition(b":")
    if not sep:
        return None
    if head == b"ok":
        if tail.isdigit() and len(tail) <= 10 and int(tail) > 0:
            return WrapperReport(pgid=int(tail))
        return None
    what = tail.decode("ascii", "replace")
    if head.isdigit() and len(head) <= 3 and what in REPORT_WHATS:
        return WrapperReport(errno=int(head), what=what)
    return None


class ReportReader:
    """Finds the report in the wrapper's stderr as it arrives, for any transport.

    :meth:`feed` takes stderr chunks and returns the command's stderr among them (what
    follows the report line). Until the report is complete nothing is returned; bytes
    before it (a login shell's noise) become :attr:`preamble`. A line naming another nonce,
    or not a valid report, is not the report. After ``limit`` bytes without a report the
    reader gives up (:attr:`gave_up`) and drops what follows.
    """

    def __init__(self, nonce: str, limit: int = PREAMBLE_LIMIT) -> None:
        self._nonce = nonce
        self._tag = _PREFIX + nonce.encode("ascii") + b":"
        self._limit = limit
        self._held = bytearray()
        self._scan = 0
        self.report: WrapperReport | None = None
        self.preamble = b""
        self.gave_up = False

    @property
    def done(self) -> bool:
        """Whether the report is in (:attr:`report`)."""
        return self.report is not None

    @property
    def held(self) -> bytes:
        """What came while no report did (for the error when the stream ends first)."""
        return bytes(self._held)

    def feed(self, chunk: bytes) -> bytes:
        """Take a stderr chunk; return the command's stderr it holds (maybe empty)."""
        if self.report is not None:
            return chunk
        if self.gave_up:
            return b""
        self._held += chunk
        rest = self._find_report()
        if rest is None and len(self._held) > self._limit:
            self.gave_up = True
        return rest or b""

    def _find_report(self) -> bytes | None:
        held = self._held
        while True:
            start = held.find(self._tag, self._scan)
            if start < 0:
                self._scan = max(self._scan, len(held) - len(self._tag) + 1)
                return None
            end = held.find(b"\n", start, start + len(self._tag) + _REPORT_MAX + 1)
            if end < 0 and len(held) - start <= len(self._tag) + _REPORT_MAX:
                self._scan = start  # the line is not complete yet
                return None
            report = None if end < 0 else parse_report(bytes(held[start:end]), self._nonce)
            if report is None:
                self._scan = start + 1  # not the report: part of the preamble
                continue
            self.report = report
            self.preamble = bytes(held[:start])
            rest = bytes(held[end + 1 :])
            held.clear()
            return rest


# ---------------------------------------------------------------------- typed errors


def report_error(
    num: int,
    what: str,
    request: ExecRequest,
    *,
    detail: str | None = None,
    where: str | None = None,
) -> SandboxError:
    """The typed error for a command that did not start: ``num`` (an errno) on ``what``.

    ``detail``: the reporter's own words (the channel agent's strerror), ``where``: the
    runtime's description, for the errors that name no file.

    Returns:
        SandboxFileNotFoundError / SandboxNotADirectoryError / SandboxPermissionError for
        the working directory or the program; SandboxInvalidArgumentError for an unknown
        user or an argv over the kernel's limit; SandboxPermissionError when the user
        cannot be switched to; SandboxError for anything else.
    """
    program = request.argv[0]
    prefix = f"{where}: " if where else ""
    if what == "cwd":
        return error_for_errno(num, request.cwd, "working directory")
    if what == "prog":
        return _program_error(num, request, detail)
    if what == "user":
        return _user_error(num, program, request.user, detail)
    if what == "argv":
        return SandboxError(f"{prefix}the spooled argv could not be read")
    if what == "setsid":
        return SandboxError(f"{prefix}setsid (util-linux) is not installed in the sandbox")
    said = f": {detail}" if detail else ""
    return SandboxError(f"{prefix}exec of {program!r} failed ({what}, errno {num}){said}")


def _program_error(num: int, request: ExecRequest, detail: str | None) -> SandboxError:
    program = request.argv[0]
    if num == _errno.ENOENT:
        where = "" if "/" in program else " in PATH"
        return SandboxFileNotFoundError(program, f"program not found{where}")
    if num in (_errno.EACCES, _errno.EPERM):
        return SandboxPermissionError(program, "not executable")
    if num == _errno.EISDIR:
        return SandboxPermissionError(program, "is a directory, not a program")
    if num == _errno.E2BIG:
        return argument_list_too_long(argv_size(request.argv))
    return error_for_errno(num, program, detail or None)


def _user_error(num: int, program: str, user: str | None, detail: str | None) -> SandboxError:
    if num == _errno.EACCES:
        return cannot_run_as(program, user, "the sandbox user is not root")
    if num == _errno.EOPNOTSUPP:
        return cannot_run_as(program, user, "no setpriv or runuser")
    return no_such_user(user, detail)
