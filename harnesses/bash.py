"""The ``bash`` harness: a tool-using agent loop on the host, its one tool runs in the sandbox.

The model gets a single OpenAI function tool, ``bash(command: string)``. Each call runs
as ``runtime.exec(["bash", "-c", command], timeout=per_call_timeout)`` (``sh`` when the
sandbox has no bash) and the model is shown the exit code and stdout/stderr, each
truncated to ``max_output_chars`` with a clear marker. A command that times out is
killed (the runtime kills the whole tree) and the model is told so. The run ends when
the model replies without tool calls; that reply is the output.

With ``persistent_shell`` the run opens one shell session (:meth:`runtimes.Runtime.shell`)
and each call is ``session.run(command, timeout=per_call_timeout)``: ``cd``, variables and
activated venvs carry over, and the tool description and default prompt say so. A command
that times out is interrupted (Ctrl-C, then SIGKILL) and the session goes on. A session
that dies (``exit``, ``exec``, a shell that could not be interrupted) is reported to the
model as that call's result and the next call gets a fresh session; a session that cannot
be opened ends the run with ``sandbox_error`` and the :class:`~runtimes.ShellSessionError`.

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
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, Literal, Protocol

import anyio
from pydantic import Field, field_validator

from runtimes import (
    ExecResult,
    ExecTimeoutError,
    OutputLimitExceededError,
    Runtime,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxTransportError,
    SandboxUnavailableError,
    ShellSessionError,
)
from runtimes.machinery import MACHINERY_PATH, run_machinery
from runtimes.models import MiB
from runtimes.shell import ShellSession

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

__all__ = [
    "BASH_TOOL",
    "DEFAULT_SYSTEM_PROMPT",
    "PERSISTENT_BASH_TOOL",
    "PERSISTENT_SYSTEM_PROMPT",
    "BashConfig",
    "BashHarness",
    "truncate_for_model",
]


def _bash_tool(description: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": "bash",
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command line to run."}
                },
                "required": ["command"],
            },
        },
    }


BASH_TOOL = _bash_tool(
    "Run a bash command in the sandbox and return its exit code, stdout and stderr. "
    "Each call starts a fresh shell in the working directory."
)

PERSISTENT_BASH_TOOL = _bash_tool(
    "Run a bash command in the sandbox and return its exit code, stdout and stderr. "
    "The shell persists between calls: the working directory (cd), variables, functions "
    "and activated environments carry over to the next call. Commands read no input."
)

DEFAULT_SYSTEM_PROMPT = (
    "You are an agent working in a sandboxed Linux machine. Use the `bash` tool to run "
    "commands: inspect files, run programs, write files. Each call runs in a fresh shell. "
    "When you are finished, reply with your final answer and no tool call."
)

PERSISTENT_SYSTEM_PROMPT = (
    "You are an agent working in a sandboxed Linux machine. Use the `bash` tool to run "
    "commands: inspect files, run programs, write files. All calls run in one persistent "
    "shell: `cd`, variables and activated environments carry over from call to call. "
    "A command that runs too long is interrupted. "
    "When you are finished, reply with your final answer and no tool call."
)


class BashConfig(HarnessConfig):
    """Config of the ``bash`` harness."""

    id: Literal["bash"] = "bash"
    system_prompt: str | None = Field(
        default=DEFAULT_SYSTEM_PROMPT,
        description="the default becomes PERSISTENT_SYSTEM_PROMPT with persistent_shell",
    )
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
    persistent_shell: bool = Field(
        default=False,
        description="run every command in one shell session that persists across calls",
    )

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


class _SessionUnavailable(Exception):
    """The persistent shell session could not be opened: the run ends with ``sandbox_error``."""

    def __init__(self, cause: ShellSessionError):
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


class _Commands(Protocol):
    """Where a run's commands run: :class:`_FreshShells` or :class:`_PersistentShell`."""

    timeout_note: str
    capped_note: str

    async def run(self, command: str) -> ExecResult: ...

    def pop_notice(self) -> str | None:
        """What the model must be told about where this command ran, once."""


class _FreshShells:
    """Each command in a fresh ``bash -c`` (``sh -c`` without bash) through ``exec``."""

    timeout_note = "the command was killed"
    capped_note = "killed"

    def __init__(
        self,
        runtime: Runtime,
        shell: str,
        config: BashConfig,
        user_for: Callable[[str], str | None] | None = None,
    ):
        self._runtime = runtime
        self._shell = shell
        self._config = config
        self._user_for = user_for

    async def run(self, command: str) -> ExecResult:
        """Raises what :meth:`runtimes.Runtime.exec` raises."""
        config = self._config
        user = config.user if self._user_for is None else self._user_for(command)
        env = {**config.env, **config.shell_vars}
        return await self._runtime.exec(
            [self._shell, "-c", _unexport(list(config.shell_vars)) + command],
            timeout=config.per_call_timeout,
            cwd=config.cwd,
            env=env or None,
            user=user,
            output_limit=config.exec_output_limit,
        )

    def pop_notice(self) -> str | None:
        return None


