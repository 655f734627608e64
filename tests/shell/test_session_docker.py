"""Shell sessions in real containers, through the channel and through the plain path
(``channel=False``), under asyncio and trio. One container per test: the behaviours a user
relies on are played in it one after the other."""

from __future__ import annotations

import time

import anyio
import pytest

from runtimes import ExecTimeoutError, OutputLimitExceededError, ShellSessionError
from runtimes.base import Runtime
from runtimes.pytest_plugin import DockerRuntimeFactory
from runtimes.shell import ShellSession

pytestmark = [pytest.mark.docker, pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _shell_processes(rt: Runtime) -> list[str]:
    listing = await rt.exec(["ps", "-eo", "args"])
    return [
        line
        for line in listing.stdout.splitlines()
        if line.startswith(("bash --noprofile", "sleep 4242"))
        or "The in-sandbox half of a shell session" in line  # the driver's source
    ]


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.parametrize("channel", [True, False], ids=["channel", "plain"])
async def test_a_session_in_a_container(
    docker_runtime_factory: DockerRuntimeFactory, channel: bool
) -> None:
    async with docker_runtime_factory(channel=channel) as rt:
        async with rt.shell() as sh:
            await sh.run("cd /tmp && export V=kept && python3 -m venv --without-pip /tmp/venv")
            await sh.run(". /tmp/venv/bin/activate")
            result = await sh.run("pwd; echo $V; command -v python3; echo oops >&2; false")
            assert result.exit_code == 1
            assert result.stdout == "/tmp\nkept\n/tmp/venv/bin/python3\n"
            assert result.stderr == "oops\n"
            assert (await sh.run("printf '\\xff\\x00é'")).stdout_bytes == b"\xff\x00\xc3\xa9"

            started = time.monotonic()
            with pytest.raises(ExecTimeoutError) as timed_out:
                await sh.run("echo before; sleep 4242", timeout=1)
            assert time.monotonic() - started < 5
            assert timed_out.value.stdout == "before\n"
            with pytest.raises(OutputLimitExceededError) as capped:
                await sh.run("yes", output_limit=100_000, timeout=30)
            assert len(capped.value.stdout_bytes) == 100_000
            assert (await sh.run("echo $V")).stdout == "kept\n"

            await sh.run("sleep 4242 >/dev/null 2>&1 &")
        assert await _shell_processes(rt) == [], "closing leaves nothing running"


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "plain"])
async def test_pty_sessions_side_by_side_as_another_user(
    docker_runtime_factory: DockerRuntimeFactory, channel: bool
) -> None:
    async with (
        docker_runtime_factory(channel=channel) as rt,
        rt.shell(pty=True, size=(33, 111), user="nobody") as term,
        rt.shell() as sh,
    ):
        assert (await term.run("id -un; stty size")).stdout == "nobody\r\n33 111\r\n"
        answered = await term.run("read -r -p 'who? ' n; echo hi $n", input="ann\n")
        assert answered.stdout.endswith("hi ann\r\n")
        await term.resize(50, 150)
        assert (await term.run("stty size")).stdout == "50 150\r\n"

        said: list[str] = []

        async def wait_and_say(session: ShellSession, word: str) -> None:
            said.append((await session.run(f"sleep 3; echo {word}")).stdout.strip())

        started = time.monotonic()
        async with anyio.create_task_group() as group:
            group.start_soon(wait_and_say, term, "a")
            group.start_soon(wait_and_say, sh, "b")
        # One after the other would take 6 s; the slack holds on a busy machine.
        assert time.monotonic() - started < 5.5, "the two sessions ran one after the other"
        assert sorted(said) == ["a", "b"]
        await sh.run("sleep 4242 >/dev/null 2>&1 &")
        await rt.close()  # closes both sessions first
        assert not term.alive and not sh.alive
        with pytest.raises(ShellSessionError):
            await sh.run("true")


async def test_a_sandbox_without_python_says_so(
    docker_runtime_factory: DockerRuntimeFactory, no_python_image: str
) -> None:
    async with docker_runtime_factory(image=no_python_image) as rt:
        with pytest.raises(ShellSessionError, match="python3"):
            async with rt.shell(start_timeout=20):
                pass
