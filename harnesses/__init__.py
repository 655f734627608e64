"""vf-sandbox harnesses: who runs an agent, provisioned into a runtime.

The middle layer (it imports :mod:`runtimes`, never :mod:`placement`):

* :mod:`harnesses.llm` -- the model table and an async chat-completions client;
* :mod:`harnesses.base` -- the :class:`Harness` contract, :class:`Budget`, :class:`Trace`;
* :mod:`harnesses.registry` -- harnesses as plugins (``vf_sandbox.harnesses``), by ``id``;
* :mod:`harnesses.null`, :mod:`harnesses.bash` -- tool-less and bash-tool agents on the host;
* :mod:`harnesses.installed`, :mod:`harnesses.mini_swe_agent` -- agents installed into
  the sandbox, their model calls routed through :mod:`harnesses.proxy`;
* :mod:`harnesses.scripted` -- a scripted OpenAI-compatible endpoint for tests and demos.

See ``docs/harnesses.md``.
"""

from __future__ import annotations

from .base import Budget, Harness, HarnessConfig, ToolResult, Trace, TraceError, Turn
from .errors import (
    HarnessConfigError,
    HarnessError,
    HarnessInstallError,
    HarnessPluginError,
    ModelConfigError,
    ModelConnectionError,
    ModelError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    ProxyRouteError,
    ReplyParseError,
    UnknownHarnessError,
    UnknownModelError,
)
from .llm import ChatClient, ChatReply, ModelEndpoint, ModelTable, ToolCall, Usage
from .registry import available_harnesses, load_harness_class, open_harness, resolve_harness_config

__all__ = [
    "Budget",
    "ChatClient",
    "ChatReply",
    "Harness",
    "HarnessConfig",
    "HarnessConfigError",
    "HarnessError",
    "HarnessInstallError",
    "HarnessPluginError",
    "ModelConfigError",
    "ModelConnectionError",
    "ModelEndpoint",
    "ModelError",
    "ModelHTTPError",
    "ModelResponseError",
    "ModelTable",
    "ModelTimeoutError",
    "ProxyRouteError",
    "ReplyParseError",
    "ToolCall",
    "ToolResult",
    "Trace",
    "TraceError",
    "Turn",
    "UnknownHarnessError",
    "UnknownModelError",
    "Usage",
    "available_harnesses",
    "load_harness_class",
    "open_harness",
    "resolve_harness_config",
]
