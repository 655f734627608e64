"""Attack class 7 through the inspect provider (``runtimes.inspect_sandbox``): the policy's
tool commands and the files it leaves reach the host through inspect's ``exec`` and
``read_file``, and a policy that wants the eval's host to fall over floods a stream without
end or grows the file the scorer reads far past what fits in memory. Both stop at inspect's
limits with inspect's ``OutputLimitExceededError``, in bounded host memory."""

from __future__ import annotations

import resource

import pytest
from inspect_ai.util import OutputLimitExceededError, SandboxEnvironmentLimits

from runtimes import RuntimeConfig
from runtimes.inspect_sandbox import VfSandboxEnvironment, load_config
from runtimes.models import MiB

from .conftest import Hostile

pytestmark = pytest.mark.anyio

TARGETS = ["subprocess", "docker-root", "docker-user"]
HEADROOM = 256 * MiB
"""What the host's peak memory may grow by during an attack whose payload is 4 GiB (an endless
stream, a sparse file): far below the payload, far above the limits' own buffers."""


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


async def open_sample(hostile: Hostile) -> tuple[VfSandboxEnvironment, RuntimeConfig]:
    config = load_config(hostile.config)
    envs = await VfSandboxEnvironment.sample_init("attack", config, {})
    return envs["default"].as_type(VfSandboxEnvironment), config


@pytest.mark.attack(7)
@pytest.mark.parametrize("hostile", TARGETS, indirect=True)
async def test_an_endless_tool_output_stops_at_inspects_limit_in_bounded_memory(
    hostile: Hostile, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SandboxEnvironmentLimits, "MAX_EXEC_OUTPUT_SIZE", 8 * MiB)
    monkeypatch.setattr(SandboxEnvironmentLimits, "MAX_EXEC_OUTPUT_SIZE_STR", "8 MiB")
    env, config = await open_sample(hostile)
    try:
        before = peak_rss()
        flood = "yes $(head -c 65536 /dev/zero | tr '\\0' x)"
        with pytest.raises(OutputLimitExceededError) as caught:
            await env.exec(["sh", "-c", flood], user=hostile.user, timeout=120)
        assert len(caught.value.truncated_output or "") == 8 * MiB
        assert peak_rss() - before < HEADROOM
        # a killed child of the subprocess sandbox may wait as a zombie for the host's init
        running = "ps -eo stat=,comm= | awk '$2 == \"yes\" && $1 !~ /^Z/' | wc -l"
        left = await env.exec(["sh", "-c", running])
        assert left.stdout.strip() == "0", "the flood outlived its exec"
    finally:
        await VfSandboxEnvironment.sample_cleanup("attack", config, {"default": env}, False)


@pytest.mark.attack(7)
@pytest.mark.parametrize("hostile", TARGETS, indirect=True)
async def test_a_file_grown_past_the_read_limit_is_refused_without_being_read(
    hostile: Hostile,
) -> None:
    env, config = await open_sample(hostile)
    try:
        grown = await env.exec(["sh", "-c", "truncate -s 4G answer.txt"], user=hostile.user)
        assert grown.success, grown.stderr
        before = peak_rss()
        with pytest.raises(OutputLimitExceededError) as caught:
            await env.read_file("answer.txt")
        assert caught.value.limit_str == SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR
        assert peak_rss() - before < HEADROOM
    finally:
        await VfSandboxEnvironment.sample_cleanup("attack", config, {"default": env}, False)
