"""SDK behaviours ``runtimes.modal`` relies on, written once and run against both SDKs.

``test_fake_fidelity.py`` runs them against the fake (``fake_modal.py``); ``test_live.py`` runs
the very same functions against real Modal when credentials are present. A scenario that
passes on the fake and fails live is a place where the fake differs from the service.

Each scenario is ``async def scenario(modal, open_sandbox)``: ``modal`` is the SDK module and
``open_sandbox(**create_kwargs)`` an async context manager yielding a fresh sandbox (terminated
on exit). Scenarios use only the SDK's public surface, through ``.aio`` as the runtime does.
"""

from __future__ import annotations

import types
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import anyio
import modal.exception as modal_exc
import pytest
from modal.types import FileType

OpenSandbox = Callable[..., AbstractAsyncContextManager[Any]]
Scenario = Callable[[types.ModuleType, OpenSandbox], Awaitable[None]]
SCENARIOS: dict[str, Scenario] = {}


def scenario(fn: Scenario) -> Scenario:
    SCENARIOS[fn.__name__] = fn
    return fn


@scenario
async def exec_refuses_argv_over_65536_characters(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    async with open_sandbox() as sb:
        with pytest.raises(modal_exc.InvalidError, match="ARG_MAX"):
            await sb.exec.aio("echo", "x" * 70_000)
        process = await sb.exec.aio("echo", "x" * 60_000, text=False)
        assert len(await process.stdout.read.aio()) == 60_001


@scenario
async def exec_timeout_ends_streams_and_wait_returns_minus_one(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    async with open_sandbox() as sb:
        process = await sb.exec.aio("sh", "-c", "echo early; sleep 30", timeout=1, text=False)
        with anyio.fail_after(20):
            assert await process.stdout.read.aio() == b"early\n"
            assert await process.wait.aio() == -1


@scenario
async def stdin_buffer_is_capped_at_16_mib_between_drains(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    async with open_sandbox() as sb:
        process = await sb.exec.aio("sh", "-c", "wc -c", text=False)
        process.stdin.write(b"x" * (16 * 1024 * 1024))
        with pytest.raises(BufferError):
            process.stdin.write(b"x")
        process.stdin.write_eof()
        await process.stdin.drain.aio()
        assert (await process.stdout.read.aio()).strip() == b"16777216"


@scenario
async def stdin_of_an_exited_process_is_refused_or_dropped(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    """What the runtime's stdin feeder tolerates: an error, or silence, once the process exited."""
    async with open_sandbox() as sb:
        process = await sb.exec.aio("true", text=False)
        assert await process.wait.aio() == 0
        try:
            process.stdin.write(b"x" * 1024)
            process.stdin.write_eof()
            await process.stdin.drain.aio()
        except modal_exc.Error:
            pass  # the fake answers ConflictError; any Modal error is handled the same way
        assert await process.poll.aio() == 0


@scenario
async def exit_codes_and_signal_deaths(modal: types.ModuleType, open_sandbox: OpenSandbox) -> None:
    async with open_sandbox() as sb:
        for script, expected in (("exit 42", 42), ("kill -TERM $$", 143), ("kill -KILL $$", 137)):
            process = await sb.exec.aio("sh", "-c", script)
            assert await process.wait.aio() == expected, script
        process = await sb.exec.aio("sleep", "5")
        assert await process.poll.aio() is None


@scenario
async def exec_env_values_arrive_exactly(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    async with open_sandbox() as sb:
        env = {"VF_A": "x y  z", "VF_EMPTY": "", "VF_U": "ünï\tcode\nline"}
        process = await sb.exec.aio(
            "sh", "-c", 'printf "%s|%s|%s" "$VF_A" "${VF_EMPTY-unset}" "$VF_U"', env=env, text=False
        )
        assert await process.stdout.read.aio() == "x y  z||ünï\tcode\nline".encode()


@scenario
async def filesystem_api_raises_typed_errors(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    async with open_sandbox() as sb:
        fs = sb.filesystem
        await fs.write_bytes.aio(b"data", "/tmp/d/file")
        assert await fs.read_bytes.aio("/tmp/d/file") == b"data", "write creates parents"
        with pytest.raises(modal_exc.SandboxFilesystemNotFoundError):
            await fs.read_bytes.aio("/tmp/d/missing")
        with pytest.raises(modal_exc.SandboxFilesystemIsADirectoryError):
            await fs.read_bytes.aio("/tmp/d")
        with pytest.raises(modal_exc.SandboxFilesystemIsADirectoryError):
            await fs.write_bytes.aio(b"x", "/tmp/d")
        with pytest.raises(modal_exc.SandboxFilesystemNotADirectoryError):
            await fs.write_bytes.aio(b"x", "/tmp/d/file/child")
        with pytest.raises(modal_exc.SandboxFilesystemNotADirectoryError):
            await fs.stat.aio("/tmp/d/file/child")
        with pytest.raises(modal_exc.SandboxFilesystemNotFoundError):
            await fs.stat.aio("/tmp/d/missing/deeper")
        with pytest.raises(modal_exc.SandboxFilesystemDirectoryNotEmptyError):
            await fs.remove.aio("/tmp/d")
        with pytest.raises(modal_exc.SandboxFilesystemPathAlreadyExistsError):
            await fs.make_directory.aio("/tmp/d/file")
        link = await sb.exec.aio("ln", "-s", "/nowhere", "/tmp/d/dangling")
        assert await link.wait.aio() == 0
        info = await fs.stat.aio("/tmp/d/dangling")
        assert info.type == FileType.SYMLINK and info.symlink_target == "/nowhere"
        kept = await sb.exec.aio(
            "sh",
            "-c",
            "mkdir -p /tmp/real && touch /tmp/real/keep && ln -s /tmp/real /tmp/d/dirlink",
        )
        assert await kept.wait.aio() == 0
        await fs.remove.aio("/tmp/d", recursive=True)
        assert (await fs.stat.aio("/tmp/real/keep")).type == FileType.FILE, "symlinks not followed"
        with pytest.raises(modal_exc.SandboxFilesystemNotFoundError):
            await fs.stat.aio("/tmp/d")


@scenario
async def terminated_sandbox_answers_not_found(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    async with open_sandbox() as sb:
        assert await sb.poll.aio() is None
        await sb.terminate.aio()
        with anyio.fail_after(60):
            await sb.wait.aio(raise_on_termination=False)
        assert await sb.poll.aio() == 137
        with pytest.raises(modal_exc.NotFoundError):
            await sb.exec.aio("true")
        with pytest.raises(modal_exc.NotFoundError, match="unavailable"):
            await sb.filesystem.read_bytes.aio("/etc/hostname")
        later = await modal.Sandbox.from_id.aio(sb.object_id)
        assert later.returncode == 137
        with pytest.raises((modal_exc.ConflictError, modal_exc.NotFoundError)):
            await later.exec.aio("true")


@scenario
async def detached_handle_raises_client_closed(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    async with open_sandbox() as sb:
        again = await modal.Sandbox.from_id.aio(sb.object_id)
        await again.detach.aio()
        with pytest.raises(modal_exc.ClientClosed):
            await again.exec.aio("true")
        assert await (await sb.exec.aio("true")).wait.aio() == 0


@scenario
async def blocked_network_has_no_route_out(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    async with open_sandbox(block_network=True) as sb:
        probe = "exec 3<>/dev/tcp/1.1.1.1/80 && echo connected"
        process = await sb.exec.aio("bash", "-c", probe, timeout=20, text=False)
        assert await process.wait.aio() != 0
        assert b"connected" not in await process.stdout.read.aio()


@scenario
async def list_filters_by_tags_and_set_tags_replaces(
    modal: types.ModuleType, open_sandbox: OpenSandbox
) -> None:
    marker = uuid.uuid4().hex
    async with open_sandbox(tags={"vf-test": marker, "other": "1"}) as tagged, open_sandbox() as _:
        app_id = await _app_id(modal)
        found = [
            s.object_id
            async for s in modal.Sandbox.list.aio(app_id=app_id, tags={"vf-test": marker})
        ]
        assert found == [tagged.object_id]
        await tagged.set_tags.aio({"vf-test": "changed"})
        assert await tagged.get_tags.aio() == {"vf-test": "changed"}, "set_tags replaces all tags"


async def _app_id(modal: types.ModuleType) -> str:
    app = await modal.App.lookup.aio(SCENARIO_APP, create_if_missing=True)
    return str(app.app_id)


SCENARIO_APP = "vf-sandbox-tests"
