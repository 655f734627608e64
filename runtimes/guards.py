"""What every operation on a :class:`~runtimes.base.Runtime` checks first: that the runtime
is open, where its workdir is, how a sandbox path resolves, and that nothing but a typed
error leaves a backend (:meth:`Guarded._guard`).

:class:`Guarded` sits between the backend's :class:`~runtimes.primitives.Primitives` and
the operation mixins (:mod:`.files`, :mod:`.host_routes`, :mod:`.accounts`,
:mod:`.forking`) that :class:`~runtimes.base.Runtime` is made of.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import ClassVar

from .arguments import PathLike, resolve_sandbox_path
from .errors import SandboxError, SandboxUnavailableError
from .lifecycle import State
from .primitives import Primitives

NEVER_STARTED_HINT = (
    ": open it first, with `async with runtime as rt:` or `await runtime.start()` (factories "
    "and fixtures such as sandbox_factory and attached_container_runtime hand out unstarted "
    "runtimes)"
)
"""What an operation on a runtime that was never started says to do."""


class Guarded(Primitives):
    """The state and the guards every operation goes through (see the module)."""

    name: ClassVar[str]
    _state: State

    @property
    def workdir(self) -> str:
        """The sandbox's absolute working directory (the default ``cwd``)."""
        self._check_open()
        assert self._workdir is not None
        return self._workdir

    @property
    def closed(self) -> bool:
        return self._state == State.CLOSED

    @property
    def state(self) -> State:
        """Where this runtime is in its life (:class:`~runtimes.lifecycle.State`)."""
        return self._state

    def describe(self) -> str:
        """A short human name for messages: backend plus sandbox id."""
        return f"{self.name} sandbox {self.sandbox_id or '(not started)'}"

    @property
    def sandbox_id(self) -> str | None:
        """The backend's id for this sandbox (container id, remote dir...), once started."""
        return None

    def resolve_path(self, path: PathLike) -> str:
        """An absolute sandbox path: relative ones are joined to the workdir.

        Raises:
            SandboxInvalidArgumentError: empty, containing a NUL byte or a lone surrogate
                that stands for no byte, a component over 255 bytes (NAME_MAX) or the whole
                over 4095 bytes (PATH_MAX).
        """
        return resolve_sandbox_path(path, self.workdir)

    def _check_open(self) -> None:
        if self._state != State.OPEN:
            what = {State.NEW: f"was never started{NEVER_STARTED_HINT}"}.get(self._state)
            what = what or {State.STARTING: "is still starting"}.get(self._state, "is closed")
            raise SandboxUnavailableError(f"{self.describe()} {what}")

    @contextmanager
    def _guard(self, operation: str, subject: str | None = None) -> Iterator[None]:
        """Let typed errors through; turn anything else from a backend into a SandboxError."""
        try:
            yield
        except SandboxError:
            raise
        except Exception as exc:
            about = f" {subject!r}" if subject else ""
            raise SandboxError(
                f"{self.describe()}: {operation}{about} failed unexpectedly: {exc!r}"
            ) from exc
