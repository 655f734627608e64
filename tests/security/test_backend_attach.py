"""A :class:`runtimes.Backend` that attaches to a sandbox others ran code in: the runtime
composed around it must not start the channel's agent there.

The first agent is found through ``sh`` and a ``PATH`` search for ``python3``: in a sandbox
the policy used, that ``python3`` may be the policy's, and the agent would then run it with
the machinery's privilege (attack class 4). Here the policy left a ``python3`` first on
``PATH`` that records it was run; the runtime serves every call through the plain path
instead, never runs it, and still kills what its commands left before letting the sandbox go.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from vf_sandbox_echo import EchoBackend

from runtimes import CreateRequest, runtime_class

pytestmark = [pytest.mark.attack(4), pytest.mark.anyio]


class AttachingEcho(EchoBackend):
    """The echo backend, attaching to a directory that exists already."""

    existing: str = ""

    async def create(self, request: CreateRequest) -> str:
        self._dir = self.existing
        return self._dir

    async def destroy(self, *, keep: bool) -> None:
        self._dir = None  # someone else's: let go, never removed

    @property
    def attached(self) -> bool:
        return True


async def test_no_agent_starts_in_a_sandbox_the_backend_attached_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = tmp_path / "bin"
    planted.mkdir()
    ran = tmp_path / "planted-python-ran"
    (planted / "python3").write_text(f"#!/bin/sh\ntouch {ran}\nexit 1\n")
    (planted / "python3").chmod(0o755)
    monkeypatch.setenv("PATH", f"{planted}:{os.environ['PATH']}")
    existing = tempfile.mkdtemp(prefix="vf-attached-")
    monkeypatch.setattr(AttachingEcho, "existing", existing)

    rt = runtime_class(AttachingEcho)(AttachingEcho.config_model(channel=True))
    async with rt:
        assert (await rt.exec(["echo", "served"])).stdout == "served\n"
        await rt.write("f", b"x")
        assert await rt.read("f") == b"x"
        assert rt.channel_info.state != "running" and rt.channel_info.served == 0
    assert not ran.exists(), "the policy's python3 ran as the channel's agent"
    assert Path(existing, "f").read_bytes() == b"x"  # attached: let go, not removed
