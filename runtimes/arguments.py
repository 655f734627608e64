"""Checking what a caller hands a runtime, before any backend sees it: sandbox paths, argv,
environment, stdin, timeouts and caps. Every refusal is a
:class:`~runtimes.errors.SandboxInvalidArgumentError` naming what is wrong."""

from __future__ import annotations

import os
import posixpath
from collections.abc import AsyncIterable, Callable, Mapping, Sequence

from .errors import SandboxInvalidArgumentError
from .models import ExecRequest, StdinSource

__all__ = ["check_local_path", "exec_request", "resolve_sandbox_path", "text_bytes"]

PathLike = str | os.PathLike[str]

NAME_MAX = 255
PATH_MAX = 4095
"""Linux's limits on one path component and on a whole path, in bytes."""


def text_bytes(text: str, what: str) -> bytes:
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


def resolve_sandbox_path(path: PathLike, workdir: str) -> str:
    """An absolute sandbox path: relative ones are joined to ``workdir``.

    Raises:
        SandboxInvalidArgumentError: not text, empty, containing a NUL byte or a lone
            surrogate that stands for no byte, a component over NAME_MAX or the whole over
            PATH_MAX bytes.
    """
    text = os.fspath(path)
    if not isinstance(text, str):
        raise SandboxInvalidArgumentError(f"sandbox paths are text, got {type(text).__name__}")
    if not text:
        raise SandboxInvalidArgumentError("empty path")
    if "\x00" in text:
        raise SandboxInvalidArgumentError(f"path contains a NUL byte: {text!r}")
    resolved = text if text.startswith("/") else posixpath.join(workdir, text)
    _check_path_length(resolved)
    return resolved


def _check_path_length(path: str) -> None:
    encoded = text_bytes(path, "a path")
    shown = path if len(path) <= 80 else f"{path[:80]}... ({len(encoded)} bytes)"
    if len(encoded) > PATH_MAX:
        raise SandboxInvalidArgumentError(
            f"path longer than the kernel's {PATH_MAX}-byte limit (PATH_MAX): {shown!r}"
        )
    if max(len(part) for part in encoded.split(b"/")) > NAME_MAX:
        raise SandboxInvalidArgumentError(
            f"a path component is longer than the kernel's {NAME_MAX}-byte limit "
            f"(NAME_MAX): {shown!r}"
        )


def check_local_path(local: PathLike) -> None:
    """Raises: SandboxInvalidArgumentError: the host path contains a NUL byte."""
    if "\x00" in os.fspath(local):
        raise SandboxInvalidArgumentError(f"local path contains a NUL byte: {local!r}")


def exec_request(
    argv: Sequence[str],
    *,
    cwd: Callable[[], str],
    base_env: Mapping[str, str],
    env: Mapping[str, str] | None,
    stdin: bytes | str | AsyncIterable[bytes] | None,
    user: str | None,
    timeout: float | None,
    output_limit: int,
) -> ExecRequest:
    """A checked :class:`ExecRequest`; ``cwd`` resolves the working directory (called
    last), ``base_env`` (the config's variables and the runtime's mark) is overridden by ``env``.

    Raises:
        SandboxInvalidArgumentError: see :meth:`runtimes.base.Runtime.exec`.
    """
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
            raise SandboxInvalidArgumentError(f"argv items must be str, got {type(arg).__name__}")
        if "\x00" in arg:
            raise SandboxInvalidArgumentError(f"argv item contains a NUL byte: {arg[:60]!r}")
        text_bytes(arg, "an argv item")
    merged_env = dict(base_env)
    for key, value in (env or {}).items():
        if not key or "=" in key or "\x00" in key or "\x00" in value:
            raise SandboxInvalidArgumentError(f"invalid environment variable {key!r}")
        text_bytes(key, "an environment variable's name")
        text_bytes(value, f"the value of environment variable {key!r}")
        merged_env[key] = value
    if timeout is not None and timeout <= 0:
        raise SandboxInvalidArgumentError(f"timeout must be > 0, got {timeout}")
    if output_limit <= 0:
        raise SandboxInvalidArgumentError(f"output_limit must be > 0, got {output_limit}")
    data = _stdin_source(stdin)
    return ExecRequest(
        argv=args,
        cwd=cwd(),
        env=merged_env,
        stdin=data,
        user=user,
        timeout=timeout,
        output_limit=output_limit,
    )


def _stdin_source(stdin: bytes | str | AsyncIterable[bytes] | None) -> StdinSource | None:
    if stdin is None or isinstance(stdin, bytes):
        return stdin
    if isinstance(stdin, str):
        return text_bytes(stdin, "stdin")
    if isinstance(stdin, bytearray | memoryview):
        return bytes(stdin)
    if isinstance(stdin, AsyncIterable):
        return stdin
    raise SandboxInvalidArgumentError(
        f"stdin must be bytes, str or an async iterable of bytes, got {type(stdin).__name__}"
    )