class _PersistentShell:
    """Every command in one shell session; a fresh session after one died."""

    timeout_note = "the command was interrupted; the shell session goes on"
    capped_note = "interrupted"

    def __init__(self, runtime: Runtime, config: BashConfig):
        self._runtime = runtime
        self._config = config
        self._session: ShellSession | None = None
        self._stack = AsyncExitStack()
        self._notice: str | None = None

    async def run(self, command: str) -> ExecResult:
        """Run ``command`` in the session; one found dead first (a hook or another process
        killed it between commands) is replaced, with a notice (:meth:`pop_notice`).

        Raises:
            _SessionUnavailable: no session could be opened.
            ShellSessionError: the session died during the command (the next call opens
                a fresh one).
            ExecTimeoutError, OutputLimitExceededError: the command was interrupted.
        """
        session = await self._live_session()
        try:
            return await session.run(
                command,
                timeout=self._config.per_call_timeout,
                output_limit=self._config.exec_output_limit,
            )
        except ShellSessionError:
            await self.close()
            raise

    def pop_notice(self) -> str | None:
        notice, self._notice = self._notice, None
        return notice

    async def _live_session(self) -> ShellSession:
        """The open session if it still answers (a round trip of ``:``), else a fresh one."""
        if self._session is not None:
            try:
                await self._session.run(":", timeout=_PROBE_TIMEOUT)
                return self._session
            except (ShellSessionError, ExecTimeoutError) as exc:
                await self.close()
                self._notice = (
                    f"note: the shell session had ended ({exc}); this command ran in a fresh "
                    "shell: the working directory, variables and background jobs were reset"
                )
        return await self.open()

    async def open(self) -> ShellSession:
        """Open the session; ``shell_vars`` become unexported variables of it.

        Raises:
            _SessionUnavailable: the session could not start (no bash or python3, ...).
            SandboxError: the sandbox failed.
        """
        config = self._config
        env = {**config.env, **config.shell_vars}
        try:
            session = await self._stack.enter_async_context(
                self._runtime.shell(cwd=config.cwd, env=env or None, user=config.user)
            )
            if config.shell_vars:
                await _unexport_in(session, list(config.shell_vars))
        except ShellSessionError as exc:
            await self.close()
            raise _SessionUnavailable(exc) from exc
        self._session = session
        return session

    async def close(self) -> None:
        """Close the session, if one is open (the session shields its own close from a
        cancellation of the run; a shield here would break the order of cancel scopes)."""
        self._session = None
        stack, self._stack = self._stack, AsyncExitStack()
        await stack.aclose()


_PROBE_TIMEOUT = 30.0
"""Seconds a session may take to answer ``:`` before it is taken for dead and replaced."""


async def _unexport_in(session: ShellSession, names: Sequence[str]) -> None:
    """Stop exporting ``names`` in ``session`` (the shell keeps their values).

    Raises:
        ShellSessionError: the prelude failed or did not finish.
    """
    try:
        done = await session.run(_unexport(names), timeout=_PROBE_TIMEOUT)
    except (ExecTimeoutError, OutputLimitExceededError) as exc:
        raise ShellSessionError(f"the session's setup did not finish: {exc}") from exc
    if done.exit_code != 0:
        raise ShellSessionError(f"the session's setup failed: {done.stderr.strip()}")


