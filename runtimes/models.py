"""Request and response models, kept apart from any transport."""

from __future__ import annotations

from collections.abc import AsyncIterable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

KiB = 1024
MiB = 1024 * KiB

DEFAULT_OUTPUT_LIMIT = 64 * MiB
"""Default cap on stdout + stderr of one exec call."""

DEFAULT_READ_LIMIT = 256 * MiB
"""Default cap on the size of one ``read``."""


@dataclass(frozen=True)
class ExecRequest:
    """One command, fully resolved by :class:`~runtimes.base.Runtime` before a backend sees it.

    ``cwd`` is absolute; ``env`` is only what the caller (and the config) asked for, the
    backend adds its own base environment; ``stdin`` of ``None`` means an empty stdin
    that is closed at once, an async iterable is written chunk by chunk as it yields
    (:func:`runtimes.stdin_feed.feed_stdin`), then closed.
    """

    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]
    stdin: StdinSource | None
    user: str | None
    timeout: float | None
    output_limit: int


@dataclass(frozen=True)
class ExecResult:
    """What a finished command produced.

    ``exit_code`` is returned as the process gave it; a death by signal N is ``128 + N``.
    ``stdout`` / ``stderr`` are UTF-8 with invalid bytes replaced; the ``*_bytes``
    attributes are exact.
    """

    exit_code: int
    stdout_bytes: bytes
    stderr_bytes: bytes
    duration: float = 0.0

    @property
    def stdout(self) -> str:
        return self.stdout_bytes.decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return self.stderr_bytes.decode("utf-8", "replace")

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def __repr__(self) -> str:
        return (
            f"ExecResult(exit_code={self.exit_code}, stdout={_preview(self.stdout_bytes)}, "
            f"stderr={_preview(self.stderr_bytes)}, duration={self.duration:.3f})"
        )


REPR_HEAD = 160
"""Characters of a stream's text an :class:`ExecResult`'s repr shows from the start."""
REPR_TAIL = 80
"""Characters it shows from the end (where a traceback's last line or an exit message is)."""


def _preview(data: bytes) -> str:
    """The text a user reads from ``.stdout`` / ``.stderr``, its middle cut when long."""
    text = data.decode("utf-8", "replace")
    if len(text) <= REPR_HEAD + REPR_TAIL:
        return repr(text)
    cut = len(text) - REPR_HEAD - REPR_TAIL
    return f"{text[:REPR_HEAD]!r} [... {cut} chars ...] {text[-REPR_TAIL:]!r}"


Stream = Literal["stdout", "stderr"]

StdinSource = bytes | AsyncIterable[bytes]
"""What a command's stdin can be: all of it at once, or chunks written as they come."""


@dataclass
class OutputSink:
    """Collects the output of one exec under a shared cap.

    Backends call :meth:`feed` as output arrives. When the cap is crossed the sink keeps
    exactly ``limit`` bytes in total, marks itself ``overflowed`` and calls
    ``on_overflow`` (the runtime uses it to cancel the call, which makes the backend
    kill the process tree). ``feed`` then returns ``False``: the backend may stop reading.

    ``on_output``, when set, sees every kept chunk as it arrives, in order. If it raises,
    the sink keeps the exception in ``failure`` and stops the call the same way
    (:meth:`fail`: also how a failing stdin source stops it). With ``keep=False`` chunks
    are counted against the cap and passed on, but not kept: ``stdout``/``stderr`` stay
    empty, so a stream of any length costs constant memory.
    """

    limit: int
    on_overflow: Callable[[], None] = lambda: None
    on_output: Callable[[Stream, bytes], object] | None = None
    keep: bool = True
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    overflowed: bool = False
    failure: BaseException | None = None
    on_exit: Callable[[], None] = lambda: None
    pid: int | None = None
    """The command's pid (and process group) in the sandbox, once the backend knows it."""
    exit_code: int | None = None
    """The command's own exit status once the backend saw it exit, possibly before its
    output ended (background processes may still hold its pipes)."""
    detached: bool = False
    """Set once the caller stopped waiting (the grace after the exit passed): later output is
    read and discarded, so the processes still writing it neither block nor die of SIGPIPE."""
    _counted: int = 0

    def exited(self, code: int) -> None:
        """The backend saw the command itself exit with ``code`` (``128 + N`` for a death
        by signal N); its output may go on until every process holding the pipes closed
        them (``docs/processes.md``)."""
        if self.exit_code is None:
            self.exit_code = code
            self.on_exit()

    def detach(self) -> None:
        """Stop keeping and passing on output: the caller has returned."""
        self.detached = True

    @property
    def size(self) -> int:
        """Bytes taken so far (kept or not), stdout and stderr together."""
        return self._counted

    def fail(self, exc: BaseException) -> None:
        """Stop the call because of ``exc`` (re-raised by the runtime once the tree is
        killed); the first failure wins."""
        if self.failure is None:
            self.failure = exc
        self.on_overflow()

    def feed(self, stream: Stream, data: bytes) -> bool:
        if self.detached:
            return True
        if self.overflowed or self.failure is not None:
            return False
        room = self.limit - self._counted
        kept = data if len(data) <= room else data[:room]
        self._counted += len(kept)
        if self.keep:
            (self.stdout if stream == "stdout" else self.stderr).extend(kept)
        if kept and not self._passed_on(stream, kept):
            return False
        if len(data) <= room:
            return True
        self.overflowed = True
        self.on_overflow()
        return False

    def _passed_on(self, stream: Stream, data: bytes) -> bool:
        if self.on_output is None:
            return True
        try:
            self.on_output(stream, data)
        except Exception as exc:  # noqa: BLE001 -- the caller's error, re-raised after the kill
            self.fail(exc)
            return False
        return True


@dataclass(frozen=True)
class SandboxInfo:
    """A sandbox as seen by a sweep: enough to decide whether it leaked and to remove it."""

    backend: str
    id: str
    labels: Mapping[str, str]
    state: str = "unknown"
    created: str | None = None
