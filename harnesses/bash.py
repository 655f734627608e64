"""The ``bash`` harness: a tool-using agent loop on the host, its one tool runs in the sandbox.

The model gets a single OpenAI function tool, ``bash(command: string)``. Each call runs
as ``runtime.exec(["bash", "-c", command], timeout=per_call_timeout)`` (``sh`` when the
sandbox has no bash) and the model is shown the exit code and stdout/stderr, each
truncated to ``max_output_chars`` with a clear marker. A command that times out is
killed (the runtime kills the whole tree) and the model is told so. The run ends when
the model replies without tool calls; that reply is the output.

``shell_vars`` are variables each command's shell has but does not export: the
command can use ``$NAME``, the programs it runs do not inherit it. Hooks registered with
:meth:`BashHarness.add_command_hook` run after each command, before the model sees its
result (placement uses one to stop what the command left running and to watch the
judge's verdict file).

Budgets (turns, tokens, wall time) are checked before each model call; wall time is also
a hard deadline that cancels a model call or command in flight. A budget hit, a model
error or a lost sandbox ends the run with the typed reason on ``trace.error``.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Sequence
from typing import Any, Literal

import anyio
from pydantic import Field, field_validator

from runtimes import (
    ExecTimeoutError,
    OutputLimitExceededError,
    Runtime,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxTransportError,
    SandboxUnavailableError,
)
from runtimes.models import MiB

from .base import (
    Budget,
    BudgetClock,
    CommandHook,
    Harness,
    HarnessConfig,
    ToolResult,
    Trace,
    Turn,
    call_model,
    task_messages,
)
from .llm import ChatClient, Message, ModelEndpoint, ToolCall

__all__ = ["BASH_TOOL", "DEFAULT_SYSTEM_PROMPT", "BashConfig", "BashHarness", "truncate_for_model"]

BASH_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": (
            "Run a bash command in the sandbox and return its exit code, stdout and stderr. "
            "Each call starts a fresh shell in the working directory."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command line to run."}
            },
            "required": ["command"],
        },
    },
}

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent working in a sandboxed Linux machine. Use the `bash` tool to run "
    "commands: inspect files, run programs, write files. Each call runs in a fresh shell. "
    "When you are finished, reply with your final answer and no tool call."
)


class BashConfig(HarnessConfig):
    """Config of the ``bash`` harness."""

    id: Literal["bash"] = "bash"
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    per_call_timeout: float = Field(default=60.0, gt=0, description="seconds per command")
    max_output_chars: int = Field(
        default=10_000, ge=200, description="stdout/stderr characters shown to the model, each"
    )
    exec_output_limit: int = Field(
        default=4 * MiB, gt=0, description="bytes a command may print before it is killed"
    )
    cwd: str | None = Field(default=None, description="where commands run (default: workdir)")
    env: dict[str, str] = Field(default_factory=dict)
    shell_vars: dict[str, str] = Field(
        default_factory=dict,
        description="variables set in each command's shell but not exported to its programs",
    )
    user: str | None = None

    @field_validator("shell_vars")
    @classmethod
    def _names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _SHELL_NAME.fullmatch(name):
                raise ValueError(f"not a shell variable name: {name!r}")
        return value


_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class _HookFailed(Exception):
    """A command hook raised a SandboxError: the run ends with ``sandbox_error``."""

    def __init__(self, cause: SandboxError):
        super().__init__(str(cause))
        self.cause = cause


def _unexport(names: Sequence[str]) -> str:
    """A shell prelude that keeps each variable's value but stops exporting it."""
    if not names:
        return ""
    steps = "".join(f"__vf_v=${n}; unset {n}; {n}=$__vf_v; " for n in names)
    return f"{steps}unset __vf_v\n"


