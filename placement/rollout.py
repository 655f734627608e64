"""Recorded rollouts on disk, and judging one: what ``vf-sandbox judge`` runs.

A rollout directory holds ``task.json`` (the task; ``prompt`` is shown to judges),
``trace.json`` (the policy's :class:`~harnesses.base.Trace`) and ``files/`` (the world the
policy left: uploaded into the judging sandbox's workdir before any judge runs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harnesses.base import Trace
from harnesses.errors import HarnessConfigError
from harnesses.llm import ModelEndpoint, ModelTable
from harnesses.scripted import ScriptedEndpoint, load_script_file
from runtimes import RuntimeConfig
from runtimes.pool import RuntimePool, open_pooled

from .errors import PlacementConfigError, RecordInvalid
from .run import AgentRun, run_judges
from .specs import JudgeSpec
from .traces import MAX_TRACE_BYTES, load_trace


@dataclass(frozen=True)
class Rollout:
    task: dict[str, Any]
    trace: Trace
    files: Path | None


def load_rollout(directory: str | Path) -> Rollout:
    """The rollout in ``directory``: ``task.json``, ``trace.json`` (any shape
    :func:`~placement.traces.load_trace` reads: a ``Trace``, ``{"messages": [...]}``,
    TRL's ``prompt``/``completion``, a list of messages) and ``files/``.

    Raises:
        PlacementConfigError: a missing or malformed task.json / trace.json; for a trace,
            what :func:`~placement.traces.load_trace` refuses (an unknown key, a message
            with no place in a trace, over a cap), with where.
    """
    root = Path(directory)
    try:
        task = json.loads((root / "task.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: JSON, UTF-8
        raise PlacementConfigError(f"{root} is not a readable rollout: {exc}") from None
    try:
        with (root / "trace.json").open("rb") as stream:
            trace = load_trace(stream.read(MAX_TRACE_BYTES + 1))
    except OSError as exc:
        raise PlacementConfigError(f"{root} is not a readable rollout: {exc}") from None
    except RecordInvalid as exc:
        raise PlacementConfigError(f"{root}/trace.json: {exc}") from None
    if not isinstance(task, dict):
        raise PlacementConfigError(f"{root}/task.json must hold a JSON object")
    files = root / "files"
    return Rollout(task, trace, files if files.is_dir() else None)


@contextmanager
def scripted_models(
    judges: Sequence[JudgeSpec], script_file: str | Path
) -> Iterator[tuple[list[JudgeSpec], ModelTable]]:
    """One scripted endpoint per judge, replaying ``{judge name: [items]}`` from a file.

    Each judge is pointed at its own endpoint (its ``model`` becomes ``scripted-<name>``),
    so judges running concurrently never take each other's replies. The file's format is
    :class:`~harnesses.scripted.ScriptFile` (docs/cli.md, "The `--scripted` replies file").

    Raises:
        PlacementConfigError: the file cannot be read, an entry is malformed (named, with
            the field: :func:`~harnesses.scripted.load_script_file`), or a judge has no
            script.
    """
    try:
        scripts = load_script_file(Path(script_file).read_bytes(), str(script_file))
    except HarnessConfigError as exc:
        raise PlacementConfigError(str(exc)) from None
    except OSError as exc:
        raise PlacementConfigError(f"cannot load the script {script_file}: {exc}") from None
    missing = [j.name for j in judges if j.name not in scripts]
    if missing:
        raise PlacementConfigError(f"{script_file} has no script for judges {missing}")
    with ExitStack() as stack:
        table: dict[str, ModelEndpoint] = {}
        rewired = []
        for judge in judges:
            server = stack.enter_context(ScriptedEndpoint(scripts[judge.name]))
            name = f"scripted-{judge.name}"
            table[name] = server.endpoint()
            rewired.append(judge.model_copy(update={"model": name}))
        yield rewired, ModelTable(models=table)


def environment_models(judges: Sequence[JudgeSpec], env: Mapping[str, str]) -> ModelTable:
    """Every judge model served by ``OPENAI_BASE_URL`` (key from ``OPENAI_API_KEY``)."""
    endpoint = ModelEndpoint(
        base_url=env["OPENAI_BASE_URL"],
        api_key_env="OPENAI_API_KEY",
        model=env.get("OPENAI_MODEL", "gpt-4o-mini"),
    )
    return ModelTable(models={j.model: endpoint for j in judges if j.model != "policy"})


async def judge_rollout(
    rollout: Rollout,
    judges: Sequence[JudgeSpec],
    models: ModelTable,
    runtime_config: RuntimeConfig | Mapping[str, Any] | str = "subprocess",
    on_done: Callable[[AgentRun], None] | None = None,
    deadline: float | None = None,
    pools: Sequence[RuntimePool] | None = None,
) -> list[AgentRun]:
    """Recreate the rollout's world in a fresh sandbox and judge it within ``deadline``
    seconds (not strict: failed judges come back as runs with ``error`` set).

    The world's sandbox and every clean-room judge's come from the one of ``pools`` that
    serves their config, when one does (``docs/pools.md``).

    Raises:
        PlacementConfigError: two judges share a name, or ``deadline`` is not positive.
        SandboxError / ProvisioningError: the sandbox could not be made or the world not
            uploaded.
    """
    async with open_pooled(runtime_config, pools) as runtime:
        if rollout.files is not None:
            await runtime.upload(rollout.files, runtime.workdir)
        return await run_judges(
            judges,
            task=rollout.task,
            trace=rollout.trace,
            models=models,
            runtime=runtime,
            strict=False,
            on_done=on_done,
            deadline=deadline,
            pools=pools,
        )


def default_environment() -> Mapping[str, str]:
    return os.environ
