"""inspect_ai sandboxes on Docker (section ``inspect`` of ``python -m benchmarks``).

The same three operations through inspect_ai's ``SandboxEnvironment`` API, each op timed on
its own: ``exec(["true"])``, ``write_file`` of 1 KiB (bytes) and ``read_file`` of it
(``text=False``), on

* inspect's built-in Docker sandbox (``DockerSandboxEnvironment``: every call runs the
  ``docker compose`` CLI) with a compose file of the base image (never pulled: ``x-local``,
  ``pull_policy: never``; ``init``, no network, ``tail -f /dev/null``);
* vf-sandbox's inspect provider (``runtimes.inspect_sandbox.VfSandboxEnvironment``) on Docker,
  with the same image;
* baselines: the Docker SDK on a plain container of the same image (``exec_run``, and
  ``put_archive`` / ``get_archive`` with the tar built or extracted in the call), and inspect's
  ``local`` sandbox (subprocesses and files in a host temp dir).

Each sandbox goes through inspect's own lifecycle (``task_init``, ``sample_init``,
``sample_cleanup``, ``task_cleanup``) outside an eval. inspect's Docker ``task_init`` refuses
a Docker Engine older than 24.0.6: that one check (``validate_docker_engine``) is skipped,
in this process and for the duration of ``task_init`` only; the Compose version check runs.
A variant that cannot run here (no ``docker compose``, no provider) says why in the notes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio.to_thread

from .stats import Call, Measure, Series, interleaved_measures, ms, ratio, table, timed
from .suite import Environment, KiB, _check_channels, _get_archive, _put_archive, _remove

TASK = "vf-bench"
INSPECT_DOCKER = "inspect docker (compose CLI)"
VF = "vf provider, docker"
SDK = "docker SDK"
LOCAL = "inspect local"
VARIANTS = (INSPECT_DOCKER, VF, SDK, LOCAL)
EXEC, WRITE, READ = "exec(['true'])", "write_file 1 KiB", "read_file 1 KiB"
OPS = (EXEC, WRITE, READ)
SDK_OPS = {EXEC: "exec_run", WRITE: "put_archive", READ: "get_archive"}
CONTAINER_PATH = "/tmp/vf-bench-inspect.bin"
COMPOSE = """\
services:
  default:
    image: {image}
    x-local: true
    pull_policy: never
    init: true
    network_mode: none
    command: ["tail", "-f", "/dev/null"]
