"""The tools a trainer's model calls in its sandbox: ``bash``, ``read_file``, ``write_file``,
and whatever a task adds.

One :class:`SandboxTool` is a name, a description, a pydantic model of its arguments and an
``async run(runtime, arguments) -> str``. :func:`call_tool` is the one place a tool call
crosses into the sandbox, for every adapter (OpenEnv sessions, TRL environments)::

    outcome = await call_tool(runtime, DEFAULT_TOOLS, "bash", {"command": "ls"})
    outcome.output, outcome.error          # error: None, or what the model should see

What the model did wrong is a result, so it can learn from it: a command that exits non-zero
or times out, a file that does not exist. What the *caller* did wrong, or what broke under
it, is an exception: an unknown tool name (:class:`ToolNotFoundError`, a ``KeyError``),
arguments that do not match the tool (:class:`ToolArgumentsError`, a ``ValueError``: OpenEnv's
MCP bridge maps the two to ``METHOD_NOT_FOUND`` and ``INVALID_PARAMS``), a sandbox that died
(:class:`~runtimes.errors.SandboxUnavailableError`) or whose channel broke
(:class:`~runtimes.errors.SandboxTransportError`). Never a silent empty result.

Every command runs as the runtime's policy account (:attr:`~runtimes.base.Runtime.policy_user`)
where it keeps one: the model is the policy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtimes import Runtime
from runtimes.errors import (
    ExecTimeoutError,
    OutputLimitExceededError,
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
)

__all__ = [
    "DEFAULT_TOOLS",
    "BashArgs",
    "ReadFileArgs",
    "SandboxTool",
    "ToolArgumentsError",
    "ToolError",
    "ToolLimits",
    "ToolNotFoundError",
    "ToolOutcome",
    "WriteFileArgs",
    "call_tool",
    "tool_specs",
]


class ToolError(Exception):
    """Base of the errors a tool call raises at its caller."""


class ToolNotFoundError(ToolError, KeyError):
    """The session has no tool of that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown tool"


class ToolArgumentsError(ToolError, ValueError):
    """The arguments do not match the tool's model (a missing field, a wrong type)."""


@dataclass(frozen=True)
class ToolLimits:
    """Bounds on one tool call: wall time, output kept, bytes a file tool moves."""

    timeout: float = 60.0
    output_chars: int = 16_000
    """What the model sees of a command's output (the rest is cut, marked)."""
    output_limit: int = 1_048_576
    """Bytes of stdout + stderr the sandbox may send back before the command is cut."""
    file_bytes: int = 1_048_576
    """Bytes ``read_file`` reads and ``write_file`` writes at most."""


@dataclass(frozen=True)
class ToolOutcome:
    """What one tool call gave the model: ``output``, and ``error`` when the call failed
    in a way the model should see (non-zero exit, timeout, a missing file)."""

    output: str
    error: str | None = None
    exit_code: int | None = None


class BashArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    command: str = Field(description="the shell command to run", min_length=1)


class ReadFileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(
        description="the file to read, relative to the working directory", min_length=1
    )


class WriteFileArgs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str = Field(
        description="the file to write, relative to the working directory", min_length=1
    )
    content: str = Field(description="the text to write")


ToolRun = Callable[[Runtime, Any, ToolLimits], Awaitable[ToolOutcome]]


@dataclass(frozen=True)
class SandboxTool:
    """One tool: ``run(runtime, arguments, limits)`` gets the validated ``arguments``
    (an instance of ``parameters``) and returns a :class:`ToolOutcome`."""

    name: str
    description: str
    parameters: type[BaseModel]
    run: ToolRun

    def schema(self) -> dict[str, Any]:
        """The JSON schema of the arguments (``properties``, ``required``), for tool specs."""
        schema = self.parameters.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        return schema


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


async def _bash(runtime: Runtime, args: BashArgs, limits: ToolLimits) -> ToolOutcome:
    try:
        result = await runtime.exec(
            ["bash", "-c", args.command],
            timeout=limits.timeout,
            user=runtime.policy_user,
            output_limit=limits.output_limit,
        )
    except ExecTimeoutError as exc:
        partial = (exc.stdout or "") + (exc.stderr or "")
        return ToolOutcome(
            _cut(partial, limits.output_chars),
            f"timed out after {limits.timeout}s; the command was killed",
        )
    except OutputLimitExceededError as exc:
        return ToolOutcome(
            "", f"output over {limits.output_limit} bytes; the command was cut ({exc})"
        )
    output = _cut(result.stdout + result.stderr, limits.output_chars)
    error = None if result.exit_code == 0 else f"exit code {result.exit_code}"
    return ToolOutcome(output, error, result.exit_code)


