"""``vf-sandbox exec``: one command in a fresh sandbox, behaving like a local command.

stdin is forwarded when it is not a terminal, output is streamed to the matching host
stream as it arrives (and not kept: a stream of any length costs constant memory, so it is
not capped unless ``--output-limit`` or the config's own ``output_limit`` asks), and the
exit status follows shell conventions (table in docs/cli.md). Ctrl-C cancels the run: the
sandbox is closed (removed) before exiting 130.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from pydantic import ValidationError

from runtimes import (
    ExecTimeoutError,
    OutputLimitExceededError,
    RuntimeConfig,
    RuntimeConfigError,
    SandboxFileNotFoundError,
    SandboxPermissionError,
    SandboxResourceError,
    open_runtime,
)
from runtimes.config import config_error_from_validation
from runtimes.errors import names_the_program
from runtimes.models import Stream
from runtimes.processes import UNCAPPED
from runtimes.resources import byte_count

from .commands import CommandFactory
from .output import say
from .shell import keep_config, kept_notices
from .targets import parse_runtime

T = TypeVar("T")

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 124
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a local command killed by a closed pipe reports


class Interrupted(Exception):
    """Ctrl-C (SIGINT) stopped the run after its cleanup ran."""


def parse_env(text: str) -> tuple[str, str]:
    """``--env K=V`` as a pair; anything without a name before ``=`` is a usage error."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def parse_size(text: str) -> int:
    """``--output-limit SIZE``: bytes, or a size with a unit (``64KiB``, ``1GiB``: the units
    of a config's ``memory`` and ``output_limit``); anything else is a usage error."""
    try:
        size: object = byte_count(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not isinstance(size, int) or size <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above 0 like '1GiB', got {text!r}")
    return size


def with_image(config: RuntimeConfig, image: str | None) -> RuntimeConfig:
    """``config`` with its ``image`` set to ``image`` (``exec --image``), validated again.

    Raises:
        RuntimeConfigError: the backend's config has no ``image`` field, or the image is
            invalid for it.
    """
    if image is None:
        return config
    model = type(config)
    if "image" not in model.model_fields:
        raise RuntimeConfigError(
            f"--image: the {config.type!r} backend's config has no image "
            "(the docker and modal backends' have one: --runtime docker --image IMAGE)",
            [{"type": "value_error", "loc": ("image",), "msg": "the config has no image"}],
        )
    data = {**config.model_dump(exclude_unset=True), "type": config.type, "image": image}
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise config_error_from_validation(config.type, exc, model) from None


def stream_limit(config: RuntimeConfig, asked: int | None) -> int:
    """The cap on ``exec``'s streamed output: ``--output-limit``, else the config's
    ``output_limit`` when the config sets one, else none
    (:data:`~runtimes.processes.UNCAPPED`: the output is passed on, never kept)."""
    if asked is not None:
        return asked
    if "output_limit" in config.model_fields_set:
        return config.output_limit
    return UNCAPPED


def strip_separator(argv: list[str]) -> list[str]:
    """Drop the first ``--`` only: later ones belong to the command."""
    return argv[1:] if argv[:1] == ["--"] else argv


def read_piped_stdin() -> bytes | None:
    """All of stdin when it is a pipe or a file; ``None`` for a terminal (never read)."""
    stream = sys.stdin
    if stream is None or stream.closed or stream.isatty():
        return None
    return stream.buffer.read()


def write_output(stream: Stream, chunk: bytes) -> None:
    """The command's own output, byte-exact (escaped it would no longer be what it printed)."""
    target = sys.stdout.buffer if stream == "stdout" else sys.stderr.buffer
    target.write(chunk)
    target.flush()


async def run_interruptible(body: Callable[[], Awaitable[T]]) -> T:
    """Run ``body``; a SIGINT cancels it (its ``async with`` cleanup runs) and raises
    :class:`Interrupted` afterwards. Further SIGINTs during that cleanup are ignored."""
    interrupted = False
    failure: Exception | None = None
    outcome: list[T] = []
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def cancel_on_sigint() -> None:
                nonlocal interrupted
                async for _ in signals:
                    interrupted = True
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(cancel_on_sigint)
            try:
                outcome.append(await body())
            except Exception as exc:  # noqa: BLE001 - re-raised below unless Ctrl-C caused it
                failure = exc
            finally:
                tg.cancel_scope.cancel()
    if interrupted:
        raise Interrupted
    if failure is not None:
        raise failure
    return outcome[0]


async def exec_in_fresh_sandbox(
    config: RuntimeConfig, args: argparse.Namespace, stdin: bytes | None
) -> int:
    """Open a sandbox, run the command streaming its output (never kept), close the sandbox.

    Returns the command's exit code, or 127/126 (message printed) when the program is
    missing or not executable.

    Raises:
        ExecTimeoutError, SandboxError: as :meth:`runtimes.Runtime.exec` and the
            backend's start and close.
    """
    argv: list[str] = args.argv
    async with open_runtime(config) as rt:
        try:
            result = await rt.exec(
                argv,
                timeout=args.timeout,
                cwd=args.cwd,
                env=dict(args.env or []),
                stdin=stdin,
                user=args.user,
                output_limit=stream_limit(config, args.output_limit),
                on_output=write_output,
                keep_output=False,
            )
        except SandboxFileNotFoundError as exc:
            if not names_the_program(exc, argv, args.cwd, rt.workdir):
                raise
            say(f"vf-sandbox: {argv[0]}: program not found", stderr=True)
            return EXIT_NOT_FOUND
        except SandboxPermissionError as exc:
            if not names_the_program(exc, argv, args.cwd, rt.workdir):
                raise
            say(f"vf-sandbox: {argv[0]}: permission denied (not executable)", stderr=True)
            return EXIT_NOT_EXECUTABLE
    return result.exit_code


def run_exec(config: RuntimeConfig, args: argparse.Namespace) -> int:
    """The whole ``exec`` command once its arguments are parsed.

    Raises:
        Interrupted: Ctrl-C; the sandbox was closed first.
        SandboxError: anything else the backend raised (timeouts are turned into 124, an
            output over ``--output-limit`` into 1 with a message).
    """
    stdin = read_piped_stdin()
    try:
        return anyio.run(run_interruptible, lambda: exec_in_fresh_sandbox(config, args, stdin))
    except ExecTimeoutError as exc:
        say(f"vf-sandbox: {exc}", stderr=True)
        return EXIT_TIMEOUT
    except SandboxResourceError as exc:  # its output was streamed already; exit like the kill
        say(f"vf-sandbox: {exc}", stderr=True)
        return exc.exit_code
    except OutputLimitExceededError as exc:  # what fitted was streamed already
        say(
            f"vf-sandbox: {exc} (the command was killed; raise it with --output-limit)", stderr=True
        )
        return EXIT_ERROR


def cmd_exec(args: argparse.Namespace) -> int:
    with kept_notices():
        config = with_image(parse_runtime(args.runtime), args.image)
        return run_exec(keep_config(config, args.keep), args)


def add_exec_command(command: CommandFactory) -> None:
    """Register ``exec`` with ``build_parser``'s ``command``."""
    exec_ = command(
        "exec",
        "run one command in a fresh sandbox",
        "Run ARGV in a fresh sandbox, then remove it. Piped stdin is forwarded, output is\n"
        "streamed as it comes. Exit: the command's code; 124 timeout, 126 not executable,\n"
        "127 not found, 130 Ctrl-C, 2 usage, 1 other errors.\n\n"
        "example: vf-sandbox exec --env A=1 -- sh -c 'echo $A'",
    )
    exec_.add_argument(
        "--runtime",
        default="subprocess",
        help="a type name or a JSON config (default: %(default)s)",
    )
    exec_.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="kill the command's process tree after SECONDS (exit 124)",
    )
    exec_.add_argument(
        "--env",
        action="append",
        type=parse_env,
        metavar="NAME=VALUE",
        help="set a variable for the command (repeatable)",
    )
    exec_.add_argument(
        "--cwd", help="working directory: absolute, or relative to the sandbox workdir"
    )
    exec_.add_argument("--user", help="run as this user inside the sandbox")
    exec_.add_argument(
        "--image",
        help="run in this image: sets the image of the --runtime config (docker, modal)",
    )
    exec_.add_argument(
        "--output-limit",
        type=parse_size,
        metavar="SIZE",
        help="kill the command once stdout + stderr pass SIZE (bytes, or 64KiB, 1GiB...; "
        "default: no cap, the output is streamed, not kept; exit 1)",
    )
    exec_.add_argument(
        "--keep",
        action="store_true",
        help="keep the sandbox running afterwards (its id and `vf-sandbox shell` on stderr)",
    )
    exec_.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- ARGV",
        help="the command and its arguments, after the first --",
    )
    exec_.set_defaults(func=cmd_exec)
