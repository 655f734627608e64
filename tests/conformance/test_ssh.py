"""The conformance suite on the ssh runtime, against a real OpenSSH server in a container.

One ``vf-sandbox/sshd`` container serves the module; the checks marked ``shares_sandbox``
share one sandbox (a connection and remote directory) per class and event loop, the others
each open their own (``docs/conformance.md``), with strict host-key checking. Two logins:

* ``root`` with an ed25519 key, under asyncio (``user=`` switches via runuser);
* the unprivileged ``sandbox`` user with its password, under trio, so the checks that
  only apply to non-root sandboxes (unreadable files, read-only directories, ``user=``
  refused) run too.

One event loop per login: the login decides what the remote side runs as, the loop what the
host side runs in, and nothing in ``runtimes/ssh`` depends on the loop (the channel's
loop-specific hand-over runs under both loops here and on the other backends), so the two
classes cover both loops without running the root login's checks a second time.

Both run through the persistent channel (the default; the witness proves the channel carried
every call) and again through the plain SSH path (``channel=False``: a channel per command,
SFTP for files), under asyncio.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from runtimes.ssh import SSHConfig
from runtimes.testing import RuntimeConformance
from tests.ssh.sshd import IMAGE, SSHServer, image_present

from .channel import ThroughTheChannel

pytestmark = pytest.mark.ssh


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHServer]:
    if not image_present():
        pytest.fail(f"{IMAGE} is missing: build it with `make images`")
    with SSHServer(Path(tmp_path_factory.mktemp("sshd"))) as server:
        yield server


class TestSSHConformanceRootKey(ThroughTheChannel):
    anyio_backends = ("asyncio",)  # trio: TestSSHConformanceUserPassword (see the module doc)

    @pytest.fixture
    def runtime_config(self, sshd: SSHServer) -> SSHConfig:
        return sshd.config()


class TestSSHConformanceUserPassword(ThroughTheChannel):
    user_variant = True  # see tests/conformance/conftest.py
    anyio_backends = ("trio",)

    @pytest.fixture
    def runtime_config(self, sshd: SSHServer) -> SSHConfig:
        return sshd.password_config()


class TestSSHConformanceRootKeyNoChannel(RuntimeConformance):
    anyio_backends = ("asyncio",)
    share_sandbox = True

    @pytest.fixture
    def runtime_config(self, sshd: SSHServer) -> SSHConfig:
        return sshd.config(channel=False)


class TestSSHConformanceUserPasswordNoChannel(RuntimeConformance):
    user_variant = True  # see tests/conformance/conftest.py
    anyio_backends = ("asyncio",)
    share_sandbox = True

    @pytest.fixture
    def runtime_config(self, sshd: SSHServer) -> SSHConfig:
        return sshd.password_config(channel=False)
