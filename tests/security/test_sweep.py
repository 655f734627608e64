"""Attack 6: a leftover the policy arranged to outlive ``stop_processes()``.

Each leftover beats a heartbeat into a file. It is alive before the sweep (the control: the
heartbeat grows), and after ``stop_processes()`` the heartbeat must stop for good. The
leftovers: a fork loop (each generation forks the next and exits, so a sweep that lists then
kills always misses the newest), a ``setsid``'d daemon with an empty environment (``env -i``),
and the same as a fork loop.
"""

from __future__ import annotations

import pytest

from runtimes import Runtime, open_runtime

from .conftest import TARGET_IDS, Hostile

pytestmark = pytest.mark.anyio

FORK_LOOP = """
cat > .gen.sh <<'END'
printf x >> "$1"
sleep 0.01
sh "$0" "$1" &
END
nohup sh .gen.sh "$PWD/beat" >/dev/null 2>&1 </dev/null &
"""

SCRUBBED_DAEMON = """
env -i PATH=/usr/bin:/bin setsid sh -c 'while :; do printf x >> beat; sleep 0.02; done' \
  >/dev/null 2>&1 </dev/null &
"""

SCRUBBED_FORK_LOOP = """
cat > .gen.sh <<'END'
printf x >> "$1"
sleep 0.01
env -i PATH=/usr/bin:/bin setsid sh "$0" "$1" &
END
env -i PATH=/usr/bin:/bin setsid sh .gen.sh "$PWD/beat" >/dev/null 2>&1 </dev/null &
"""

# Leaves the workdir too: only a sandbox of the backend's own can tell it from the host's.
ROAMING_DAEMON = """
cd / && env -i PATH=/usr/bin:/bin setsid \
  sh -c 'while :; do printf x >> /tmp/beat; sleep 0.02; done' >/dev/null 2>&1 </dev/null &
"""


async def beats(rt: Runtime, path: str) -> int:
    return len(await rt.read(path)) if await rt.exists(path) else 0


async def assert_swept(rt: Runtime, script: str, user: str | None, beat: str = "beat") -> None:
    await rt.exec(["sh", "-c", script], user=user)
    await rt.exec(["sleep", "0.4"])
    first = await beats(rt, beat)
    await rt.exec(["sleep", "0.3"])
    assert await beats(rt, beat) > first, "control: the leftover is not running"
    assert await rt.stop_processes() >= 1
    after = await beats(rt, beat)
    await rt.exec(["sleep", "0.6"])
    assert await beats(rt, beat) == after, "a leftover survived stop_processes()"
    assert (await rt.exec(["echo", "ok"])).stdout == "ok\n", "the sandbox broke"


@pytest.mark.attack(6)
async def test_a_fork_loop_does_not_outrun_the_sweep(hostile: Hostile) -> None:
    async with open_runtime(hostile.config) as rt:
        await assert_swept(rt, FORK_LOOP, hostile.user)


@pytest.mark.attack(6)
async def test_a_setsid_daemon_with_an_empty_environment_is_swept(hostile: Hostile) -> None:
    """Found by the workdir it runs in where the backend cannot see the whole sandbox (SSH,
    subprocess), by being in the sandbox at all where it can (Docker, Modal)."""
    async with open_runtime(hostile.config) as rt:
        await assert_swept(rt, SCRUBBED_DAEMON, hostile.user)


# Not the subprocess runtime: there a loop that scrubbed its environment and calls setsid
# each generation is caught by a race the sweep wins in practice, not by construction (it
# lost once on a loaded machine); docs/security.md says so.
@pytest.mark.attack(6)
@pytest.mark.parametrize("hostile", [t for t in TARGET_IDS if t != "subprocess"], indirect=True)
async def test_a_scrubbed_fork_loop_is_swept(hostile: Hostile) -> None:
    async with open_runtime(hostile.config) as rt:
        await assert_swept(rt, SCRUBBED_FORK_LOOP, hostile.user)


@pytest.mark.attack(6)
@pytest.mark.parametrize(
    "hostile", ["docker-root", "docker-user", "modal-fake", "modal-user"], indirect=True
)
async def test_a_scrubbed_daemon_that_left_the_workdir_is_swept(hostile: Hostile) -> None:
    """In a sandbox of its own, the sweep needs neither the mark nor the workdir."""
    async with open_runtime(hostile.config) as rt:
        await assert_swept(rt, ROAMING_DAEMON, hostile.user, beat="/tmp/beat")


# Named so that /proc/PID/stat's first line ends inside the command name, after a forged ") ":
# a sweep that reads one line takes garbage for the process's fields.
NEWLINE_NAMED = """
n=$(printf 'x\\n) S 1 1 1 1') && ln -s /bin/sh "./$n" && \
  nohup "./$n" -c 'while :; do printf x >> beat; sleep 0.02; done' >/dev/null 2>&1 </dev/null &
"""


@pytest.mark.attack(6)
@pytest.mark.parametrize("hostile", ["docker-root", "modal-fake", "ssh-user"], indirect=True)
async def test_a_leftover_with_a_newline_in_its_name_is_swept_by_the_script(
    hostile: Hostile,
) -> None:
    """The sweep script (``scripts/sweep.sh``: the plain path's, and every close's), in each
    of its modes: ``all`` (Docker), ``since`` (Modal) and ``mark`` (SSH). Reading only the
    first line of the leftover's stat once let it escape the ``since`` sweep, and made the
    count abort the script with the leftover frozen, not killed."""
    config = hostile.config
    if isinstance(config, dict):
        config = {**config, "channel": False}
    else:
        config = config.model_copy(update={"channel": False})
    async with open_runtime(config) as rt:
        await assert_swept(rt, NEWLINE_NAMED, hostile.user)
