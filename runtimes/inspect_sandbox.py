"""Every vf-sandbox backend as an inspect_ai sandbox, named ``vf``.

Install ``vf-sandbox[inspect]``; inspect finds this module through its ``inspect_ai`` entry
point. A task then says ``sandbox=("vf", {"type": "docker", "image": "..."})`` (any runtime
config of :func:`runtimes.open_runtime`), ``sandbox=("vf", "vf-sandbox.yaml")`` (a YAML or
JSON file holding one), ``sandbox=("vf", "ssh")`` (a bare backend name) or just
``sandbox="vf"`` (a ``vf-sandbox.yaml`` beside the task, else the subprocess runtime).
``docs/inspect.md`` has the mapping of inspect's contract onto vf-sandbox's, what differs and
why.

The provider acts as the policy: where the runtime keeps a policy account
(:attr:`~runtimes.base.Runtime.policy_user`: ``vf-policy`` on Docker and Modal by default),
``exec`` without ``user=`` (inspect's ``bash()``, ``python()``, ``read_file`` tools...),
``read_file`` and ``write_file`` run as that account; ``exec(user="root")`` asks for more.

Each sample gets one fresh sandbox (``sample_init``), closed at ``sample_cleanup``; what an
interrupted eval left open is closed by ``task_cleanup``; ``inspect sandbox cleanup vf``
sweeps what a dead eval process leaked. Solvers that want vf-sandbox's own API reach the
runtime as ``sandbox().as_type(VfSandboxEnvironment).runtime``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal, overload

import yaml
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    concurrency,
    sandboxenv,
)
from inspect_ai.util import SandboxUnavailableError as InspectUnavailableError
from inspect_ai.util._sandbox.environment import SandboxUserUnsupportedError
from pydantic import BaseModel
from typing_extensions import override

from . import ownership
from .base import Runtime
from .cleanup import SweepResult, cleanup_sandboxes
from .config import RuntimeConfig, RuntimeConfigError
from .errors import (
    OutputLimitExceededError as VfOutputLimitExceededError,
)
from .errors import (
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxResourceError,
    SandboxTransportError,
    SandboxUnavailableError,
    SandboxUserNotFoundError,
    SandboxUserRefusedError,
    names_the_program,
)
from .inspect_files import read_as, write_as
from .locate import find_sandbox
from .models import Stream
from .registry import open_runtime, resolve_runtime_config
from .terminal import terminal_safe

__all__ = ["INSPECT_LABEL", "TASK_LABEL", "VfSandboxEnvironment", "load_config"]

log = logging.getLogger("runtimes.inspect_sandbox")

INSPECT_LABEL = ownership.LABEL_PREFIX + "inspect"
"""Carried (``"true"``) by every sandbox this provider creates: what ``cli_cleanup`` sweeps."""
TASK_LABEL = ownership.LABEL_PREFIX + "inspect-task"
"""The inspect task a sandbox was created for."""

CONFIG_FILES = ("vf-sandbox.yaml", "vf-sandbox.yml", "vf-sandbox.json")
_FILE_SUFFIXES = (".yaml", ".yml", ".json")
_DEFAULT_CONFIG = "subprocess"


def load_config(config: SandboxEnvironmentConfigType | Mapping[str, Any] | None) -> RuntimeConfig:
    """The runtime config an inspect sandbox spec stands for: a config model, a dict, a
    ``.yaml``/``.yml``/``.json`` file (relative to the current directory, which inspect sets
    to the task's), a bare backend name, or ``None`` (the subprocess runtime).

    Raises:
        RuntimeConfigError: the file is missing or malformed, or the config is invalid.
        UnknownRuntimeError, RuntimePluginError: as :func:`runtimes.resolve_runtime_config`.
    """
    if config is None:
        return resolve_runtime_config(_DEFAULT_CONFIG)
    if isinstance(config, RuntimeConfig):
        return config
    if isinstance(config, str):
        if config.endswith(_FILE_SUFFIXES):
            return resolve_runtime_config(_read_config_file(Path(config)))
        return resolve_runtime_config(config)
    if isinstance(config, BaseModel):
        return resolve_runtime_config(config.model_dump())
    return resolve_runtime_config(config)


def _read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RuntimeConfigError(f"cannot read the vf sandbox config {str(path)!r}: {exc}") from exc
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise RuntimeConfigError(
            f"the vf sandbox config {str(path)!r} is malformed: {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise RuntimeConfigError(
            f"the vf sandbox config {str(path)!r} must hold a mapping with a 'type', "
            f"not {type(data).__name__}"
        )
    return data


class _OpenSandboxes:
    """The runtimes ``sample_init`` opened that no ``sample_cleanup`` closed yet, for
    ``task_cleanup`` (one per inspect sandbox lifecycle scope: one eval batch)."""

    def __init__(self) -> None:
        self.entries: list[tuple[SandboxEnvironmentConfigType | None, Runtime]] = []

    def add(self, config: SandboxEnvironmentConfigType | None, runtime: Runtime) -> None:
        self.entries.append((config, runtime))

    def discard(self, runtime: Runtime) -> None:
        self.entries = [(c, rt) for c, rt in self.entries if rt is not runtime]

    def take(self, config: SandboxEnvironmentConfigType | None) -> list[Runtime]:
        taken = [rt for c, rt in self.entries if c == config]
        self.entries = [(c, rt) for c, rt in self.entries if c != config]
        return taken


_outside_any_scope = _OpenSandboxes()


def _open_sandboxes() -> _OpenSandboxes:
    # inspect keeps per-batch provider state on a lifecycle scope (two evals in one process
    # must not close each other's sandboxes); outside an eval there is none.
    try:
        from inspect_ai.util._sandbox.lifecycle import sandbox_lifecycle_state
    except ImportError:  # an inspect_ai without lifecycle scopes
        return _outside_any_scope
    scope = sandbox_lifecycle_state()
    return scope.get(_OpenSandboxes) if scope is not None else _outside_any_scope


@sandboxenv(name="vf")
class VfSandboxEnvironment(SandboxEnvironment):
    """One vf-sandbox runtime (any backend) behind inspect's ``SandboxEnvironment``."""

    def __init__(self, runtime: Runtime) -> None:
        super().__init__()
        self._runtime = runtime

    @property
    def runtime(self) -> Runtime:
        """The vf-sandbox runtime behind this sandbox (streaming exec, shell sessions,
        uploads and downloads, typed errors). Its own ``exec`` runs as the sandbox's
        default user unless given ``user=runtime.policy_user``."""
        return self._runtime

    @property
    def policy_user(self) -> str | None:
        """Who inspect's operations run as when they name no user: the runtime's policy
        account, or ``None`` (the sandbox's default user) where it keeps none."""
        return self._runtime.policy_user

    # ------------------------------------------------------------------ lifecycle

    @override
    @classmethod
    def config_files(cls) -> list[str]:
        return list(CONFIG_FILES)

    @override
    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return load_config(config)

    @override
    @classmethod
    def default_concurrency(cls) -> int | None:
        # as inspect's docker sandbox: twice the processors this process may use
        return 2 * max(1, len(os.sched_getaffinity(0)))

    @override
    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        # a bad config (or a broken backend plugin) fails the eval at startup, not per sample
        load_config(config)

    @override
    @classmethod
    async def sample_init(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        metadata: dict[str, str],
    ) -> dict[str, SandboxEnvironment]:
        resolved = load_config(config)
        labels = {**resolved.labels, INSPECT_LABEL: "true", TASK_LABEL: task_name}
        runtime = open_runtime(resolved.model_copy(update={"labels": labels}))
        await runtime.start()
        _open_sandboxes().add(config, runtime)
        return {"default": cls(runtime)}

    @override
    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        registry = _open_sandboxes()
        for environment in environments.values():
            runtime = environment.as_type(VfSandboxEnvironment).runtime
            registry.discard(runtime)
            await _close(runtime)

    @override
    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool
    ) -> None:
        left = _open_sandboxes().take(config)
        if cleanup:
            for runtime in left:
                await _close(runtime)
            return
        for runtime in left:  # --no-sandbox-cleanup: leave them for the user to look at
            try:
                runtime.keep_at_close()
            except RuntimeConfigError as exc:
                log.warning("%s cannot be left running: %s", runtime.describe(), exc)
                await _close(runtime)
                continue
            log.warning(
                "left %s running (--no-sandbox-cleanup); remove it with "
                "`inspect sandbox cleanup vf %s`",
                runtime.describe(),
                runtime.sandbox_id,
            )

    @override
    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup vf [ID]``: remove sandbox ``ID`` (its id or a unique
        prefix, on any backend's default place), or every sandbox this provider created
        whose eval process has ended, kept ones included (sandboxes of running evals are
        spared, kept or not).

        Raises:
            SandboxUnavailableError: no sandbox ``ID``.
            SandboxInvalidArgumentError: ``ID`` is empty or the prefix of several ids.
            SandboxError: the backend failed to remove sandbox ``ID`` (a sweep without an
                id reports each failure as a ``failed`` line instead).
        """
        if id is not None:
            backend, config, info = await find_sandbox(id)
            await backend.destroy_sandbox(info, config)
            print(terminal_safe(f"removed {backend.name} sandbox {info.id}"))
            return
        results = await _sweep_ended_evals()
        for result in results:
            print(terminal_safe(_sweep_line(result)))
        if not results:
            print("no vf sandboxes made by inspect were found")

    # ------------------------------------------------------------------ operations

    @override
    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        # timeout_retry: inspect's docker sandbox retries only when the docker CLI itself
        # hangs. vf-sandbox's exec never hangs on its transport (that is a typed error), and
        # a command's own timeout is never retried: the command may not be idempotent.
        async with self._throttle(concurrency):
            return await self._exec(cmd, input, cwd, env, user, timeout)

    async def _exec(
        self,
        cmd: list[str],
        input: str | bytes | None,
        cwd: str | None,
        env: dict[str, str] | None,
        user: str | None,
        timeout: int | None,
    ) -> ExecResult[str]:
        capture = _PerStreamCapture(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE)
        try:
            result = await self._runtime.exec(
                cmd,
                stdin=input,
                cwd=cwd,
                env=env,
                user=user or self.policy_user,
                timeout=timeout,
                output_limit=2 * capture.limit + 1,
                on_output=capture,
                keep_output=False,
            )
        except _StreamOverLimit as exc:
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, capture.text(exc.stream)
            ) from None
        except SandboxFileNotFoundError as exc:  # inspect: a missing program is a result
            missing_program = names_the_program(exc, cmd, cwd, self._runtime.workdir)
            return _failed(127 if missing_program else 126, capture, str(exc))
        except SandboxUserNotFoundError as exc:
            return _failed(126, capture, str(exc))
        except SandboxUserRefusedError as exc:
            raise SandboxUserUnsupportedError(str(exc)) from exc
        except SandboxResourceError as exc:
            return _failed(exc.exit_code, capture, str(exc))
        except VfOutputLimitExceededError as exc:
            raise OutputLimitExceededError(
                SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, exc.stdout
            ) from exc
        except (SandboxUnavailableError, SandboxTransportError) as exc:
            raise InspectUnavailableError(str(exc)) from exc
        return ExecResult(
            success=result.exit_code == 0,
            returncode=result.exit_code,
            stdout=capture.text("stdout"),
            stderr=capture.text("stderr"),
        )

    def _throttle(self, requested: bool) -> contextlib.AbstractAsyncContextManager[object]:
        # inspect throttles the processes it starts on this machine; only the subprocess
        # backend's commands are that.
        if not requested or self._runtime.name != "subprocess":
            return contextlib.nullcontext()
        return concurrency("subprocesses", _max_subprocesses())

    @override
    async def write_file(self, file: str, contents: str | bytes) -> None:
        with _inspect_errors():
            user = self.policy_user
            if user is None:
                await self._runtime.write(file, contents)
            else:
                await write_as(self._runtime, user, file, contents)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    @override
    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        with _inspect_errors():
            user = self.policy_user
            try:
                if user is None:
                    data = await self._runtime.read(file, max_bytes=limit)
                else:
                    data = await read_as(self._runtime, user, file, limit)
            except VfOutputLimitExceededError as exc:
                raise OutputLimitExceededError(
                    SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None
                ) from exc
        # inspect wants text exactly as stored (no newline translation), and a strict
        # decode: UnicodeDecodeError is its contract for a file that is not UTF-8
        return data.decode("utf-8") if text else data

    @override
    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        runtime = self._runtime
        if user is not None:
            raise NotImplementedError(
                "vf sandboxes give a connection as their own user only (user= is not supported)"
            )
        if runtime.closed or runtime.sandbox_id is None:
            raise ConnectionError(f"{runtime.describe()} is not running")
        try:
            backend, config, info = await find_sandbox(runtime.sandbox_id, [runtime.config])
            argv = await backend.shell_argv(info, config, tty=True)
        except SandboxUnavailableError as exc:
            raise ConnectionError(str(exc)) from exc
        except SandboxInvalidArgumentError as exc:  # a backend that cannot open a shell
            raise NotImplementedError(str(exc)) from exc
        return SandboxConnection(
            type=f"vf-{runtime.name}",
            command=shlex.join(argv),
            container=runtime.sandbox_id if runtime.name == "docker" else None,
        )

    @override
    def default_polling_interval(self) -> float:
        return 0.2


class _StreamOverLimit(Exception):
    def __init__(self, stream: Stream):
        super().__init__(stream)
        self.stream: Stream = stream


class _PerStreamCapture:
    """``on_output`` for inspect's limit, which is per stream (vf-sandbox's is on both)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.kept: dict[Stream, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}

    def __call__(self, stream: Stream, chunk: bytes) -> None:
        kept = self.kept[stream]
        room = self.limit - len(kept)
        kept += chunk[: max(room, 0)]
        if len(chunk) > room:
            raise _StreamOverLimit(stream)  # kills the command's tree

    def text(self, stream: Stream) -> str:
        return self.kept[stream].decode("utf-8", "replace")