"""


@dataclass
class Variant:
    """The timed ops of one sandbox kind, or why it could not run; notes on its lifecycle."""

    ops: dict[str, Call] = field(default_factory=dict)
    why: str = ""
    notes: list[str] = field(default_factory=list)


def _failure(what: str, exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{what}: {type(exc).__name__}: {text}"[:400]


def _sandbox_ops(sandbox: Any, path: str, data: bytes) -> dict[str, Call]:
    async def exec_true() -> None:
        result = await sandbox.exec(["true"])
        assert result.success, result

    async def write() -> None:
        await sandbox.write_file(path, data)

    async def read() -> None:
        got = await sandbox.read_file(path, text=False)
        assert got == data, f"read_file gave {len(got)} bytes, wrote {len(data)}"

    return {EXEC: exec_true, WRITE: write, READ: read}


@contextlib.contextmanager
def _engine_version_check_skipped() -> Iterator[None]:
    """inspect's Docker ``task_init`` requires Docker Engine >= 24.0.6 (here 20.10): skip
    that one check (the Compose version is still checked)."""
    from inspect_ai.util._sandbox.docker import prereqs

    original = prereqs.validate_docker_engine

    async def skipped(version: str = prereqs.DOCKER_ENGINE_REQUIRED_VERSION) -> None:
        return None

    prereqs.validate_docker_engine = skipped
    try:
        yield
    finally:
        prereqs.validate_docker_engine = original


def _container_ids(client: Any, **filters: str) -> set[str]:
    return {c.id for c in client.containers.list(all=True, filters=filters or None)}


@contextlib.asynccontextmanager
async def sandbox_variant(
    cls: Any, config: Any, path: str, data: bytes, *, skip_engine_check: bool = False
) -> AsyncIterator[tuple[Variant, Any]]:
    """One sample's sandbox of ``cls`` through inspect's lifecycle, with ``data`` already
    written at ``path``; yields (the variant, the sample's environments or None)."""
    variant = Variant()
    started = time.perf_counter()
    try:
        with _engine_version_check_skipped() if skip_engine_check else contextlib.nullcontext():
            await cls.task_init(TASK, config)
    except Exception as exc:  # noqa: BLE001 - the notes say why the variant did not run
        variant.why = _failure("task_init", exc)
    if variant.why:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await cls.task_cleanup(TASK, config, True)
        yield variant, None
        return
    task_init = time.perf_counter() - started
    environments: dict[str, Any] | None = None
    try:
        started = time.perf_counter()
        try:
            environments = await cls.sample_init(TASK, config, {})
            sample_init = time.perf_counter() - started
            sandbox = environments["default"]
            await sandbox.write_file(path, data)
        except Exception as exc:  # noqa: BLE001 - the notes say why the variant did not run
            variant.why = _failure("sample_init", exc)
        else:
            variant.ops = _sandbox_ops(sandbox, path, data)
            variant.notes.append(
                f"task_init {task_init * 1000:.0f} ms, sample_init (to a ready sandbox) "
                f"{sample_init * 1000:.0f} ms (one sample)"
            )
        yield variant, environments
    finally:
        with anyio.CancelScope(shield=True):
            if environments is not None:
                started = time.perf_counter()
                try:
                    await cls.sample_cleanup(TASK, config, environments, False)
                    variant.notes.append(
                        f"sample_cleanup {(time.perf_counter() - started) * 1000:.0f} ms"
                    )
                except Exception as exc:  # noqa: BLE001 - reported, not hidden
                    variant.notes.append("WARNING: " + _failure("sample_cleanup", exc))
            try:
                await cls.task_cleanup(TASK, config, True)
            except Exception as exc:  # noqa: BLE001 - reported, not hidden
                variant.notes.append("WARNING: " + _failure("task_cleanup", exc))


@contextlib.asynccontextmanager
async def inspect_docker_variant(env: Environment, data: bytes) -> AsyncIterator[Variant]:
    from inspect_ai.util._sandbox.docker.docker import DockerSandboxEnvironment

    with tempfile.TemporaryDirectory(prefix="vf-bench-inspect-") as tmp:
        compose = Path(tmp) / "compose.yaml"
        compose.write_text(COMPOSE.format(image=env.options.image))
        async with sandbox_variant(
            DockerSandboxEnvironment,
            compose.as_posix(),
            CONTAINER_PATH,
            data,
            skip_engine_check=True,
        ) as (variant, environments):
            project = None
            if environments:
                project = environments["default"]._project.name
                version = await _compose_version()
                variant.notes.insert(0, f"{version}, compose project {project}")
            if variant.why and "compose" in variant.why:
                variant.why += " (`make compose` installs the Compose v2 plugin)"
            yield variant
        if project is not None:
            left = await anyio.to_thread.run_sync(
                lambda: _container_ids(env.client, label=f"com.docker.compose.project={project}")
            )
            if left:
                variant.notes.append(f"WARNING: {len(left)} container(s) left behind: {left}")


async def _compose_version() -> str:
    from inspect_ai.util._subprocess import subprocess

    result = await subprocess(["docker", "compose", "version", "--short"])
    return f"Docker Compose {result.stdout.strip()}" if result.success else "Docker Compose ?"


@contextlib.asynccontextmanager
async def vf_variant(env: Environment, data: bytes) -> AsyncIterator[Variant]:
    try:
        from runtimes.inspect_sandbox import TASK_LABEL, VfSandboxEnvironment

        config = VfSandboxEnvironment.config_deserialize(
            {"type": "docker", "image": env.options.image}
        )
    except Exception as exc:  # noqa: BLE001 - the notes say why the variant did not run
        yield Variant(why=_failure("runtimes.inspect_sandbox", exc))
        return
    async with sandbox_variant(VfSandboxEnvironment, config, CONTAINER_PATH, data) as (
        variant,
        environments,
    ):
        runtime = environments["default"].runtime if environments else None
        yield variant
        if runtime is not None:
            info = getattr(runtime, "channel_info", None)
            channel = f", channel {info.state}" if info is not None else ""
            variant.notes.insert(0, f"container {(runtime.sandbox_id or '?')[:12]}{channel}")
            variant.notes += _check_channels({VF: runtime})
    # Every container the provider made for this task (its label), the sample's included.
    left = await anyio.to_thread.run_sync(
        lambda: _container_ids(env.client, label=f"{TASK_LABEL}={TASK}")
    )
    if left:
        variant.notes.append(f"WARNING: {len(left)} container(s) left behind: {left}")


@contextlib.asynccontextmanager
async def local_variant(data: bytes) -> AsyncIterator[Variant]:
    from inspect_ai.util._sandbox.local import LocalSandboxEnvironment

    # A relative path: inside the local sandbox's own temp dir.
    async with sandbox_variant(LocalSandboxEnvironment, None, "vf-bench-inspect.bin", data) as (
        variant,
        _,
    ):
        yield variant


@contextlib.asynccontextmanager
async def sdk_variant(env: Environment, data: bytes) -> AsyncIterator[Variant]:
    container = await anyio.to_thread.run_sync(env.bare_container)
    directory, name = os.path.split(CONTAINER_PATH)

    def exec_true() -> None:
        result = container.exec_run(["true"])
        assert result.exit_code == 0, result

    def read() -> None:
        got = _get_archive(container, CONTAINER_PATH)
        assert got == data, f"get_archive gave {len(got)} bytes, put {len(data)}"

    try:
        _put_archive(container, directory, name, data)
        yield Variant(
            ops={
                EXEC: exec_true,
                WRITE: lambda: _put_archive(container, directory, name, data),
                READ: read,
            }
        )
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_remove, container)


