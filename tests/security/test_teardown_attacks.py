"""Leftovers that try to outlive ``close()`` on Docker (attack class 6).

``close()`` returns once nothing of the sandbox runs: the root agent freezes every process
(``kill(-1, SIGSTOP)``), SIGKILLs them and confirms once ``/proc`` lists none but zombies; or,
when no trusted root agent is there, the engine's removal runs on the caller's path. A policy
that kills the agent first, respawns, detaches or forks as fast as it can must be dead when
``close()`` returns, and its container gone once the background removal ran.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from runtimes import drain_removals, open_runtime
from tests.processes import running_anywhere, sleep_token
from tests.security.conftest import Hostile

pytestmark = [pytest.mark.anyio, pytest.mark.docker]

DOCKER_TARGETS = ["docker-root", "docker-user"]


def container_state(container_id: str) -> dict[str, Any] | None:
    import docker
    import docker.errors

    client = docker.from_env()
    try:
        state: dict[str, Any] = client.api.inspect_container(container_id)["State"]
    except docker.errors.NotFound:
        return None
    finally:
        client.close()
    return state


def stay_alive(token: str) -> str:
    return (
        f"nohup sh -c 'while :; do sleep {token}; done' >/dev/null 2>&1 & "
        f"setsid sh -c 'while :; do sleep {token} & sleep 0.005; done' "
        ">/dev/null 2>&1 < /dev/null &"
    )


@pytest.mark.attack(6)
@pytest.mark.parametrize("hostile", DOCKER_TARGETS, indirect=True)
@pytest.mark.parametrize("kill_agent", [False, True], ids=["agent-alive", "agent-killed"])
async def test_nothing_of_the_policy_runs_once_close_returns(
    hostile: Hostile, kill_agent: bool
) -> None:
    token = sleep_token()
    rt = open_runtime(hostile.config)
    await rt.start()
    try:
        await rt.exec(["sh", "-c", stay_alive(token)], user=hostile.user)
        if kill_agent:
            pid = rt.channel_info.agent_pid
            assert pid is not None
            # From a leftover, not from the agent's own command: root can; the policy
            # account cannot signal the root agent.
            later = f"(sleep 0.2; kill -9 {pid}) >/dev/null 2>&1 &"
            await rt.exec(["sh", "-c", later], user=hostile.user)
            await anyio.sleep(0.5)
            alive = rt.channel_info.state == "running"
            assert alive == (hostile.privilege != "root"), rt.channel_info
        assert running_anywhere(token), "control: the leftovers run"
        container_id = rt.sandbox_id
        assert container_id is not None
    finally:
        await rt.close()
    assert running_anywhere(token) == [], "a leftover ran on after close() returned"
    await drain_removals()
    assert container_state(container_id) is None