def _failed(code: int, capture: _PerStreamCapture, message: str) -> ExecResult[str]:
    stderr = capture.text("stderr")
    return ExecResult(
        success=False,
        returncode=code,
        stdout=capture.text("stdout"),
        stderr=f"{stderr}{message}\n"
        if not stderr or stderr.endswith("\n")
        else f"{stderr}\n{message}\n",
    )


@contextlib.contextmanager
def _inspect_errors() -> Iterator[None]:
    """vf-sandbox's file errors are already inspect's builtins (``FileNotFoundError``, ...);
    a dead sandbox or a failed transport becomes inspect's ``SandboxUnavailableError``."""
    try:
        yield
    except (SandboxUnavailableError, SandboxTransportError) as exc:
        raise InspectUnavailableError(str(exc)) from exc


async def _close(runtime: Runtime) -> None:
    try:
        await runtime.close()
    except SandboxError as exc:  # the backend could not confirm removal: the sweep will
        log.warning(
            "closing %s failed (%s); `vf-sandbox cleanup` removes it once this process ends",
            runtime.describe(),
            exc,
        )


def _max_subprocesses() -> int:
    try:
        from inspect_ai.util._subprocess import max_subprocesses_context_var

        return max_subprocesses_context_var.get()
    except (ImportError, LookupError):
        return max(1, len(os.sched_getaffinity(0)))