def truncate_for_model(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping head and tail around a marker."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters truncated ...]\n{text[-tail:]}"


class BashHarness(Harness):
    """An agent loop on the host whose ``bash`` tool runs through ``runtime.exec``."""

    id = "bash"
    config_model = BashConfig

    def __init__(self, config: HarnessConfig | None = None):
        super().__init__(config)
        self.config: BashConfig
        self._shells: weakref.WeakKeyDictionary[Runtime, str] = weakref.WeakKeyDictionary()
        self._hooks: list[CommandHook] = []

    def add_command_hook(self, hook: CommandHook) -> bool:
        """Run ``await hook(runtime, command, result)`` after each command (also one that
        failed, timed out or hit the output cap), before the model sees the result.

        A hook that raises ``SandboxError`` ends the run with ``sandbox_error``.
        Returns ``True``: this harness runs every command itself.
        """
        self._hooks.append(hook)
        return True

    async def setup(self, runtime: Runtime | None) -> None:
        """Find the sandbox's shell (bash, else sh). Idempotent; nothing is installed.

        Raises:
            HarnessConfigError: ``runtime`` is ``None``.
            SandboxError: the sandbox failed (typed, from :mod:`runtimes.errors`).
        """
        await self._shell_for(self._require_runtime(runtime))

    async def run(
        self,
        task: str | Sequence[Message],
        *,
        runtime: Runtime | None,
        model: ModelEndpoint,
        budget: Budget | None = None,
    ) -> Trace:
        """Run the agent loop on ``task`` until the model stops calling tools.

        Raises:
            HarnessConfigError: an empty task, or ``runtime`` is ``None``.
            ModelConfigError: the endpoint's API key variable is not set.
        """
        sandbox = self._require_runtime(runtime)
        messages = task_messages(task, self.config.system_prompt)
        trace = self.new_trace(model)
        clock = BudgetClock(budget or Budget(), trace)
        async with ChatClient(model) as client:
            with anyio.move_on_after(clock.remaining_seconds()) as scope:
                try:
                    await self._loop(client, sandbox, messages, trace, clock)
                except (SandboxUnavailableError, SandboxTransportError) as exc:
                    trace.fail("sandbox_error", f"{sandbox.describe()}: {exc}", exc)
                except _HookFailed as exc:
                    message = f"{sandbox.describe()}: after a command: {exc.cause}"
                    trace.fail("sandbox_error", message, exc.cause)
        if scope.cancelled_caught:
            clock.record_time_out()
        return trace.finish()

    async def _loop(
        self,
        client: ChatClient,
        runtime: Runtime,
        messages: list[Message],
        trace: Trace,
        clock: BudgetClock,
    ) -> None:
        shell = await self._shell_for(runtime)
        while not clock.record_exhaustion():
            turn = await call_model(client, messages, trace, tools=[BASH_TOOL])
            if turn.reply is None:
                return
            if not turn.reply.tool_calls:
                trace.output = turn.reply.content
                return
            messages.append(turn.reply.assistant_message())
            await self._run_tools(runtime, shell, turn, messages)

    async def _run_tools(
        self, runtime: Runtime, shell: str, turn: Turn, messages: list[Message]
    ) -> None:
        assert turn.reply is not None
        for call in turn.reply.tool_calls:
            result = await self._run_tool(runtime, shell, call)
            turn.tool_results.append(result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.output})

    async def _run_tool(self, runtime: Runtime, shell: str, call: ToolCall) -> ToolResult:
        result = ToolResult(call_id=call.id, name=call.name, arguments=call.arguments, output="")
        command = self._command_of(call, result)
        if command is None:
            return result
        started = time.monotonic()
        env = {**self.config.env, **self.config.shell_vars}
        script = _unexport(list(self.config.shell_vars)) + command
        try:
            done = await runtime.exec(
                [shell, "-c", script],
                timeout=self.config.per_call_timeout,
                cwd=self.config.cwd,
                env=env or None,
                user=self.config.user,
                output_limit=self.config.exec_output_limit,
            )
        except ExecTimeoutError as exc:
            result.timed_out = True
            result.output = self._format(
                f"timed out after {self.config.per_call_timeout}s; the command was killed",
                exc.stdout,
                exc.stderr,
            )
        except OutputLimitExceededError as exc:
            result.output = self._format(
                f"killed: output exceeded {exc.limit} bytes", exc.stdout, exc.stderr
            )
        except (SandboxUnavailableError, SandboxTransportError):
            raise
        except SandboxError as exc:
            # A bad cwd or user, an argument the runtime refuses: the model can react.
            result.output = f"error: the command could not be run: {exc}"
        else:
            result.exit_code = done.exit_code
            result.output = self._format(f"exit_code: {done.exit_code}", done.stdout, done.stderr)
        result.duration = time.monotonic() - started
        for hook in self._hooks:
            try:
                await hook(runtime, command, result)
            except (SandboxUnavailableError, SandboxTransportError):
                raise
            except SandboxError as exc:
                raise _HookFailed(exc) from exc
        return result

    @staticmethod
    def _command_of(call: ToolCall, result: ToolResult) -> str | None:
        """The command of a well-formed bash call; otherwise the error is put on ``result``."""
        if call.name != "bash":
            result.output = f"error: unknown tool {call.name!r}; the only tool is 'bash'"
            return None
        try:
            command = call.parsed_arguments().get("command")
        except ValueError as exc:
            result.output = f"error: tool arguments are not a JSON object: {exc}"
            return None
        if not isinstance(command, str) or not command.strip():
            result.output = "error: the bash tool needs a non-empty string 'command'"
            return None
        return command

    def _format(self, status: str, stdout: str, stderr: str) -> str:
        limit = self.config.max_output_chars
        parts = [status]
        if stdout:
            parts.append("stdout:\n" + truncate_for_model(stdout, limit))
        if stderr:
            parts.append("stderr:\n" + truncate_for_model(stderr, limit))
        if not stdout and not stderr:
            parts.append("(no output)")
        return "\n".join(parts)

    async def _shell_for(self, runtime: Runtime) -> str:
        shell = self._shells.get(runtime)
        if shell is None:
            shell = await _probe_shell(runtime)
            self._shells[runtime] = shell
        return shell


async def _probe_shell(runtime: Runtime) -> str:
    """``bash`` if the sandbox has it, else ``sh``."""
    try:
        probe = await runtime.exec(["sh", "-c", "command -v bash"], timeout=30)
    except SandboxFileNotFoundError:
        return "bash"  # no sh either: let each call report the missing shell
    return "bash" if probe.exit_code == 0 else "sh"
