"""The attack suite: code inside a sandbox plays a policy that wants a reward it did not earn.

Every test here plays one attack class of ``docs/security.md`` (marked
``@pytest.mark.attack(N)``) against one target: a backend at one policy privilege. The
``hostile`` fixture gives those targets; a test that applies to a subset takes the
subset's ids with ``@pytest.mark.parametrize("hostile", [...], indirect=True)``.

At the end of a run the suite prints its tally (attack class x target -> outcome), which
``docs/security.md``'s table is filled from.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.channel.conftest import sshd  # noqa: F401 - fixture (one server per module)
from tests.docker.conftest import docker_client, no_leaks  # noqa: F401 - fixtures
from tests.modal.support import fake_config, fake_modal, fake_service  # noqa: F401 - fixtures
from tests.parallel import emit
from tests.ssh.sshd import SSHServer

IMAGE = "vf-sandbox/base:bookworm"

ATTACKS = {
    0: "(set-up: targets, policy account)",
    1: "host file write through download()",
    2: "verdict forged by the policy's program",
    3: "channel spoken for by sandbox code",
    4: "replaced channel agent / interpreter",
    5: "planted installed harness",
    6: "leftover process escapes the sweep",
    7: "host memory through the channel or a stream",
    8: "subprocess close/cleanup follows symlinks",
    9: "subprocess close leaves setsid'd processes",
    10: "model relay abused by sandbox code",
    11: "shell session spoken for by sandbox code",
    12: "snapshot/fork of a hostile sandbox",
    13: "policy code loaded by privileged machinery",
    14: "judge hands the policy's program privilege",
    15: "host resources through the model proxy",
    16: "sampling chosen by the sandbox",
    17: "transcript or judge prompt forged by output",
    18: "malformed records or verdicts crash judging",
    19: "policy acts with more privilege than meant",
    20: "terminal control sequences in CLI output",
    21: "fuzzed host parsers of sandbox bytes",
    22: "state left for the next user of a recycled sandbox",
    23: "cluster peers at the driver's model relay",
    24: "a sandbox's code at the cluster's control plane",
}


@dataclass(frozen=True)
class Hostile:
    """One target of the attack suite: a runtime config and the policy's privilege there."""

    id: str
    config: Any  # a config dict, or the SSH server's config model (it holds secrets)
    privilege: str  # "root", "user", or "host" (subprocess: the host process's own user)
    user: str | None = None  # the ``user=`` the policy's commands pass (None: the default user)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def backend(self) -> str:
        config = self.config
        return str(config["type"] if isinstance(config, dict) else config.type)


TARGET_IDS = [
    "subprocess",
    "docker-root",
    "docker-user",
    "ssh-root",
    "ssh-user",
    "modal-fake",
    "modal-user",
]
REMOTE_IDS = [t for t in TARGET_IDS if t != "subprocess"]


def _target(request: pytest.FixtureRequest, name: str) -> Hostile:
    if name == "subprocess":
        return Hostile(name, {"type": "subprocess"}, "host")
    if name == "docker-root":
        return Hostile(name, {"type": "docker", "image": IMAGE}, "root")
    if name == "docker-user":
        # The default: the machinery is root, the policy runs as the sandbox's policy_user.
        return Hostile(name, {"type": "docker", "image": IMAGE}, "user", user="vf-policy")
    if name in ("ssh-root", "ssh-user"):
        server: SSHServer = request.getfixturevalue("sshd")
        if name == "ssh-root":
            return Hostile(name, server.config(), "root")
        # Root login for the machinery; the policy runs as the host's `sandbox` account,
        # judges' verdict-writing commands as its `judge` account.
        config = server.config(policy_user="sandbox", judge_user="judge")
        return Hostile(name, config, "user", user="sandbox")
    if name in ("modal-fake", "modal-user"):
        request.getfixturevalue("fake_modal")
        if name == "modal-fake":
            return Hostile(name, fake_config(), "root")
        return Hostile(name, fake_config(), "user", user="vf-policy")
    raise AssertionError(f"unknown target {name!r}")


@pytest.fixture(params=TARGET_IDS)
def hostile(request: pytest.FixtureRequest) -> Hostile:
    """A sandbox config to attack from inside, with the privilege the policy has there."""
    return _target(request, request.param)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here not in Path(str(item.fspath)).parents:
            continue
        if item.get_closest_marker("attack") is None:
            raise pytest.UsageError(f"{item.nodeid}: every attack test names its class")
        callspec = getattr(item, "callspec", None)
        target = callspec.params.get("hostile") if callspec else None
        if target is not None and target != "subprocess":
            item.add_marker(pytest.mark.docker)
            if str(target).startswith("ssh"):
                item.add_marker(pytest.mark.ssh)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Count the test's attack classes and target, defended or not, for the run's tally
    (tests/parallel.py carries it from every xdist worker)."""
    outcome = yield
    report = outcome.get_result()
    marker = item.get_closest_marker("attack")
    if marker is None or Path(str(item.fspath)).parent != Path(__file__).parent:
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        callspec = getattr(item, "callspec", None)
        target = str(callspec.params.get("hostile", "host")) if callspec else "host"
        emit("attack", [[int(k) for k in marker.args], target, report.passed])


def write_attack_tally(terminalreporter: Any, counted: list[Any]) -> None:
    """The attack suite's tally: tests defended and failed, by class and target."""
    tally: dict[tuple[int, str], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for classes, target, passed in counted:
        for klass in classes:
            tally[(int(klass), str(target))]["defended" if passed else "FAILED"] += 1
    if not tally:
        return
    write = terminalreporter.write_line
    write("")
    write("attack suite tally (class, target: tests defended / failed)")
    for (klass, target), counts in sorted(tally.items()):
        write(
            f"  {klass} {ATTACKS.get(klass, '?'):<45} {target:<12} "
            f"defended {counts['defended']:>3}  failed {counts['FAILED']:>3}"
        )
