"""Shell-session round trip on Docker (section ``shell`` of ``python -m benchmarks``).

``await sh.run("true")`` in a session opened by ``rt.shell()`` vs ``await rt.exec(["true"])``
on the same runtime (the channel's exec), and vs SWE-ReX's ``run_in_session`` of ``true``:
the ``swerex-remote`` server runs in a container of ``vf-sandbox/swerex`` (``images/swerex``)
that this benchmark creates, reached on a port published on 127.0.0.1, driven by SWE-ReX's
own client (``RemoteRuntime``) in a process of the separate venv that holds ``swe-rex``
(``benchmarks/swerex_client.py``; the project's venv does not have it). That client times
each call itself and is driven line by line, so all variants are interleaved call by call.
Where SWE-ReX cannot run, its row says why.
"""

from __future__ import annotations

import contextlib
import secrets
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
from anyio.streams.buffered import BufferedByteReceiveStream

from runtimes import ownership
from runtimes.base import Runtime
from runtimes.docker import DockerConfig

from .stats import Measure, Series, interleaved_measures, timed
from .suite import Environment, Row, _check_channels, _remove, opened, rows_table

SWEREX_IMAGE = "vf-sandbox/swerex:latest"
SWEREX_PORT = "8000/tcp"
CLIENT = Path(__file__).with_name("swerex_client.py")
CLIENT_START_TIMEOUT = 90.0
CALL_TIMEOUT = 60.0
EXEC = "docker, channel: exec(['true'])"
SWEREX = "SWE-ReX run_in_session('true')"
TARGET_VS_EXEC = 1.5


class Unavailable(Exception):
    """A variant that could not be measured here; the message says why (shown in the row)."""


@dataclass
class Variant:
    """A measured variant, or why there is none."""

    measure: Measure | None = None
    why: str = ""


# ---------------------------------------------------------------------- SWE-ReX


def _start_server(env: Environment, token: str) -> tuple[Any, int]:
    import docker.errors

    try:
        env.client.images.get(SWEREX_IMAGE)
    except docker.errors.ImageNotFound:
        raise Unavailable(
            f"no image {SWEREX_IMAGE} (`make bench` builds it: images/build-images.sh swerex)"
        ) from None
    published: dict[str, Any] = {SWEREX_PORT: ("127.0.0.1", None)}  # None: any free port
    container = env.client.containers.run(
        SWEREX_IMAGE,
        ["swerex-remote", "--host", "0.0.0.0", "--port", "8000", "--auth-token", token],
        detach=True,
        init=True,
        ports=published,
        labels=ownership.ownership_labels("docker", {"vf-sandbox.role": "benchmark-swerex"}),
    )
    try:
        container.reload()
        bindings = container.ports.get(SWEREX_PORT) or []
        if not bindings:
            raise Unavailable(f"Docker published no host port for {SWEREX_PORT}")
        return container, int(bindings[0]["HostPort"])
    except Exception:
        _remove(container)
        raise


async def _read_line(stream: BufferedByteReceiveStream, timeout: float) -> str:
    with anyio.fail_after(timeout):
        return (await stream.receive_until(b"\n", 1 << 16)).decode(errors="replace")


def _client_failure(line: str, log: Path) -> str:
    tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
    return f"SWE-ReX client: {line or 'exited'}" + (f" ({tail[0][:300]})" if tail else "")


@contextlib.asynccontextmanager
async def swerex_variant(env: Environment) -> AsyncIterator[Variant]:
    """SWE-ReX's ``run_in_session("true")``, timed by its own client; or why not."""
    python = env.options.swerex_python
    if not python or not Path(python).is_file():
        yield Variant(why=f"no SWE-ReX venv at {python} (`make bench` makes it)")
        return
    token = secrets.token_hex(16)
    try:
        container, port = await anyio.to_thread.run_sync(_start_server, env, token)
    except Unavailable as exc:
        yield Variant(why=str(exc))
        return
    except Exception as exc:  # noqa: BLE001 - the row says why SWE-ReX did not run
        yield Variant(why=f"swerex-remote container failed: {type(exc).__name__}: {exc}"[:300])
        return
    try:
        with tempfile.TemporaryDirectory(prefix="vf-bench-swerex-") as tmp:
            log = Path(tmp) / "client.log"
            with log.open("wb") as log_file:
                argv = [python, str(CLIENT), f"http://127.0.0.1:{port}", token]
                process = await anyio.open_process(argv, stderr=log_file)
                try:
                    yield await _client_variant(process, log)
                finally:
                    await _stop(process)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_remove, container)


async def _stop(process: anyio.abc.Process) -> None:
    """End of stdin ends the client (it closes its session); kill it if it does not."""
    with anyio.CancelScope(shield=True):
        if process.stdin is not None:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await process.stdin.aclose()
        with anyio.move_on_after(10):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
        await process.aclose()


