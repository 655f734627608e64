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