class BashHarness(Harness):
    """An agent loop on the host whose ``bash`` tool runs through ``runtime.exec``."""

    id = "bash"
    config_model = BashConfig

    def __init__(self, config: HarnessConfig | None = None):
        super().__init__(config)
        self.config: BashConfig
        self._shells: weakref.WeakKeyDictionary[Runtime, str] = weakref.WeakKeyDictionary()
        self._hooks: list[CommandHook] = []
        self._user_for: Callable[[str], str | None] | None = None

    def set_command_user(self, user_for: Callable[[str], str | None]) -> bool:
        """Run each command as ``user_for(command)`` instead of the ``user`` setting (a
        judge's commands that write its verdict as the judge's account, the rest as the
        policy's). Returns ``True``; a persistent shell (``persistent_shell``) is one
        process and keeps the ``user`` setting.
        """
        self._user_for = user_for
        return True

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
        messages = task_messages(task, self._system_prompt())
        trace = self.new_trace(model)
        clock = BudgetClock(budget or Budget(), trace)
        async with ChatClient(model) as client:
            with anyio.move_on_after(clock.remaining_seconds()) as scope:
                try:
                    async with self._commands(sandbox) as commands:
                        await self._loop(client, sandbox, commands, messages, trace, clock)
                except (SandboxUnavailableError, SandboxTransportError) as exc:
                    trace.fail("sandbox_error", f"{sandbox.describe()}: {exc}", exc)
                except _HookFailed as exc:
                    message = f"{sandbox.describe()}: after a command: {exc.cause}"
                    trace.fail("sandbox_error", message, exc.cause)
                except _SessionUnavailable as exc:
                    message = f"{sandbox.describe()}: no shell session: {exc.cause}"
                    trace.fail("sandbox_error", message, exc.cause)
        if scope.cancelled_caught:
            clock.record_time_out()
        return trace.finish()

    def _system_prompt(self) -> str | None:
        prompt = self.config.system_prompt
        if self.config.persistent_shell and prompt == DEFAULT_SYSTEM_PROMPT:
            return PERSISTENT_SYSTEM_PROMPT
        return prompt

    @asynccontextmanager
    async def _commands(self, runtime: Runtime) -> AsyncIterator[_Commands]:
        """Where this run's commands run; a persistent session is opened here and closed
        when the run ends, however it ends."""
        if not self.config.persistent_shell:
            yield _FreshShells(runtime, await self._shell_for(runtime), self.config, self._user_for)
            return
        shell = _PersistentShell(runtime, self.config)
        try:
            await shell.open()
            yield shell
        finally:
            await shell.close()

    async def _loop(
        self,
        client: ChatClient,
        runtime: Runtime,
        commands: _Commands,
        messages: list[Message],
        trace: Trace,
        clock: BudgetClock,
    ) -> None:
        tool = PERSISTENT_BASH_TOOL if self.config.persistent_shell else BASH_TOOL
        while not clock.record_exhaustion():
            turn = await call_model(client, messages, trace, tools=[tool])
            if turn.reply is None:
                return
            if not turn.reply.tool_calls:
                trace.output = turn.reply.content
                return
            messages.append(turn.reply.assistant_message())
            await self._run_tools(runtime, commands, turn, messages)

    async def _run_tools(
        self, runtime: Runtime, commands: _Commands, turn: Turn, messages: list[Message]
    ) -> None:
        assert turn.reply is not None
        for call in turn.reply.tool_calls:
            result = await self._run_tool(runtime, commands, call)
            turn.tool_results.append(result)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.output})

    async def _run_tool(self, runtime: Runtime, commands: _Commands, call: ToolCall) -> ToolResult:
        result = ToolResult(call_id=call.id, name=call.name, arguments=call.arguments, output="")
        command = self._command_of(call, result)
        if command is None:
            return result
        started = time.monotonic()
        try:
            done = await commands.run(command)
        except ExecTimeoutError as exc:
            result.timed_out = True
            result.output = self._format(
                f"timed out after {self.config.per_call_timeout}s; {commands.timeout_note}",
                exc.stdout,
                exc.stderr,
            )
        except OutputLimitExceededError as exc:
            result.output = self._format(
                f"{commands.capped_note}: output exceeded {exc.limit} bytes", exc.stdout, exc.stderr
            )
        except ShellSessionError as exc:
            result.output = self._format(
                f"the shell session ended ({exc.reason}); the next command runs in a fresh "
                "shell: the working directory, variables and background jobs are reset",
                exc.stdout_bytes.decode("utf-8", "replace"),
                exc.stderr_bytes.decode("utf-8", "replace"),
            )
        except (SandboxUnavailableError, SandboxTransportError, _SessionUnavailable):
            raise
        except SandboxError as exc:
            # A bad cwd or user, an argument the runtime refuses: the model can react.
            result.output = f"error: the command could not be run: {exc}"
        else:
            result.exit_code = done.exit_code
            result.output = self._format(f"exit_code: {done.exit_code}", done.stdout, done.stderr)
        notice = commands.pop_notice()
        if notice is not None:
            result.output = f"{notice}\n{result.output}"
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
    """``bash`` if the sandbox has it on the ``PATH`` its commands get, else ``sh``. The
    probe itself is the machinery's ``sh`` (fixed ``PATH``, cwd ``/``); it only looks the
    name up in the caller's ``PATH``, it runs nothing from there."""
    search = runtime.config.env.get("PATH", MACHINERY_PATH)
    try:
        probe = await run_machinery(
            runtime, ["sh", "-c", "PATH=$1; command -v bash", "sh", search], timeout=30
        )
    except SandboxFileNotFoundError:
        return "bash"  # no sh either: let each call report the missing shell
    return "bash" if probe.exit_code == 0 else "sh"