_MODEL_FILE_ERRORS = (
    SandboxFileNotFoundError,
    SandboxIsADirectoryError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
)


async def _as_policy(
    runtime: Runtime, argv: list[str], limits: ToolLimits, stdin: bytes | None = None
) -> tuple[int, bytes, str]:
    result = await runtime.exec(
        argv,
        timeout=limits.timeout,
        user=runtime.policy_user,
        stdin=stdin,
        output_limit=limits.file_bytes + 65_536,
    )
    return result.exit_code, result.stdout_bytes, result.stderr


async def _read_file(runtime: Runtime, args: ReadFileArgs, limits: ToolLimits) -> ToolOutcome:
    if runtime.policy_user is None:
        try:
            data = await runtime.read(args.path, max_bytes=limits.file_bytes)
        except _MODEL_FILE_ERRORS as exc:
            return ToolOutcome("", f"{type(exc).__name__}: {exc}")
        except OutputLimitExceededError:
            return ToolOutcome("", f"the file is over {limits.file_bytes} bytes")
    else:
        # The policy's account reads, so the model sees exactly what the policy could.
        code, data, err = await _as_policy(
            runtime, ["head", "-c", str(limits.file_bytes + 1), "--", args.path], limits
        )
        if code != 0:
            return ToolOutcome("", err.strip() or f"exit code {code}")
        if len(data) > limits.file_bytes:
            return ToolOutcome("", f"the file is over {limits.file_bytes} bytes")
    return ToolOutcome(_cut(data.decode("utf-8", "replace"), limits.output_chars))


async def _write_file(runtime: Runtime, args: WriteFileArgs, limits: ToolLimits) -> ToolOutcome:
    data = args.content.encode()
    if len(data) > limits.file_bytes:
        return ToolOutcome("", f"the content is over {limits.file_bytes} bytes")
    if runtime.policy_user is None:
        try:
            await runtime.write(args.path, data)
        except _MODEL_FILE_ERRORS as exc:
            return ToolOutcome("", f"{type(exc).__name__}: {exc}")
    else:
        code, _, err = await _as_policy(
            runtime,
            ["sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", args.path],
            limits,
            stdin=data,
        )
        if code != 0:
            return ToolOutcome("", err.strip() or f"exit code {code}")
    return ToolOutcome(f"wrote {len(data)} bytes to {args.path}")


BASH = SandboxTool(
    "bash", "Run a shell command in the sandbox and return its output.", BashArgs, _bash
)
READ_FILE = SandboxTool("read_file", "Read a text file in the sandbox.", ReadFileArgs, _read_file)
WRITE_FILE = SandboxTool(
    "write_file", "Write a text file in the sandbox (parents are made).", WriteFileArgs, _write_file
)
DEFAULT_TOOLS: tuple[SandboxTool, ...] = (BASH, READ_FILE, WRITE_FILE)


def tool_specs(tools: Sequence[SandboxTool]) -> list[dict[str, Any]]:
    """The tools in OpenAI's function format (what chat templates and OpenEnv render)."""
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.schema()},
        }
        for t in tools
    ]


def find_tool(tools: Sequence[SandboxTool], name: object) -> SandboxTool:
    """Raises: ToolNotFoundError."""
    for tool in tools:
        if tool.name == name:
            return tool
    known = ", ".join(t.name for t in tools)
    raise ToolNotFoundError(f"no tool named {str(name)[:80]!r}; this session has: {known}")


async def call_tool(
    runtime: Runtime,
    tools: Sequence[SandboxTool],
    name: str,
    arguments: Mapping[str, Any] | None,
    limits: ToolLimits = ToolLimits(),
) -> ToolOutcome:
    """Run tool ``name`` with ``arguments`` in ``runtime``.

    Raises:
        ToolNotFoundError: no tool of that name.
        ToolArgumentsError: the arguments are not a mapping matching the tool's model.
        SandboxUnavailableError / SandboxTransportError: the sandbox died, or its channel
            failed (what ``runtime.exec`` raises; a dead sandbox is never an empty result).
    """
    tool = find_tool(tools, name)
    if not isinstance(arguments, Mapping):
        raise ToolArgumentsError(
            f"tool {name!r} takes a JSON object of arguments, got {type(arguments).__name__}"
        )
    try:
        parsed = tool.parameters.model_validate(dict(arguments))
    except ValidationError as exc:
        raise ToolArgumentsError(f"tool {name!r}: {exc.errors(include_url=False)}") from None
    return await tool.run(runtime, parsed, limits)
