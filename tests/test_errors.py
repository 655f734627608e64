"""The error taxonomy: every typed error is also the matching builtin, with errno and filename."""

import errno
import pickle

import pytest

from runtimes import errors as E


@pytest.mark.parametrize(
    ("cls", "builtin", "code"),
    [
        (E.SandboxFileNotFoundError, FileNotFoundError, errno.ENOENT),
        (E.SandboxIsADirectoryError, IsADirectoryError, errno.EISDIR),
        (E.SandboxNotADirectoryError, NotADirectoryError, errno.ENOTDIR),
        (E.SandboxPermissionError, PermissionError, errno.EACCES),
    ],
)
def test_file_errors_are_builtins_with_errno_and_filename(cls, builtin, code) -> None:
    err = cls("/work/a b.txt")
    assert isinstance(err, builtin) and isinstance(err, E.SandboxError)
    assert err.errno == code
    assert err.filename == "/work/a b.txt"
    assert "/work/a b.txt" in str(err)
    with pytest.raises(builtin):
        raise err


def test_no_space_is_an_oserror_with_enospc_or_edquot() -> None:
    full = E.error_for_errno(errno.ENOSPC, "/work/big")
    assert type(full) is E.SandboxNoSpaceError
    assert isinstance(full, OSError) and not isinstance(full, PermissionError)
    assert (full.errno, full.filename) == (errno.ENOSPC, "/work/big")
    assert str(full) == "[Errno 28] No space left on device: '/work/big'"
    quota = E.error_for_errno(errno.EDQUOT, "/work/big")
    assert type(quota) is E.SandboxNoSpaceError and quota.errno == errno.EDQUOT
    again = pickle.loads(pickle.dumps(quota))
    assert type(again) is E.SandboxNoSpaceError and again.errno == errno.EDQUOT


def test_the_process_limit_is_a_blocking_io_error_naming_the_limit() -> None:
    err = E.SandboxProcessLimitError("make", "64")
    assert isinstance(err, BlockingIOError) and isinstance(err, E.SandboxError)
    assert (err.errno, err.filename, err.limit, err.setting) == (errno.EAGAIN, "make", "pids", "64")
    assert "process limit (pids_limit) of 64" in str(err) and "stop_processes()" in str(err)
    unknown = E.SandboxProcessLimitError("make")
    assert unknown.setting is None and "process limit (pids_limit): stop" in str(unknown)
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), again.setting, again.errno, str(again)) == (
        E.SandboxProcessLimitError,
        "64",
        errno.EAGAIN,
        str(err),
    )
    # EAGAIN on a file is not the process limit: only the exec paths raise this.
    assert type(E.error_for_errno(errno.EAGAIN, "/x")) is E.SandboxError


def test_other_errors_match_their_builtins() -> None:
    assert isinstance(E.ExecTimeoutError(["sleep", "9"], 1.0), TimeoutError)
    assert isinstance(E.SandboxTransportError("x"), ConnectionError)
    assert isinstance(E.SandboxInvalidArgumentError("x"), ValueError)
    for cls in (E.SandboxUnavailableError, E.ProvisioningError, E.OutputLimitExceededError):
        assert issubclass(cls, E.SandboxError)
    # The three errors callers must tell apart never share a branch.
    assert not issubclass(E.SandboxUnavailableError, FileNotFoundError | ConnectionError)
    assert not issubclass(E.SandboxFileNotFoundError, E.SandboxUnavailableError | ConnectionError)
    assert not issubclass(E.SandboxTransportError, FileNotFoundError | E.SandboxUnavailableError)


def test_error_for_errno_maps_and_never_returns_bare_exception() -> None:
    assert type(E.error_for_errno(errno.ENOENT, "/x")) is E.SandboxFileNotFoundError
    assert type(E.error_for_errno(errno.EPERM, "/x")) is E.SandboxPermissionError
    other = E.error_for_errno(errno.EIO, "/x", "disk on fire")
    assert type(other) is E.SandboxError
    assert "/x" in str(other) and "disk on fire" in str(other)


def test_errors_survive_pickling_with_their_payload() -> None:
    timeout = pickle.loads(pickle.dumps(E.ExecTimeoutError(["a"], 2.0, b"out", b"err")))
    assert (timeout.stdout_bytes, timeout.stderr_bytes, timeout.timeout) == (b"out", b"err", 2.0)
    limit = pickle.loads(pickle.dumps(E.OutputLimitExceededError("x", 5, stdout_bytes=b"12345")))
    assert limit.stdout_bytes == b"12345" and limit.limit == 5
    missing = pickle.loads(pickle.dumps(E.SandboxFileNotFoundError("/p")))
    assert isinstance(missing, FileNotFoundError) and missing.filename == "/p"
