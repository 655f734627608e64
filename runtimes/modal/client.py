"""Calling the ``modal`` SDK: from asyncio or trio, its exceptions mapped to typed errors.

Modal's exception table (:func:`modal_table`) says what each SDK exception means; it is
applied at the boundary of every call: :meth:`SdkBackend._modal_calls` for a sandbox's calls
(:class:`SdkBackend` holds the sandbox handle; the exec and file halves of the backend build
on it) and :func:`sweep_calls` for the host-side ones (listing, cleanup, snapshot records).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ..backend import Backend, bookkeeping_request
from ..errors import (
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
    error_for_errno,
)
from ..models import ExecRequest, OutputSink
from ..scripts import load
from .config import ModalConfig

log = logging.getLogger("runtimes.modal")

KILL_TIMEOUT = 30.0
"""How long the process-tree kill may take before it is given up (and logged)."""

TRANSPORT_ATTEMPTS = 3
"""Attempts for idempotent calls (file operations, liveness) when the channel fails."""

_DIAGNOSE_SCRIPT = load("diagnose", "runtimes.modal.scripts")


def run_bounded_at_exit(fn: Callable[[], None], what: str, thread_name: str) -> None:
    """Run a blocking SDK call in a daemon thread for at most :data:`KILL_TIMEOUT` seconds
    (exit backstops: a hung Modal call must not hold the interpreter's exit).

    Raises:
        SandboxError: ``fn`` raised, or did not return in time (``what`` names the call).
    """
    failures: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported below, from the calling thread
            failures.append(exc)

    worker = threading.Thread(target=run, name=thread_name, daemon=True)
    worker.start()
    worker.join(KILL_TIMEOUT)
    if worker.is_alive() or failures:
        reason = repr(failures[0]) if failures else f"no answer in {KILL_TIMEOUT:g}s"
        raise SandboxError(f"{what} failed: {reason}")


def modal_sdk() -> Any:
    """The ``modal`` SDK module. Tests replace this function to inject a fake SDK.

    Raises:
        ProvisioningError: the SDK is not installed.
    """
    try:
        import modal
    except ImportError as exc:
        raise ProvisioningError(
            "the modal runtime needs the modal SDK: pip install 'vf-sandbox[modal]'"
        ) from exc
    return modal


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def sdk_call(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Call a (synchronicity-wrapped) SDK function from asyncio or trio."""
    if _on_asyncio():
        return await fn.aio(*args, **kwargs)
    return await anyio.to_thread.run_sync(
        functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
    )


async def sdk_collect(gen_fn: Any, /, *args: Any, **kwargs: Any) -> list[Any]:
    """All items of an SDK async generator (``Sandbox.list``)."""
    if _on_asyncio():
        return [item async for item in gen_fn.aio(*args, **kwargs)]
    return await anyio.to_thread.run_sync(
        lambda: list(gen_fn(*args, **kwargs)), abandon_on_cancel=True
    )


async def pump_output(stream: Any, feed: Callable[[bytes], bool]) -> None:
    """Hand one output stream of a process to ``feed`` (on the event loop's thread) until
    EOF or ``feed`` says the sink is full."""
    if _on_asyncio():
        async for chunk in stream:
            if chunk and not feed(bytes(chunk)):
                return
        return

    def blocking() -> None:
        try:
            for chunk in stream:
                if chunk and not anyio.from_thread.run_sync(feed, bytes(chunk)):
                    return
        except anyio.RunFinishedError:
            return  # the caller's event loop is gone; nobody wants this output any more

    await anyio.to_thread.run_sync(blocking, abandon_on_cancel=True)


def exception_module() -> Any:
    return modal_sdk().exception


class Meaning(enum.Enum):
    """What an exception of the SDK says (the rows of :func:`modal_table`)."""

    TOO_LARGE = "too large"
    """The filesystem API will not read a file this big: read it through exec."""
    FILESYSTEM = "filesystem"
    """An untyped filesystem error: its errno is found with a shell probe on the path."""
    GONE = "gone"
    """The sandbox is no longer running."""
    CONFLICT = "conflict"
    """"Sandbox already finished", or a real conflict: gone if the sandbox has stopped."""
    REFUSED = "refused"
    """Modal refused the credentials or the permission: the sandbox is out of reach."""
    NOT_FOUND = "not found"
    """The filesystem API's answer to every control-plane failure ("The Sandbox is
    unavailable"): gone if the sandbox has stopped, else a failed channel."""
    TRANSPORT = "transport"
    """The channel to Modal failed (retried where the call is idempotent)."""
    INVALID = "invalid"
    """Modal refused the arguments."""


def modal_table() -> tuple[tuple[type[BaseException], Meaning | int], ...]:
    """Modal's exception table, first match wins: an SDK exception class and what it means
    (an ``int``: the errno of a typed filesystem error)."""
    errors = exception_module()
    transport: list[type[BaseException]] = [
        errors.ServiceError,
        errors.ConnectionError,
        errors.InternalError,
        OSError,  # TimeoutError too
    ]
    try:
        from grpclib.exceptions import StreamTerminatedError
    except ImportError:  # pragma: no cover - grpclib comes with modal
        pass
    else:
        transport.append(StreamTerminatedError)
    return (
        (errors.SandboxFilesystemNotFoundError, errno.ENOENT),
        (errors.SandboxFilesystemIsADirectoryError, errno.EISDIR),
        (errors.SandboxFilesystemNotADirectoryError, errno.ENOTDIR),
        (errors.SandboxFilesystemPermissionError, errno.EACCES),
        (errors.SandboxFilesystemPathAlreadyExistsError, errno.EEXIST),
        (errors.SandboxFilesystemDirectoryNotEmptyError, errno.ENOTEMPTY),
        (errors.SandboxFilesystemFileTooLargeError, Meaning.TOO_LARGE),
        (errors.SandboxFilesystemError, Meaning.FILESYSTEM),
        (errors.ClientClosed, Meaning.GONE),
        (errors.SandboxTerminatedError, Meaning.GONE),
        (errors.SandboxTimeoutError, Meaning.GONE),
        (errors.ConflictError, Meaning.CONFLICT),
        (errors.AuthError, Meaning.REFUSED),
        (errors.PermissionDeniedError, Meaning.REFUSED),
        (errors.NotFoundError, Meaning.NOT_FOUND),
        *((cls, Meaning.TRANSPORT) for cls in transport),
        (errors.InvalidError, Meaning.INVALID),
    )


def meaning(exc: BaseException) -> Meaning | int | None:
    """What ``exc`` means by :func:`modal_table` (``None``: not the SDK's, or one of this
    suite's errors already)."""
    if isinstance(exc, SandboxError):
        return None
    for raised, said in modal_table():
        if isinstance(exc, raised):
            return said
    return None


def stopped_errors() -> tuple[type[BaseException], ...]:
    """What a ``poll`` or ``terminate`` of a sandbox that has stopped raises: Modal no longer
    knows it, the client closed, or "Sandbox already finished"."""
    errors = exception_module()
    return (errors.NotFoundError, errors.ClientClosed, errors.ConflictError)


def is_transport_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the channel to Modal failed."""
    return meaning(exc) is Meaning.TRANSPORT


@contextlib.contextmanager
def sweep_calls(what: str) -> Iterator[None]:
    """The boundary of a host-side SDK call (listing, cleanup, snapshot records): what it
    raises is ``SandboxTransportError`` when the channel to Modal failed, else
    ``SandboxError``, both saying ``modal: cannot <what>``."""
    try:
        yield
    except Exception as exc:
        kind = SandboxTransportError if is_transport_error(exc) else SandboxError
        raise kind(f"modal: cannot {what}: {type(exc).__name__}: {exc}") from exc


class TooLargeForFilesystemApi(SandboxError):
    """The filesystem API refused a read as too large: read it through exec instead."""


class SdkBackend(Backend):
    """The part of :class:`~runtimes.modal.ModalBackend` that holds the sandbox handle and
    calls the SDK: retries of idempotent calls and the mapping of its exceptions."""

    config: ModalConfig
    _sandbox: Any
    _sandbox_id: str | None
    _workdir: str | None

    def _transport_retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception_type(SandboxTransportError),
            stop=stop_after_attempt(TRANSPORT_ATTEMPTS),
            wait=wait_exponential(multiplier=0.2, max=2.0),
            sleep=anyio.sleep,
            reraise=True,
        )

    def _live_sandbox(self) -> Any:
        if self._sandbox is None:
            raise SandboxUnavailableError(f"{self.describe()} is closed")
        return self._sandbox

    async def _finished(self) -> bool:
        """Whether the sandbox has stopped (``poll``); ``False`` when that cannot be told."""
        sandbox = self._sandbox
        if sandbox is None:
            return True
        try:
            return await sdk_call(sandbox.poll) is not None
        except stopped_errors():
            return True
        except Exception as exc:  # noqa: BLE001 - a probe: the caller reports the original error
            log.debug("modal: poll of %s failed: %r", self._sandbox_id, exc)
            return False

    async def _translate(self, exc: Exception, operation: str, path: str | None) -> SandboxError:
        """The typed error for an exception the SDK raised during ``operation``, by
        :func:`modal_table`."""
        if isinstance(exc, SandboxError):
            return exc
        said = meaning(exc)
        if isinstance(said, int):
            return error_for_errno(said, path or operation, str(exc) or None)
        gone = SandboxUnavailableError(f"{self.describe()} is no longer running: {exc}")
        if said is Meaning.TOO_LARGE:
            return TooLargeForFilesystemApi(str(exc))
        if said is Meaning.FILESYSTEM:
            return await self._diagnosed(exc, operation, path)
        if said is Meaning.GONE:
            return gone
        if said is Meaning.CONFLICT:
            if await self._finished():
                return gone
            return SandboxError(f"{self.describe()}: Modal refused {operation}: {exc}")
        if said is Meaning.REFUSED:
            return SandboxUnavailableError(
                f"{self.describe()}: Modal refused {operation}: {type(exc).__name__}: {exc}"
            )
        # NotFoundError alone cannot tell a dead sandbox from a dropped connection: ask
        # Modal whether it still runs.
        if said is Meaning.NOT_FOUND or said is Meaning.TRANSPORT:
            if await self._finished():
                return gone
            return SandboxTransportError(
                f"{self.describe()}: {operation} failed on the channel to Modal: "
                f"{type(exc).__name__}: {exc}"
            )
        if said is Meaning.INVALID:
            return SandboxInvalidArgumentError(f"Modal refused {operation}: {exc}")
        return SandboxError(f"{self.describe()}: {operation} failed: {type(exc).__name__}: {exc}")

    async def _diagnosed(self, exc: Exception, operation: str, path: str | None) -> SandboxError:
        """An untyped filesystem error: find the errno with a shell probe on the path."""
        if path is None:
            return SandboxError(f"{self.describe()}: {operation} failed: {exc}")
        mode = "w" if operation in ("write_bytes", "make_directory") else "r"
        request, sink = self._internal(["sh", "-c", _DIAGNOSE_SCRIPT, "sh", path, mode])
        code = await self.spawn(request, sink)
        found = bytes(sink.stdout).strip()
        num = int(found) if code == 0 and found.isdigit() else 0
        if num == 0:
            return SandboxError(f"{self.describe()}: {operation} of {path!r} failed: {exc}")
        return error_for_errno(num, path, str(exc) or None)

    def _internal(self, argv: list[str], *, limit: int = 1 << 20) -> tuple[ExecRequest, OutputSink]:
        """A request for the backend's own commands, in the workdir."""
        return bookkeeping_request(argv, cwd=self._workdir or "/", limit=limit)

    @contextlib.asynccontextmanager
    async def _modal_calls(self, operation: str, path: str | None) -> AsyncIterator[None]:
        """The boundary of this sandbox's SDK calls: what they raise is read with Modal's
        exception table (:meth:`_translate`)."""
        try:
            yield
        except Exception as exc:
            raise await self._translate(exc, operation, path) from exc

    async def _files(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        """One idempotent ``Sandbox.filesystem`` call, retried when the channel fails."""
        async for attempt in self._transport_retrying():
            with attempt:
                async with self._modal_calls(method, path):
                    filesystem = self._live_sandbox().filesystem
                    return await sdk_call(getattr(filesystem, method), *args, **kwargs)
        raise AssertionError("unreachable: tenacity reraises")