_MADE_HERE = {INSPECT_LABEL: "true"}
_SWEPT_AS_KEPT = "kept, --kept"  # cleanup_sandboxes' reason for kept=True


async def _sweep_ended_evals() -> list[SweepResult]:
    """Remove every sandbox (and snapshot) this provider created whose eval process has
    ended, on every backend's default place; spare those of running evals.

    ``keep=True`` in a task's config keeps a sandbox past its sample for the user to look
    at once the eval is over, as ``--no-sandbox-cleanup`` does (whose sandboxes lack the keep
    label: the first pass takes them once their eval ended), not past this sweep.
    ``cleanup_sandboxes(kept=True)`` would also take the kept sandboxes of running evals,
    so those of an ended eval go in a second pass confined to that eval's session: a
    session id is never reused, so once dead it stays dead.
    """
    first = await cleanup_sandboxes(match=_MADE_HERE)
    ended = sorted({_session_of(result) for result in first if _spared_only_as_kept(result)})
    results = [r for r in first if r.action == "removed" or _session_of(r) not in ended]
    for backend, session in ended:
        swept = await cleanup_sandboxes(
            [backend], match={**_MADE_HERE, ownership.CREATOR: session}, kept=True
        )
        results += [_as_ended_eval(result) for result in swept]
    return results


def _session_of(result: SweepResult) -> tuple[str, str]:
    return result.info.backend, result.info.labels.get(ownership.CREATOR, "")


def _spared_only_as_kept(result: SweepResult) -> bool:
    """Whether a sweep spared a sandbox for its keep label although its eval has ended."""
    labels = result.info.labels
    return (
        result.action == "kept"
        and ownership.is_kept(labels)
        and bool(labels.get(ownership.CREATOR))
        and ownership.creator_is_dead(labels) is True
    )


def _as_ended_eval(result: SweepResult) -> SweepResult:
    if not ownership.is_kept(result.info.labels):
        return result
    reason = result.reason.replace(_SWEPT_AS_KEPT, "kept (keep=True), its eval has ended", 1)
    return replace(result, reason=reason)


def _sweep_line(result: SweepResult) -> str:
    return f"{result.action}: {result.info.backend} sandbox {result.info.id} ({result.reason})"
