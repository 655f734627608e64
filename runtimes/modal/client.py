"""Calling the ``modal`` SDK: from asyncio or trio, its exceptions mapped to typed errors.

:class:`_SdkRuntime` holds the sandbox handle and turns what the SDK raises into this suite's
errors (:meth:`_SdkRuntime._translate`); the exec and file halves of the runtime build on it.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from ..base import Runtime
from ..errors import (
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
    error_for_errno,
)
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


def _modal() -> Any:
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


async def _call(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """Call a (synchronicity-wrapped) SDK function from asyncio or trio."""
    if _on_asyncio():
        return await fn.aio(*args, **kwargs)
    return await anyio.to_thread.run_sync(
        functools.partial(fn, *args, **kwargs), abandon_on_cancel=True
    )


async def _collect(gen_fn: Any, /, *args: Any, **kwargs: Any) -> list[Any]:
    """All items of an SDK async generator (``Sandbox.list``)."""
    if _on_asyncio():
        return [item async for item in gen_fn.aio(*args, **kwargs)]
    return await anyio.to_thread.run_sync(
        lambda: list(gen_fn(*args, **kwargs)), abandon_on_cancel=True
    )


async def _pump(stream: Any, feed: Callable[[bytes], bool]) -> None:
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


def _exception_module() -> Any:
    return _modal().exception


def _is_transport_error(exc: BaseException) -> bool:
    errors = _exception_module()
    if isinstance(exc, errors.ServiceError | errors.ConnectionError | errors.InternalError):
        return True
    if isinstance(exc, OSError | TimeoutError) and not isinstance(exc, SandboxError):
        return True
    try:
        from grpclib.exceptions import StreamTerminatedError
    except ImportError:  # pragma: no cover - grpclib comes with modal
        return False
    return isinstance(exc, StreamTerminatedError)


def _sweep_error(exc: Exception, what: str) -> SandboxError:
    if _is_transport_error(exc):
        return SandboxTransportError(f"modal: cannot {what}: {type(exc).__name__}: {exc}")
    return SandboxError(f"modal: cannot {what}: {type(exc).__name__}: {exc}")


class _TooLargeForFilesystemApi(SandboxError):
    """The filesystem API refused a read as too large: read it through exec instead."""


class _SdkRuntime(Runtime):
    """The part of :class:`~runtimes.modal.ModalRuntime` that holds the sandbox handle and
    calls the SDK: retries of idempotent calls and the mapping of its exceptions."""

    config: ModalConfig
    _sandbox: Any
    _sandbox_id: str | None

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
        errors = _exception_module()
        try:
            return await _call(sandbox.poll) is not None
        except (errors.NotFoundError, errors.ClientClosed, errors.ConflictError):
            return True
        except Exception as exc:  # noqa: BLE001 - a probe: the caller reports the original error
            log.debug("modal: poll of %s failed: %r", self._sandbox_id, exc)
            return False

    async def _translate(self, exc: Exception, operation: str, path: str | None) -> SandboxError:
        """The typed error for an exception the SDK raised during ``operation``."""
        if isinstance(exc, SandboxError):
            return exc
        errors = _exception_module()
        subject = path or operation
        typed_fs: list[tuple[type[BaseException], int]] = [
            (errors.SandboxFilesystemNotFoundError, errno.ENOENT),
            (errors.SandboxFilesystemIsADirectoryError, errno.EISDIR),
            (errors.SandboxFilesystemNotADirectoryError, errno.ENOTDIR),
            (errors.SandboxFilesystemPermissionError, errno.EACCES),
            (errors.SandboxFilesystemPathAlreadyExistsError, errno.EEXIST),
            (errors.SandboxFilesystemDirectoryNotEmptyError, errno.ENOTEMPTY),
        ]
        for cls, num in typed_fs:
            if isinstance(exc, cls):
                return error_for_errno(num, subject, str(exc) or None)
        if isinstance(exc, errors.SandboxFilesystemFileTooLargeError):
            return _TooLargeForFilesystemApi(str(exc))
        if isinstance(exc, errors.SandboxFilesystemError):
            return await self._diagnosed(exc, operation, path)
        dead = (errors.ClientClosed, errors.SandboxTerminatedError, errors.SandboxTimeoutError)
        if isinstance(exc, dead):
            return SandboxUnavailableError(f"{self.describe()} is no longer running: {exc}")
        if isinstance(exc, errors.ConflictError):  # "Sandbox already finished", or a real conflict
            if await self._finished():
                return SandboxUnavailableError(f"{self.describe()} is no longer running: {exc}")
            return SandboxError(f"{self.describe()}: Modal refused {operation}: {exc}")
        if isinstance(exc, errors.AuthError | errors.PermissionDeniedError):
            return SandboxUnavailableError(
                f"{self.describe()}: Modal refused {operation}: {type(exc).__name__}: {exc}"
            )
        # The filesystem API reports every control-plane failure as NotFoundError("The
        # Sandbox is unavailable"), so NotFoundError alone cannot tell a dead sandbox from
        # a dropped connection: ask Modal whether it still runs.
        if isinstance(exc, errors.NotFoundError) or _is_transport_error(exc):
            if await self._finished():
                return SandboxUnavailableError(f"{self.describe()} is no longer running: {exc}")
            return SandboxTransportError(
                f"{self.describe()}: {operation} failed on the channel to Modal: "
                f"{type(exc).__name__}: {exc}"
            )
        if isinstance(exc, errors.InvalidError):
            return SandboxInvalidArgumentError(f"Modal refused {operation}: {exc}")
        return SandboxError(f"{self.describe()}: {operation} failed: {type(exc).__name__}: {exc}")

    async def _diagnosed(self, exc: Exception, operation: str, path: str | None) -> SandboxError:
        """An untyped filesystem error: find the errno with a shell probe on the path."""
        if path is None:
            return SandboxError(f"{self.describe()}: {operation} failed: {exc}")
        mode = "w" if operation in ("write_bytes", "make_directory") else "r"
        request, sink = self._internal(["sh", "-c", _DIAGNOSE_SCRIPT, "sh", path, mode])
        code = await self._exec(request, sink)
        found = bytes(sink.stdout).strip()
        num = int(found) if code == 0 and found.isdigit() else 0
        if num == 0:
            return SandboxError(f"{self.describe()}: {operation} of {path!r} failed: {exc}")
        return error_for_errno(num, path, str(exc) or None)

    async def _sdk(
        self, operation: str, path: str | None, call: Callable[[], Awaitable[Any]]
    ) -> Any:
        try:
            return await call()
        except Exception as exc:
            raise await self._translate(exc, operation, path) from exc

    async def _files(self, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        """One idempotent ``Sandbox.filesystem`` call, retried when the channel fails."""
        async for attempt in self._transport_retrying():
            with attempt:

                async def call() -> Any:
                    filesystem = self._live_sandbox().filesystem
                    return await _call(getattr(filesystem, method), *args, **kwargs)

                return await self._sdk(method, path, call)
        raise AssertionError("unreachable: tenacity reraises")
