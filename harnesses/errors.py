"""Typed errors of the harness layer.

Two families:

* :class:`ModelError` -- talking to a model endpoint failed. A caller branches on the
  subclass: :class:`ModelHTTPError` (the provider answered with a non-2xx status; its
  ``status_code`` and ``body`` are kept), :class:`ModelTimeoutError`,
  :class:`ModelConnectionError` (no answer at all) and :class:`ModelResponseError` (a
  2xx answer that is not a well-formed chat completion).
* :class:`HarnessError` -- configuring, loading, installing or running a harness failed.
  Its :class:`SessionError` branch is the gated-rollout contract's
  (:mod:`harnesses.session`): a session that could not start, timed out, lost its agent or
  its sandbox, failed verification, or was misused.

No error message ever contains an API key: endpoints name the environment variable that
holds the key, and bodies echoed by a provider are redacted before they are stored.
"""

from __future__ import annotations

__all__ = [
    "HarnessConfigError",
    "HarnessError",
    "HarnessInstallError",
    "HarnessPluginError",
    "ModelConfigError",
    "ModelConnectionError",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTimeoutError",
    "ProxyRouteError",
    "ReplyParseError",
    "SampleError",
    "SessionAgentFailed",
    "SessionClosedError",
    "SessionDeliveryTimeout",
    "SessionError",
    "SessionGenerateError",
    "SessionProtocolError",
    "SessionRequestTimeout",
    "SessionSandboxLost",
    "SessionStartError",
    "SessionStateError",
    "SessionTimeout",
    "SessionVerifyError",
    "UnknownHarnessError",
    "UnknownModelError",
]


class ModelError(Exception):
    """Base of every error raised while calling a model endpoint."""


class ModelConfigError(ModelError, ValueError):
    """A model table or endpoint is invalid, or its API key variable is not set."""


class UnknownModelError(ModelConfigError, KeyError):
    """The model table has no endpoint under the requested logical name."""

    def __str__(self) -> str:
        # KeyError would repr() the message; keep it readable.
        return str(self.args[0]) if self.args else ""


class ModelHTTPError(ModelError):
    """The endpoint answered with a non-2xx status. ``body`` is the (redacted) response text."""

    def __init__(self, status_code: int, body: str, *, url: str = ""):
        self.status_code = status_code
        self.body = body
        self.url = url
        where = f" from {url}" if url else ""
        super().__init__(f"model endpoint returned HTTP {status_code}{where}: {_clip(body)}")

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_http_error, (self.status_code, self.body, self.url))


def _rebuild_http_error(status_code: int, body: str, url: str) -> ModelHTTPError:
    return ModelHTTPError(status_code, body, url=url)


class ModelTimeoutError(ModelError, TimeoutError):
    """The endpoint did not answer within the endpoint's ``timeout``."""


class ModelConnectionError(ModelError, ConnectionError):
    """The endpoint could not be reached (refused, reset, DNS); retried before it surfaces."""


class ModelResponseError(ModelError):
    """A 2xx answer that is not a well-formed chat completion (bad JSON, no choices, ...)."""


class HarnessError(Exception):
    """Base of every error raised by the harness layer itself."""


class HarnessConfigError(HarnessError, ValueError):
    """A harness config could not be validated; the message names every bad field."""


class UnknownHarnessError(HarnessConfigError):
    """No harness is registered under the requested ``id``."""


class HarnessPluginError(HarnessError, ImportError):
    """A harness plugin could not be imported, or is not a :class:`~harnesses.base.Harness`."""


class HarnessInstallError(HarnessError):
    """Installing an agent into a sandbox failed; the message carries the installer's output."""


class ProxyRouteError(HarnessError):
    """The sandbox has no route to the host's model proxy (for example a network-less container)."""


class ReplyParseError(HarnessError, ValueError):
    """A model reply is not bare JSON or a single fenced ```json block."""


class SessionError(HarnessError):
    """Base of the gated-session errors. ``rollout_id`` names the session, when known."""

    def __init__(self, message: str, *, rollout_id: str | None = None):
        prefix = f"rollout {rollout_id!r}: " if rollout_id else ""
        super().__init__(prefix + message)
        self.rollout_id = rollout_id


class SessionStartError(SessionError):
    """The session's sandbox or harness could not be started (the cause is chained)."""


class SessionTimeout(SessionError, TimeoutError):
    """A session waited too long; which side was late is the subclass."""


class SessionRequestTimeout(SessionTimeout):
    """The agent made no model call (and did not exit) within the request timeout."""


class SessionDeliveryTimeout(SessionTimeout):
    """A parked model call got no completion within the delivery timeout; the agent was
    answered with an error."""


class SessionAgentFailed(SessionError):
    """The harness or its agent failed (it exited abnormally, or the harness raised)."""


class SessionSandboxLost(SessionError):
    """The session's sandbox died, or the channel to it failed, mid-session."""


class SessionVerifyError(SessionError):
    """Computing the reward failed (for example a judge failed); the cause is chained."""


class SessionStateError(SessionError, RuntimeError):
    """The session was used out of order (for example ``verify()`` while the agent runs)."""


class SessionClosedError(SessionStateError):
    """The session (or its factory) is closed."""


class SessionProtocolError(SessionError, ValueError):
    """An argument the session cannot accept: a delivery for an unknown or already answered
    request, a completion with neither text nor tool calls, an invalid rollout id or task,
    a timeout that is not positive."""


class SessionGenerateError(SessionError):
    """The trainer's ``generate`` function (:mod:`harnesses.trainer`) failed for one turn;
    the cause (e.g. a :class:`ModelError` of its endpoint) is chained."""


class SampleError(HarnessError, ValueError):
    """A rollout record cannot become one token-level training sample: a turn's prompt
    tokens do not extend the tokens before it (the harness rewrote its history)."""


def _clip(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
