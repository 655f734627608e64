"""``exec(check=True)``, ``ExecResult``'s repr, and the edges of ``exec`` returning at the
command's exit and of ``spawn`` (subprocess runtime; every backend runs the kit's
``runtimes/testing/process_checks.py``)."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import anyio
import pytest

from runtimes import (
    CommandFailedError,
    ExecResult,
    SandboxError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    open_runtime,
)
from runtimes.cleanup import cleanup_sandboxes
from runtimes.processes import running_count
from tests.processes import running_anywhere, sleep_token

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_repr_shows_the_text_users_read() -> None:
    result = ExecResult(0, "héllo\n".encode(), b"warn\xff\n", 0.5)
    assert repr(result) == (
        "ExecResult(exit_code=0, stdout='héllo\\n', stderr='warn\ufffd\\n', duration=0.500)"
    )


def test_repr_cuts_the_middle_of_long_output() -> None:
    text = "".join(f"line {i}\n" for i in range(10_000))
    shown = repr(ExecResult(1, text.encode(), b""))
    assert len(shown) < 400, shown
    assert "'line 0\\nline 1\\n" in shown and "line 9999\\n'" in shown, shown
    assert f"[... {len(text) - 240} chars ...]" in shown, shown


async def test_check_raises_a_typed_error_carrying_the_result() -> None:
    async with open_runtime({"type": "subprocess"}) as rt:
        assert (await rt.exec(["true"], check=True)).exit_code == 0
        assert (await rt.exec(["false"])).exit_code == 1  # without check: a result
        with pytest.raises(CommandFailedError) as caught:
            await rt.exec(["sh", "-c", "echo out; echo 'no such table' >&2; exit 3"], check=True)
    exc = caught.value
    assert isinstance(exc, SandboxError)
    assert (exc.exit_code, exc.stdout, exc.stderr) == (3, "out\n", "no such table\n")
    assert exc.result.exit_code == 3 and exc.argv[0] == "sh"
    assert str(exc).endswith("exited 3: no such table"), str(exc)
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is CommandFailedError and again.result.stdout == "out\n"


async def test_timeout_still_kills_a_command_that_runs() -> None:
    """The timeout covers the command while it runs: its tree is killed, as before."""
    token = sleep_token()
    async with open_runtime({"type": "subprocess"}) as rt:
        with pytest.raises(SandboxError):
            await rt.exec(["sh", "-c", f"sleep {token} & sleep {token}"], timeout=0.5)
        await anyio.sleep(0.2)
        assert running_anywhere(token) == []


async def test_a_lingering_run_ends_with_its_writers_and_close_ends_the_rest() -> None:
    """Once exec returned, its run drains on until the background writer closes the pipes
    (then nothing is left of it), and close() ends a writer that never does."""
    token = sleep_token()
    async with open_runtime({"type": "subprocess"}) as rt:
        await rt.exec(["sh", "-c", "sleep 0.5 & echo ok"], timeout=10)
        assert running_count(rt) == 1
        for _ in range(40):
            if running_count(rt) == 0:
                break
            await anyio.sleep(0.05)
        assert running_count(rt) == 0
        await rt.exec(["sh", "-c", f"sleep {token} & echo ok"], timeout=10)
        proc = await rt.spawn(["sleep", token])
        assert running_count(rt) == 2 and len(rt.processes()) == 1
    assert running_count(rt) == 0 and proc.exit_code == 137
    assert running_anywhere(token) == []


async def test_spawn_reports_a_missing_program_from_wait_and_refuses_a_bad_buffer() -> None:
    async with open_runtime({"type": "subprocess"}) as rt:
        with pytest.raises(SandboxInvalidArgumentError):
            await rt.spawn(["true"], buffer=0)
        proc = await rt.spawn(["no-such-program-here"])
        with pytest.raises(SandboxFileNotFoundError):
            await proc.wait(timeout=10)
        assert not proc.running and rt.processes() == []


async def test_a_failing_on_output_kills_the_background_tree() -> None:
    token = sleep_token()

    def explode(stream: str, chunk: bytes) -> None:
        raise RuntimeError("consumer broke")

    async with open_runtime({"type": "subprocess"}) as rt:
        proc = await rt.spawn(["sh", "-c", f"echo hi; sleep {token}"], on_output=explode)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="consumer broke"):
            await proc.wait(timeout=10)
        assert time.monotonic() - started < 5
        await anyio.sleep(0.2)
        assert running_anywhere(token) == []


async def test_keep_leaves_the_pipe_holding_server_running(tmp_path: Path) -> None:
    """``exec --keep -- sh -c '(sleep 600 &); echo ok'``: exec returns ``ok`` at once, and
    closing the kept runtime leaves the sleeper (which holds the pipes) running, as keep
    promises; a spawned one too. ``cleanup --kept`` removes them."""
    token = sleep_token()
    root = tmp_path / "root"
    config = {"type": "subprocess", "root": str(root), "keep": True}
    try:
        async with open_runtime(config) as rt:
            result = await rt.exec(["sh", "-c", f"(sleep {token} &); echo ok"], timeout=10)
            assert result.stdout == "ok\n" and result.duration < 5, result
            await rt.spawn(["sleep", token])
            await anyio.sleep(0.3)
        assert len(running_anywhere(token)) == 2, running_anywhere(token)
    finally:
        await cleanup_sandboxes([config], kept=True)
    await anyio.sleep(0.2)
    assert running_anywhere(token) == []
