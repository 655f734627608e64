"""A hostile ``/bin/sh`` against the Docker runtime's plain exec path.

The wrapper's report comes on stderr before the command runs, and the runtime holds
stdout back until it has it (the engine does not order the two streams). A shell the
policy replaced may never report while it writes: what is held must count against the
output cap, or an endless writer grows the host's memory until the timeout.
"""

from __future__ import annotations

import time

import pytest

from runtimes import OutputLimitExceededError, open_runtime

from .conftest import Hostile

pytestmark = [pytest.mark.anyio]

# Misbehaves once (the first command after it is installed), then is the real shell again,
# so the runtime's own commands (kills at close) still work.
_SILENT_WRITER = r"""#!/usr/bin/python3
import os, sys, time
flag = "/tmp/.silent-writer-used"
if not os.path.exists(flag):
    open(flag, "w").close()
    block = b"x" * (1 << 20)
    for _ in range(64):
        os.write(1, block)
    time.sleep(60)
    sys.exit(0)
os.execv("/bin/dash", ["sh", *sys.argv[1:]])
"""


@pytest.mark.attack(7)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
async def test_a_shell_that_never_reports_is_held_to_the_output_cap(hostile: Hostile) -> None:
    async with open_runtime({**hostile.config, "channel": False}) as rt:
        await rt.write("/usr/local/bin/silent-writer", _SILENT_WRITER)
        install = (
            "chmod 755 /usr/local/bin/silent-writer"
            " && ln -s /usr/local/bin/silent-writer /bin/sh.new && mv -T /bin/sh.new /bin/sh"
        )
        await rt.exec(["sh", "-c", install])
        started = time.monotonic()
        with pytest.raises(OutputLimitExceededError) as caught:
            await rt.exec(["true"], output_limit=1 << 20, timeout=40)
        assert time.monotonic() - started < 30, "held until the timeout instead of the cap"
        assert len(caught.value.stdout_bytes) + len(caught.value.stderr_bytes) == 1 << 20
        assert caught.value.stdout_bytes.startswith(b"xxxx"), "the hostile shell did not run"
        assert (await rt.exec(["echo", "usable"])).stdout == "usable\n"
