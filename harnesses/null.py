"""The ``null`` harness: no tools, one model call, in-process on the host.

It needs no sandbox (``runtime`` may be ``None``) and no network inside any box. Its
reply is the run's output; for judges the reply is the verdict JSON, read with
:func:`parse_reply_json` (bare JSON, or exactly one fenced ```json block).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal

import anyio

from runtimes import Runtime

from .base import Budget, BudgetClock, Harness, HarnessConfig, Trace, call_model, task_messages
from .errors import ReplyParseError
from .llm import ChatClient, Message, ModelEndpoint

__all__ = ["NullConfig", "NullHarness", "parse_reply_json"]

_FENCED = re.compile(r"```json[ \t]*\r?\n(?P<body>.*?)\r?\n?```", re.DOTALL | re.IGNORECASE)


def parse_reply_json(text: str | None) -> Any:
    """The JSON value of a reply that is bare JSON or exactly one fenced ```json block.

    Surrounding whitespace is ignored; anything else around the JSON (prose before or
    after, a second block, a fence without the ``json`` tag) is an error, never guessed at.

    Raises:
        ReplyParseError: no reply, or the reply is not in one of the two accepted forms.
    """
    if text is None or not text.strip():
        raise ReplyParseError("the reply is empty; expected JSON")
    stripped = text.strip()
    if stripped.startswith("```"):
        match = _FENCED.fullmatch(stripped)
        if match is None:
            raise ReplyParseError(
                "a fenced reply must be exactly one ```json block with nothing around it"
            )
        body = match.group("body")
    else:
        body = stripped
    try:
        return json.loads(body)
    except RecursionError:
        raise ReplyParseError("the reply's JSON is nested too deeply to parse") from None
    except json.JSONDecodeError as exc:
        raise ReplyParseError(
            f"the reply is neither bare JSON nor a single fenced ```json block: {exc}"
        ) from None


class NullConfig(HarnessConfig):
    """Config of the ``null`` harness. ``system_prompt`` opens a string task."""

    id: Literal["null"] = "null"
    system_prompt: str | None = None


class NullHarness(Harness):
    """One model call, no tools, no sandbox."""

    id = "null"
    config_model = NullConfig
    needs_runtime = False

    def __init__(self, config: HarnessConfig | None = None):
        super().__init__(config)
        self.config: NullConfig

    async def run(
        self,
        task: str | Sequence[Message],
        *,
        runtime: Runtime | None = None,
        model: ModelEndpoint,
        budget: Budget | None = None,
    ) -> Trace:
        """Ask ``model`` once; the reply text is ``trace.output``.

        A zero turn budget ends the run before the call (``budget_turns``); a wall-time
        budget cancels the call (``budget_time``); a model failure is ``model_error``.

        Raises:
            HarnessConfigError: an empty task.
            ModelConfigError: the endpoint's API key variable is not set.
        """
        messages = task_messages(task, self.config.system_prompt)
        trace = self.new_trace(model)
        clock = BudgetClock(budget or Budget(), trace)
        if clock.record_exhaustion():
            return trace.finish()
        async with ChatClient(model) as client:
            with anyio.move_on_after(clock.remaining_seconds()) as scope:
                await call_model(client, messages, trace)
        if scope.cancelled_caught:
            clock.record_time_out()
            return trace.finish()
        reply = trace.turns[-1].reply
        return trace.finish(reply.content if reply else None)