def _measure(call: Call) -> Measure:
    async def measure() -> float:
        return await timed(call)

    return measure


def _ratio(ours: Series, base: Series | None) -> str:
    """:func:`ratio`, with two significant digits below 0.1 (0.0018x, not 0.00x)."""
    if base is None:
        return "-"
    if base.median_ms > 0 and ours.median_ms / base.median_ms < 0.1:
        return f"{ours.median_ms / base.median_ms:.2g}x"
    return ratio(ours.median_ms, base.median_ms)


def _table(series: dict[str, Series], variants: dict[str, Variant]) -> str:
    rows = []
    for op in OPS:
        docker = series.get(f"{INSPECT_DOCKER}: {op}")
        sdk = series.get(f"{SDK}: {op}")
        for name in VARIANTS:
            label = f"{SDK} {SDK_OPS[op]}" if name == SDK else name
            ours = series.get(f"{name}: {op}")
            if ours is None:
                rows.append([op, label, "not available", "-", "-", "-"])
                continue
            rows.append(
                [
                    op,
                    label,
                    ms(ours.median_ms),
                    ms(ours.percentile_ms(0.9)),
                    _ratio(ours, docker),
                    _ratio(ours, sdk),
                ]
            )
    headers = [
        "op",
        "sandbox",
        "median ms",
        "p90 ms",
        "vs inspect docker (medians)",
        "vs docker SDK (medians)",
    ]
    return table(headers, rows)


async def inspect_section(env: Environment) -> tuple[str, dict[str, Series]]:
    n = env.options.n_inspect
    data = os.urandom(KiB)
    try:
        import inspect_ai
    except ImportError as exc:
        return f"NOT MEASURED: inspect_ai is not installed ({exc}).", {}
    async with contextlib.AsyncExitStack() as stack:
        variants = {
            INSPECT_DOCKER: await stack.enter_async_context(inspect_docker_variant(env, data)),
            VF: await stack.enter_async_context(vf_variant(env, data)),
            SDK: await stack.enter_async_context(sdk_variant(env, data)),
            LOCAL: await stack.enter_async_context(local_variant(data)),
        }
        measures = {
            f"{name}: {op}": _measure(call)
            for name, variant in variants.items()
            for op, call in variant.ops.items()
        }
        series = await interleaved_measures(measures, n, warmup=3, shuffle=True)
    notes = []
    for name, variant in variants.items():
        if variant.why:
            notes.append(f"NOT MEASURED: {name}: {variant.why}")
        if variant.notes:
            notes.append(f"{name}: " + "; ".join(variant.notes) + ".")
    text = (
        f"inspect_ai {inspect_ai.__version__} sandboxes (`benchmarks.inspect_sandbox`; n={n} "
        "per op and sandbox, every op of every sandbox interleaved call by call in a new "
        "seeded random order each round, after 3 warm-up rounds): `exec(['true'])`, "
        "`write_file` of 1 KiB (bytes) and `read_file` of it (`text=False`), each timed on "
        "its own, through inspect's `SandboxEnvironment` API. `inspect docker`: inspect's "
        "built-in `DockerSandboxEnvironment` (each call runs the `docker compose` CLI; "
        f"`write_file` runs `mkdir -p` then `base64 -d | tee`) on a compose file of "
        f"`{env.options.image}` (`x-local`, `pull_policy: never`, `init`, `network_mode: "
        "none`, `tail -f /dev/null`); `vf provider`: `runtimes.inspect_sandbox."
        f'VfSandboxEnvironment` with `{{"type": "docker", "image": "{env.options.image}"}}`; '
        "baselines: the Docker SDK on a plain container of the same image (`exec_run`, "
        "`put_archive` / `get_archive` with the tar built or extracted in the call, run in the "
        "event loop's thread) and inspect's `local` sandbox (host subprocesses, a host temp "
        "dir). The sandboxes go through inspect's lifecycle outside an eval (`task_init`, "
        "`sample_init`, `sample_cleanup`, `task_cleanup`); inspect's Docker `task_init` "
        "refuses Docker Engine < 24.0.6, so its engine version check (`prereqs."
        "validate_docker_engine`) is skipped for that call in the benchmark process (the "
        "Compose version check still runs).\n\n" + _table(series, variants)
    )
    if notes:
        text += "\n\n" + "\n\n".join(notes)
    return text, series
