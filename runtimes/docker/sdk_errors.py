"""The docker SDK's exceptions as vf-sandbox's typed errors: one table, applied at the
engine-call boundary (as httpx maps its transport's exceptions).

An SDK call fails in one of two ways, and :func:`sdk_errors` reads both, first row first:

- **Silence** (:data:`SILENCE`): the engine did not answer — a connection refused or reset,
  a timeout, a broken chunked stream, an SSH transport failure, an ``OSError``, or the SDK's
  bare ``DockerException`` around one of those (a failed version handshake). It becomes
  :class:`SandboxTransportError`, which :func:`.client.engine_call` retries for idempotent
  calls. Text the engine cannot carry (a lone surrogate in a URL) becomes
  :class:`SandboxInvalidArgumentError`.
- **An answer** (:data:`ANSWERS`): ``docker.errors.APIError``. What a "no" means depends on
  the call, so a call that translates answers passes a :class:`Refusal` (what it was doing,
  about which container, the error class); the rows read a container that is gone (404, or
  409 not running / paused) as :class:`SandboxUnavailableError` and anything else as the
  refusal's error. A call without a refusal gets the ``APIError`` itself, for answers that
  are control flow (a missing image is ``None``, an already paused container is fine).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import (
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
)

if TYPE_CHECKING:
    import docker.errors


# ---------------------------------------------------------------------- reading an answer


def api_message(exc: docker.errors.APIError) -> str:
    """The engine's own message in an ``APIError`` (else the SDK's text)."""
    return str(exc.explanation or exc)


def api_status(exc: docker.errors.APIError) -> int:
    """The HTTP status of an ``APIError`` (0 when it has none)."""
    return exc.status_code or 0


def container_is_gone(exc: docker.errors.APIError) -> bool:
    """404 no such container, or 409 not running / paused / restarting."""
    message = api_message(exc).lower()
    if api_status(exc) == 404:
        return "no such container" in message or "no such exec" not in message
    return api_status(exc) == 409 and any(
        word in message for word in ("not running", "paused", "restarting", "is dead")
    )


def gone_error(subject: str, exc: docker.errors.APIError) -> SandboxUnavailableError:
    """The container ``subject`` (its runtime's name for it) is gone, as the engine said."""
    return SandboxUnavailableError(f"{subject} is gone: {api_message(exc)}")


def not_engine_text(exc: UnicodeEncodeError, engine: str) -> SandboxInvalidArgumentError:
    """Text the Engine API cannot carry (it takes valid UTF-8 only)."""
    return SandboxInvalidArgumentError(
        f"{engine} takes only valid UTF-8 text, not {exc.object!r}: pass undecodable bytes "
        "through stdin or file content (or use the channel, which carries them)"
    )


@dataclass(frozen=True)
class Refusal:
    """What an engine's "no" means at one call."""

    build: Callable[[str], SandboxError]
    """The error, from the engine's message."""
    subject: str | None = None
    """The container the call is about (its runtime's name for it): with it, an answer that
    the container is gone reads as :class:`SandboxUnavailableError`."""


def refused(
    doing: str, *, subject: str | None = None, error: type[SandboxError] = SandboxError
) -> Refusal:
    """The common refusal: ``error("[subject: ]doing: <the engine's message>")``."""
    prefix = f"{subject}: {doing}" if subject else doing
    return Refusal(lambda message: error(f"{prefix}: {message}"), subject)


def _gone(refusal: Refusal, exc: docker.errors.APIError) -> bool:
    return refusal.subject is not None and container_is_gone(exc)


ANSWERS: tuple[
    tuple[
        Callable[[Refusal, docker.errors.APIError], bool],
        Callable[[Refusal, docker.errors.APIError], SandboxError],
    ],
    ...,
] = (
    (_gone, lambda refusal, exc: gone_error(str(refusal.subject), exc)),
    (lambda refusal, exc: True, lambda refusal, exc: refusal.build(api_message(exc))),
)
"""How an ``APIError`` reads at a call that passed a :class:`Refusal`: the first row whose
test holds makes the error."""


def _answer(refusal: Refusal, exc: docker.errors.APIError) -> SandboxError:
    for test, error in ANSWERS:
        if test(refusal, exc):
            return error(refusal, exc)
    raise AssertionError("the last row of ANSWERS reads every answer")  # pragma: no cover


@contextlib.contextmanager
def engine_answers(refusal: Refusal) -> Iterator[None]:
    """Only the answer rows: for a blocking helper whose caller's :func:`sdk_errors` (in
    :func:`.client.engine_call`) reads silence.

    Raises:
        SandboxError: the engine refused (see :class:`Refusal`).
    """
    import docker.errors

    try:
        yield
    except docker.errors.APIError as exc:
        raise _answer(refusal, exc) from exc


# ---------------------------------------------------------------------- silence

SILENCE: tuple[tuple[str, str], ...] = (
    ("requests.exceptions", "ConnectionError"),
    ("requests.exceptions", "Timeout"),
    ("requests.exceptions", "ChunkedEncodingError"),
    ("urllib3.exceptions", "HTTPError"),
    ("paramiko", "SSHException"),  # an ssh:// engine (paramiko ships with the docker extra)
    ("builtins", "OSError"),
)
"""(module, class) of the exceptions that say the engine did not answer."""

_silence: tuple[type[BaseException], ...] | None = None


def _silence_types() -> tuple[type[BaseException], ...]:
    global _silence
    if _silence is None:
        found = []
        for module, name in SILENCE:
            try:
                found.append(getattr(importlib.import_module(module), name))
            except ImportError:  # pragma: no cover - an optional transport's package
                continue
        _silence = tuple(found)
    return _silence


def is_transport_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says the engine did not answer (as opposed to answering "no")."""
    import docker.errors

    if isinstance(exc, SandboxError | docker.errors.APIError):
        return False
    if isinstance(exc, _silence_types()):
        return True
    if isinstance(exc, docker.errors.DockerException):
        # The SDK wraps a failed version handshake in a bare DockerException; other
        # DockerExceptions (invalid arguments, TLS settings) are answers, not silence.
        cause = exc.__cause__ or exc.__context__
        return cause is not None and is_transport_failure(cause)
    return False


# ---------------------------------------------------------------------- the boundary


def translate(exc: Exception, engine: str, refusal: Refusal | None) -> SandboxError | None:
    """The typed error ``exc`` (raised by the SDK talking to ``engine``) reads as, or
    ``None`` to let it through."""
    import docker.errors

    if isinstance(exc, UnicodeEncodeError):  # a path with a lone surrogate, in a URL
        return not_engine_text(exc, engine)
    if refusal is not None and isinstance(exc, docker.errors.APIError):
        return _answer(refusal, exc)
    if is_transport_failure(exc):
        return SandboxTransportError(f"{engine} did not answer: {exc}")
    return None


@contextlib.contextmanager
def sdk_errors(engine: str, refusal: Refusal | None = None) -> Iterator[None]:
    """Raise what the SDK raises inside as the typed error it reads as (see the module
    doc); typed errors and what reads as nothing pass through.

    Raises:
        SandboxTransportError: the engine did not answer.
        SandboxInvalidArgumentError: text the engine cannot carry.
        SandboxError: the engine refused (with ``refusal``: its error, or
            SandboxUnavailableError for a container that is gone).
    """
    try:
        yield
    except SandboxError:
        raise
    except Exception as exc:
        error = translate(exc, engine, refusal)
        if error is None:
            raise
        if isinstance(exc, UnicodeEncodeError):
            raise error from None
        raise error from exc
