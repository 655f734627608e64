"""The typed faces of the blocking session facades: what a type checker and an editor see
on a :class:`~harnesses.session.SyncAgentSessionFactory` and a
:class:`~harnesses.session.SyncAgentSession`.

As :mod:`runtimes.sync_faces` does for runtimes: each facade class inherits its protocol
only while type checking (at run time :class:`~runtimes.blocking.Blocking` turns each
coroutine method of the async object into a blocking one as it is looked up), and
``tests/test_sync_faces.py`` keeps each protocol in step with its async class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from runtimes.blocking import face_only

if TYPE_CHECKING:
    from runtimes import Runtime, RuntimeConfig

    from .agent_session import AgentSession
    from .base import Harness, Trace
    from .errors import SessionError
    from .gate import Completion, InterceptedRequest
    from .rollout import RolloutRecord, Status, Verification
    from .session import FactoryState, SyncAgentSession

__all__ = ["NOT_BLOCKING", "AgentSessionFace", "AgentSessionFactoryFace"]

NOT_BLOCKING = frozenset({"serve"})
"""Coroutine methods of :class:`~harnesses.agent_session.AgentSession` that have no
blocking face: ``serve`` is the task the factory starts the session in."""


class AgentSessionFace(Protocol):
    """The blocking :class:`~harnesses.agent_session.AgentSession` API: each method blocks
    on its async namesake and raises what it raises, plus SessionClosedError once the
    factory has exited."""

    def next_request(self, timeout: float | None = None) -> InterceptedRequest | None:
        face_only()

    def deliver(
        self,
        request: InterceptedRequest | Mapping[str, Any] | str,
        completion: Completion | str | Mapping[str, Any],
    ) -> None:
        face_only()

    def verify(self) -> Verification:
        face_only()

    def close(self) -> None:
        face_only()

    def record(self) -> RolloutRecord:
        face_only()

    @property
    def rollout_id(self) -> str:
        face_only()

    @property
    def status(self) -> Status:
        face_only()

    @property
    def closed(self) -> bool:
        face_only()

    @property
    def failure(self) -> SessionError | None:
        face_only()

    @property
    def trace(self) -> Trace | None:
        face_only()

    @property
    def runtime(self) -> Runtime:
        """The async runtime underneath (its coroutines run on the factory's loop only)."""
        face_only()


class AgentSessionFactoryFace(Protocol):
    """The blocking :class:`~harnesses.session.AgentSessionFactory` API."""

    def create(self, *, task: str | Mapping[str, Any], rollout_id: str) -> SyncAgentSession:
        face_only()

    def sessions(self) -> list[AgentSession]:
        """The async sessions (use them only from the factory's loop)."""
        face_only()

    @property
    def state(self) -> FactoryState:
        face_only()

    @property
    def harness(self) -> Harness:
        face_only()

    @property
    def runtime_config(self) -> RuntimeConfig:
        face_only()

    @property
    def has_verify(self) -> bool:
        face_only()
