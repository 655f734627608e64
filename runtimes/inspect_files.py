"""Files of an inspect sample read and written as the policy account
(:attr:`~runtimes.base.Runtime.policy_user`), by the account's own commands.

``Runtime.read``/``write`` act as the sandbox's default user (root on Docker and Modal). The
files inspect's provider reads and writes are the policy's: a path it planted (a symlink to
``/etc/shadow``, to a root-only reference answer, to ``/usr/bin/sh``) must get exactly the
access the policy has, so these run ``cat`` as the policy account and turn its error into
vf-sandbox's typed file errors (which are the builtins inspect's contract names).
"""

from __future__ import annotations

import errno
import os

from .base import Runtime
from .errors import (
    OutputLimitExceededError,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNoSpaceError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
)

__all__ = ["read_as", "write_as"]

# LC_ALL=C keeps the errors' wording parseable.
_C_LOCALE = {"LC_ALL": "C"}
_READ_SCRIPT = (
    'if [ -f "$1" ] && s=$(stat -L -c %s -- "$1" 2>/dev/null) && [ "$s" -gt "$2" ] 2>/dev/null;'
    ' then exit 27; fi; exec cat -- "$1"'
)
_TOO_LARGE = 27  # EFBIG: refused from its size, before any byte was read
# $1 is absolute (resolve_path): its parent is ${1%/*}, "" for a file in /
_WRITE_SCRIPT = 'd=${1%/*}; [ -d "${d:-/}" ] || mkdir -p -- "$d" || exit; exec cat > "$1"'
_READ_SLACK = 64 * 1024  # room for cat's error message beside a file read to the limit
_FileError = (
    type[SandboxFileNotFoundError]
    | type[SandboxIsADirectoryError]
    | type[SandboxNotADirectoryError]
    | type[SandboxPermissionError]
    | type[SandboxNoSpaceError]
)
_ERRORS: tuple[tuple[int, _FileError], ...] = (
    (errno.ENOENT, SandboxFileNotFoundError),
    (errno.EISDIR, SandboxIsADirectoryError),
    (errno.ENOTDIR, SandboxNotADirectoryError),
    (errno.EACCES, SandboxPermissionError),
    (errno.EPERM, SandboxPermissionError),
    (errno.EROFS, SandboxPermissionError),
    (errno.ENOSPC, SandboxNoSpaceError),
)


async def read_as(runtime: Runtime, user: str, file: str, limit: int) -> bytes:
    """``file``'s bytes as ``user`` reads them; over ``limit`` is refused.

    Raises:
        OutputLimitExceededError: larger than ``limit`` (vf-sandbox's).
        SandboxFileNotFoundError, SandboxIsADirectoryError, SandboxNotADirectoryError,
        SandboxPermissionError: as :meth:`Runtime.read`, for ``user``.
    """
    path = runtime.resolve_path(file)
    result = await runtime.exec(
        ["sh", "-c", _READ_SCRIPT, "sh", path, str(limit)],
        env=_C_LOCALE,
        user=user,
        output_limit=limit + _READ_SLACK,
    )
    if result.exit_code == _TOO_LARGE or len(result.stdout_bytes) > limit:
        raise OutputLimitExceededError(f"read of {path!r}", limit, path=path)
    if result.exit_code != 0:
        raise _file_error(path, user, "read", result.stderr)
    return result.stdout_bytes


async def write_as(runtime: Runtime, user: str, file: str, contents: str | bytes) -> None:
    """Write ``file`` (and its missing parents) as ``user``.

    Raises:
        SandboxIsADirectoryError, SandboxNotADirectoryError, SandboxPermissionError,
        SandboxFileNotFoundError, SandboxNoSpaceError: as :meth:`Runtime.write`, for ``user``.
    """
    path = runtime.resolve_path(file)
    result = await runtime.exec(
        ["sh", "-c", _WRITE_SCRIPT, "sh", path], stdin=contents, env=_C_LOCALE, user=user
    )
    if result.exit_code != 0:
        raise _file_error(path, user, "write", result.stderr)


def _file_error(path: str, user: str, operation: str, stderr: str) -> SandboxError:
    """The typed error a failed read or write of ``path`` as ``user`` reported."""
    said = stderr.strip().splitlines()[-1] if stderr.strip() else ""
    for code, kind in _ERRORS:
        if os.strerror(code) in said:
            return kind(path, f"as {user}", code=code)
    return SandboxError(f"{operation} of {path!r} as {user} failed: {said or 'no message'}")