async def _client_variant(process: anyio.abc.Process, log: Path) -> Variant:
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, BufferedByteReceiveStream(process.stdout)
    try:
        first = (await _read_line(stdout, CLIENT_START_TIMEOUT)).strip()
    except (anyio.EndOfStream, anyio.IncompleteRead):
        return Variant(why=_client_failure("", log))
    except TimeoutError:
        process.kill()
        return Variant(why=f"SWE-ReX client not ready in {CLIENT_START_TIMEOUT:.0f} s")
    if first != "ready":
        return Variant(why=_client_failure(first, log))

    async def measure() -> float:
        await stdin.send(b"run\n")
        answer = (await _read_line(stdout, CALL_TIMEOUT)).strip()
        if answer.startswith("error"):
            raise RuntimeError(_client_failure(answer, log))
        return float(answer)

    return Variant(measure)


# ---------------------------------------------------------------------- shell sessions


def _timed_exec(rt: Runtime) -> Measure:
    async def call() -> None:
        result = await rt.exec(["true"])
        assert result.exit_code == 0, result

    async def measure() -> float:
        return await timed(call)

    return measure


def _timed_run(session: Any) -> Measure:
    async def call() -> None:
        result = await session.run("true", timeout=CALL_TIMEOUT)
        assert result.exit_code == 0, result

    async def measure() -> float:
        return await timed(call)

    return measure


async def _session_variant(
    stack: contextlib.AsyncExitStack, rt: Runtime, options: dict[str, Any]
) -> Variant:
    """A shell session on ``rt`` kept open on ``stack``; or the error that stopped it."""
    try:
        session = await stack.enter_async_context(rt.shell(**options))
        await session.run("true", timeout=CALL_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - shown in the row, not hidden
        return Variant(why=f"session failed: {type(exc).__name__}: {exc}"[:300])
    return Variant(_timed_run(session))


# (label, runtime, rt.shell() options); the first is the one the targets are about.
SESSIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("docker, channel: sh.run('true')", "docker, channel", {}),
    ("docker, channel, pty: sh.run('true')", "docker, channel", {"pty": True}),
    ("docker, no channel: sh.run('true')", "docker, no channel", {}),
]


def _session_rows(series: dict[str, Series]) -> list[Row]:
    exec_series, swerex = series[EXEC], series.get(SWEREX)
    rows: list[Row] = []
    for index, (name, _, _) in enumerate(SESSIONS):
        ours = series.get(name)
        if ours is None:
            continue
        if index == 0:
            met = ours.median_ms <= TARGET_VS_EXEC * exec_series.median_ms
            below = None if swerex is None else ours.median_ms < swerex.median_ms
            rows.append(Row(name, ours, EXEC, exec_series, f"<= {TARGET_VS_EXEC}x", met))
            rows.append(Row(name, ours, SWEREX, swerex, "< 1x", below))
        else:
            rows.append(Row(name, ours, EXEC, exec_series))
    if swerex is not None:
        rows.append(Row(SWEREX, swerex, EXEC, exec_series))
    return rows


async def shell_section(env: Environment) -> tuple[str, list[Row]]:
    n = env.options.n_shell
    image = env.options.image
    configs = {
        "docker, channel": DockerConfig(image=image, creations_per_second=None),
        "docker, no channel": DockerConfig(image=image, channel=False, creations_per_second=None),
    }
    async with opened(configs) as runtimes, contextlib.AsyncExitStack() as stack:
        variants = {EXEC: Variant(_timed_exec(runtimes["docker, channel"]))}
        for name, runtime, options in SESSIONS:
            variants[name] = await _session_variant(stack, runtimes[runtime], options)
        variants[SWEREX] = await stack.enter_async_context(swerex_variant(env))
        measures = {k: v.measure for k, v in variants.items() if v.measure is not None}
        series = await interleaved_measures(measures, n, shuffle=True)
        notes = _check_channels(runtimes)
    rows = _session_rows(series)
    notes += [f"NOT MEASURED: {name}: {v.why}" for name, v in variants.items() if v.why]
    text = (
        f"Shell-session round trip of `true` on Docker (n={n} each, every variant "
        "interleaved call by call in a new seeded random order each round, after 5 warm-up "
        "rounds): `await sh.run('true')` in one session opened by `rt.shell()` (kept open "
        "throughout; `pty`: `rt.shell(pty=True)`) vs `await rt.exec(['true'])` through the "
        "channel of the same kind of sandbox (`network=none`), and vs SWE-ReX's "
        "`run_in_session` of `true`: "
        f"`swerex-remote` in a `{SWEREX_IMAGE}` container (the base image + `swe-rex` from "
        "PyPI, `images/swerex`) on a port published on 127.0.0.1, called by SWE-ReX's own "
        "client (`RemoteRuntime`, a new HTTP connection per call as it does) in a process of "
        "a separate venv, which times each call itself (`benchmarks.sessions`, "
        "`benchmarks/swerex_client.py`). SWE-ReX's bash session is pexpect's, whose "
        "`sendline` waits `delaybeforesend` (50 ms by default) before each write, and "
        "`run_in_session` writes twice (the command, then `echo $?`).\n\n" + rows_table(rows)
    )
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text, rows
