"""Attack class 12: a snapshot or a fork of a sandbox the policy arranged.

A fork judge (``placement="fork"``) runs in a fresh sandbox started from a snapshot of the
rollout's sandbox, taken after the policy ended. The policy controls what is snapshotted: the
tree of the workdir (subprocess, SSH: copied), the whole filesystem (Docker: committed), and
whatever it left running while the copy reads. The safe outcomes:

* a workdir copy holds the workdir and nothing else: links are copied as links, a directory
  swapped for a link (before or *while* the copy reads it) is never read through, nothing
  outside the workdir is read into the snapshot or written; a copy either succeeds or raises a
  typed ``SandboxError``;
* a fork is a private copy, never a directory of the caller's, and runs nothing the policy left
  running;
* a fork judge is protected against binaries the policy replaced (``/bin/sh``, ``python3``) as a
  judge in the live sandbox is: the channel never starts through them, and a verdict they forge
  is never accepted;
* the host never reads a config the policy planted (``vf-sandbox.yaml`` and the like): a fork's
  config is the caller's.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from harnesses.scripted import bash_call, reply
from runtimes import (
    Runtime,
    SandboxError,
    SandboxInvalidArgumentError,
    open_runtime,
    remove_snapshot,
    resolve_runtime_config,
)
from runtimes.config import RuntimeConfig
from runtimes.snapshot import SandboxSnapshot, held_snapshots
from runtimes.subprocess import SubprocessConfig
from runtimes.subprocess.snapshots import TREE
from tests.placement import conftest as placement_fixtures
from tests.placement.conftest import ModelsFactory

from .conftest import Hostile
from .test_judges import WRITE_FAIL, bash_judge, judge_once, name

pytestmark = pytest.mark.anyio

scripted_models = placement_fixtures.scripted_models

COPIES = ["subprocess", "ssh-user"]
"""The targets whose snapshots copy the workdir (subprocess: the host process's own user; SSH:
root login, the policy as the host's ``sandbox`` account)."""


def config_of(hostile: Hostile, tmp_path: Path) -> RuntimeConfig:
    """The target's config as a model (subprocess: under a private root of this test)."""
    if hostile.backend == "subprocess":
        return SubprocessConfig(root=str(tmp_path / "root"))
    return resolve_runtime_config(hostile.config)


async def _tree_listing(snap: SandboxSnapshot, host: Runtime) -> str:
    """``find TREE -printf 'path type link'`` of the snapshot's copy, run on the host that holds
    it (through ``host``, a sandbox there); find follows no link unless told to."""
    argv = ["find", f"{snap.id}/{TREE}", "-mindepth", "1", "-printf", "%P %y %l\\n"]
    result = await host.exec(argv, cwd="/", timeout=30)
    assert result.exit_code == 0, result
    return result.stdout


# ---------------------------------------------------------------------- planted links

HOSTILE = r"""
set -e
ln -s /etc/shadow evil
ln -s ../../ up
ln -s /etc etc_dir
ln -s / root_dir
mkdir inner
ln -s ../../../../../../etc/passwd inner/climb
"""


@pytest.mark.attack(12)
@pytest.mark.parametrize("hostile", COPIES, indirect=True)
async def test_a_hostile_workdir_is_copied_link_for_link(hostile: Hostile, tmp_path: Path) -> None:
    config = config_of(hostile, tmp_path)
    async with open_runtime(config) as source:
        planted = await source.exec(["sh", "-c", HOSTILE], user=source.policy_user)
        assert planted.exit_code == 0, planted
        snap = await source.snapshot()
        try:
            listing = sorted((await _tree_listing(snap, source)).splitlines())
            assert listing == [
                "etc_dir l /etc",
                "evil l /etc/shadow",
                "inner d ",
                "inner/climb l ../../../../../../etc/passwd",
                "root_dir l /",
                "up l ../../",
            ], "links are copied as links; nothing they point to is"
            async with open_runtime(config, snapshot=snap) as fork:
                for name, target in [
                    ("evil", "/etc/shadow"),
                    ("up", "../../"),
                    ("etc_dir", "/etc"),
                ]:
                    found = await fork.exec(["readlink", name])
                    assert found.stdout == target + "\n"
                inside = await fork.exec(["find", ".", "-mindepth", "1", "-type", "f"])
                assert inside.stdout == "", "no file of /etc came along"
        finally:
            await remove_snapshot(snap)


@pytest.mark.attack(12)
@pytest.mark.parametrize("hostile", COPIES, indirect=True)
async def test_a_workdir_swapped_for_a_link_is_not_snapshotted(
    hostile: Hostile, tmp_path: Path
) -> None:
    config = config_of(hostile, tmp_path)
    async with open_runtime(config) as source:
        workdir = source.workdir
        swap = f"mv {workdir} {workdir}.real && ln -s /etc {workdir}"
        done = await source.exec(["sh", "-c", swap], cwd="/")
        assert done.exit_code == 0, done
        before = {s.id for s in await type(source).list_snapshots(config)}
        with pytest.raises(SandboxError, match="not a directory"):
            await source.snapshot()
        assert {s.id for s in await type(source).list_snapshots(config)} == before
        assert not held_snapshots()
        await source.exec(["sh", "-c", f"rm {workdir} && mv {workdir}.real {workdir}"], cwd="/")


@pytest.mark.attack(12)
@pytest.mark.parametrize("hostile", COPIES, indirect=True)
async def test_a_fork_gets_a_private_workdir_never_one_of_yours(
    hostile: Hostile, tmp_path: Path
) -> None:
    config = config_of(hostile, tmp_path)
    async with open_runtime(config) as source:
        await source.write("mine.txt", b"1")
        snap = await source.snapshot()
        try:
            own = config.model_copy(update={"workdir": str(tmp_path / "own")})
            with pytest.raises(SandboxInvalidArgumentError, match="private copy"):
                open_runtime(own, snapshot=snap)
            async with open_runtime(config, snapshot=snap) as fork:
                assert fork.workdir != source.workdir
                assert await fork.read("mine.txt") == b"1"
        finally:
            await remove_snapshot(snap)


# ---------------------------------------------------------------------- a swap while copying

SWAPPER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, RENAME_EXCHANGE = -100, 2
stop, pairs = sys.argv[1], int(sys.argv[2])
names = [(f"d{i}".encode(), f"d{i}.link".encode()) for i in range(pairs)]
open("swapper.started", "w").close()
end = time.monotonic() + 120
while time.monotonic() < end and not os.path.exists(stop):
    for real, link in names:
        if libc.renameat2(AT_FDCWD, real, AT_FDCWD, link, RENAME_EXCHANGE) != 0:
            sys.exit(f"renameat2 failed: {os.strerror(ctypes.get_errno())}")
"""
"""The policy's leftover: exchanges each directory ``dI`` with the link ``dI.link`` (atomically,
``renameat2(RENAME_EXCHANGE)``) as fast as it can, until ``stop`` exists (at most 120 s)."""

PLANT_PAIRS = r"""
set -e
for i in $(seq 0 $(($1 - 1))); do
  mkdir "d$i"
  for name in $2; do
    mkdir -p "d$i/$(dirname "$name")"; printf 'decoy %s\n' "$name" > "d$i/$name"
  done
  ln -s "$3" "d$i.link"
done
"""
"""``sh -c PLANT_PAIRS sh PAIRS NAMES TARGET``: directories ``dI`` holding decoy files named
like what the policy wants (``NAMES``), each with a link ``dI.link`` to ``TARGET``."""

SCAN = r"""
import os, stat, sys
root, needles = sys.argv[1], [bytes.fromhex(n) for n in sys.argv[2:]]
files = 0
for top, dirs, names in os.walk(root):
    for name in names:
        path = os.path.join(top, name)
        if not stat.S_ISREG(os.lstat(path).st_mode):
            continue
        files += 1
        data = open(path, "rb").read()
        for needle in needles:
            if needle in data:
                print("FOUND", os.path.relpath(path, root))
        if data and not data.startswith(b"decoy "):
            print("FOREIGN", os.path.relpath(path, root))
print("files", files)
"""
"""``python3 -c SCAN DIR HEX...``: every regular file under DIR (links never followed) that
holds one of the needles, or is neither empty nor a decoy the policy planted; then how many
files there are."""

IN_WORKDIR = r"""
import os, sys
under, count = os.path.realpath(sys.argv[1]), 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        continue
    if int(pid) != os.getpid() and (cwd == under or cwd.startswith(under + "/")):
        count += 1
print(count)
"""

PAIRS = 40
ROUNDS = 4


async def _host_secret(source: Runtime, hostile: Hostile, tmp_path: Path) -> tuple[str, bytes]:
    """A directory of the host (subprocess: this machine; SSH: the SSH host) holding
    ``secret.txt``, made by the host's machinery (root; the policy's account cannot read it on
    SSH). Returns the directory and the secret."""
    secret = f"host-secret-{secrets.token_hex(16)}".encode()
    if hostile.backend == "subprocess":
        directory = tmp_path / "host-secret"
        directory.mkdir(mode=0o700)
        (directory / "secret.txt").write_bytes(secret)
        return str(directory), secret
    directory = f"/root/host-secret-{secrets.token_hex(4)}"
    script = 'mkdir -m 0700 "$1" && cat > "$1/secret.txt" && chmod 0600 "$1/secret.txt"'
    made = await source.exec(["sh", "-c", script, "sh", directory], stdin=secret, cwd="/")
    assert made.exit_code == 0, made
    return directory, secret


async def _listing(rt: Runtime, directory: str) -> str:
    """Every entry under ``directory`` with its size and mtime (to show nothing was written)."""
    argv = ["find", directory, "-printf", "%p %y %s %T@\\n"]
    result = await rt.exec(argv, cwd="/", timeout=30)
    assert result.exit_code == 0, result
    return "".join(sorted(result.stdout.splitlines(keepends=True)))


async def _running(rt: Runtime) -> int:
    """How many processes (but the probe) work in ``rt``'s workdir (as the policy: root in a
    container may not read another user's cwd)."""
    result = await rt.exec(["python3", "-c", IN_WORKDIR, rt.workdir], user=rt.policy_user)
    assert result.exit_code == 0, result
    return int(result.stdout)


async def _scan(rt: Runtime, directory: str, secret: bytes) -> list[str]:
    result = await rt.exec(["python3", "-c", SCAN, directory, secret.hex()], cwd="/", timeout=60)
    assert result.exit_code == 0, result
    return result.stdout.splitlines()


@pytest.mark.attack(6, 12)
@pytest.mark.parametrize("hostile", COPIES, indirect=True)
@pytest.mark.parametrize("target", ["secret-dir", "root"])
async def test_a_leftover_swapping_directories_for_links_during_the_copy(
    hostile: Hostile, tmp_path: Path, target: str
) -> None:
    """While the workdir is copied, the policy's leftover keeps exchanging directories of the
    workdir with links to a host directory holding a secret (or to ``/``), each directory
    holding decoys named like what it wants read. Each snapshot holds only the decoys, or
    fails typed; nothing outside the workdir changes; a fork runs none of the policy's
    processes."""
    config = config_of(hostile, tmp_path)
    async with open_runtime(config) as source:
        secret_dir, secret = await _host_secret(source, hostile, tmp_path)
        link_to, names = (secret_dir, "secret.txt")
        if target == "root":
            # / holds etc/hostname: a copy that read through the link brings foreign files
            link_to, names = ("/", "etc/hostname")
        plant = await source.exec(
            ["sh", "-c", PLANT_PAIRS, "sh", str(PAIRS), names, link_to],
            user=source.policy_user,
            timeout=60,
        )
        assert plant.exit_code == 0, plant
        outside = await _listing(source, secret_dir)
        stop = f"{source.workdir}/swapper.stop"
        swapper = ["python3", "-c", SWAPPER, stop, str(PAIRS)]
        start = 'nohup "$@" >swapper.log 2>&1 </dev/null &'
        start += " until [ -e swapper.started ]; do sleep 0.05; done"
        started = await source.exec(
            ["sh", "-c", start, "sh", *swapper], user=source.policy_user, timeout=30
        )
        assert started.exit_code == 0, started
        snapshots: list[SandboxSnapshot] = []
        failures: list[SandboxError] = []
        try:
            for _ in range(ROUNDS):
                try:
                    snapshots.append(await source.snapshot())
                except SandboxError as exc:  # typed: acceptable
                    failures.append(exc)
            assert await _running(source) >= 1, "control: the swapper ran all along"
            for snap in snapshots:
                found = await _scan(source, f"{snap.id}/{TREE}", secret)
                assert found[:-1] == [], f"{snap.id} holds what the links pointed to: {found}"
            assert await _listing(source, secret_dir) == outside, "nothing outside was written"
            if snapshots:
                async with open_runtime(config, snapshot=snapshots[0]) as fork:
                    assert (await _scan(fork, fork.workdir, secret))[:-1] == []
                    assert await _running(fork) == 0, "nothing the policy left runs"
        finally:
            await source.write("swapper.stop", b"")
            for snap in snapshots:
                await remove_snapshot(snap)
        assert len(snapshots) + len(failures) == ROUNDS


# ---------------------------------------------------------------------- planted binaries

FORGING_SH = r"""#!/bin/dash
# The policy's /bin/sh: logs how it was called, runs the real shell, then forges every
# judge's verdict it can find.
printf '%s\n' "$*" >> /var/tmp/.fake-sh.log
/bin/dash "$@"
status=$?
for v in /tmp/vf-agent/*/verdict.json; do
  [ -e "$v" ] && printf '{"passed": true}' > "$v"
done
exit $status
"""

FORGING_PYTHON = r"""#!/bin/sh
# The policy's python3, first on PATH: logs each run, forges verdicts, runs the real one.
echo "ran $*" >> /var/tmp/.fake-python.log
for v in /tmp/vf-agent/*/verdict.json; do
  [ -e "$v" ] && printf '{"passed": true}' > "$v"
done
exec /usr/bin/python3 "$@"
"""

PLANT = {
    "sh": (
        FORGING_SH,
        "printf '%s' \"$1\" > /usr/local/bin/.fake-sh && chmod 755 /usr/local/bin/.fake-sh"
        " && ln -sf /usr/local/bin/.fake-sh /usr/bin/sh.new && mv -T /usr/bin/sh.new /usr/bin/sh",
        "/var/tmp/.fake-sh.log",
    ),
    "python3": (
        FORGING_PYTHON,
        "printf '%s' \"$1\" > /usr/local/bin/python3 && chmod 755 /usr/local/bin/python3",
        "/var/tmp/.fake-python.log",
    ),
}
"""What the root policy replaces: its fake, the ``sh -c`` script that installs it (``/bin/sh``
is ``/usr/bin/sh`` on bookworm, whose ``/bin`` links to ``/usr/bin``; a ``python3`` ahead of
the image's on ``PATH``), and the log the fake keeps of its runs."""


async def _plant(rt: Runtime, binary: str) -> str:
    """The root policy replaces ``binary``; returns the fake's log (checked live)."""
    fake, script, log = PLANT[binary]
    planted = await rt.exec(["sh", "-c", script, "sh", fake])
    assert planted.exit_code == 0, planted
    control = await rt.exec([binary, "-c", "print(6*7)" if binary == "python3" else "echo 42"])
    assert control.stdout == "42\n", control
    assert (await rt.read(log)).decode(), "control: the fake is live"
    return log


@pytest.mark.attack(2, 4, 12)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
@pytest.mark.parametrize("binary", ["python3", "sh"])
@pytest.mark.parametrize("placement", ["rollout", "fork"])
@pytest.mark.parametrize("accounts", ["default", "root-only"])
async def test_a_binary_the_root_policy_replaced_never_forges_a_fork_judges_verdict(
    hostile: Hostile, scripted_models: ModelsFactory, placement: str, binary: str, accounts: str
) -> None:
    """A bash judge writes ``{"passed": false}``; the policy's ``python3`` or ``/bin/sh``
    writes ``{"passed": true}`` over it whenever it runs. The judge's own verdict or a typed
    error, in the live sandbox (``rollout``) as in a fork. ``root-only``: the sandbox has no
    policy account (``policy_user=None``), so no judges' account either: the judge runs as
    root, and only the channel agent's own file operations stand between the policy's
    programs and the verdict."""
    judge = name("bin")
    models = scripted_models({judge: [bash_call(WRITE_FAIL), reply("done")]})
    config = hostile.config if accounts == "default" else {**hostile.config, "policy_user": None}
    async with open_runtime(config) as rt:
        await _plant(rt, binary)
        runs, error = await judge_once(rt, bash_judge(judge, placement=placement), models)
        assert runs[0].verdict != {"passed": True}, "a forged verdict was accepted"
        assert error is None, error
        assert runs[0].verdict == {"passed": False}


AGENT_START = "vf-sandbox channel agent"


@pytest.mark.attack(4, 12)
@pytest.mark.parametrize("hostile", ["docker-root"], indirect=True)
@pytest.mark.parametrize("binary", ["python3", "sh"])
async def test_a_forks_channel_never_starts_through_a_binary_the_root_policy_replaced(
    hostile: Hostile, binary: str
) -> None:
    """The live sandbox's agent started before the policy ran; a fork's first agent starts in
    the policy's filesystem. It must never start through the policy's ``python3`` or ``sh``.

    A root policy is configured as docs/security.md says (``policy_user=None``): with a policy
    account, root's changes are the host's own and the snapshot is trusted unread."""
    config = {**hostile.config, "policy_user": None}
    async with open_runtime(config) as rt:
        log = await _plant(rt, binary)
        await rt.exec(["rm", "-f", log])
        snap = await rt.snapshot()
        try:
            async with open_runtime(config, snapshot=snap) as fork:
                assert (await fork.exec(["echo", "fork"])).stdout == "fork\n"
                assert (await fork.exec(["sh", "-c", "exit 7"])).exit_code == 7
                ran = await fork.exec(["cat", log])
                runs = ran.stdout if ran.exit_code == 0 else ""
                info = fork.channel_info
                assert "import" not in runs and "-I" not in runs, (info, runs)
        finally:
            await remove_snapshot(snap)


# ---------------------------------------------------------------------- planted configs

CONFIG_NAMES = [
    "vf-sandbox.yaml",  # the inspect provider's CONFIG_FILES (runtimes/inspect_sandbox.py)
    "vf-sandbox.yml",
    "vf-sandbox.json",
    ".vf-sandbox.yaml",
    ".vf-sandbox.yml",
    ".vf-sandbox.json",
    "snapshot.json",
    "sandbox.json",
]
"""Every config file name the host reads (the inspect provider's), their hidden variants,
and the metadata files the workdir copies keep beside their trees."""


def planted_config(tmp_path: Path) -> str:
    """A config that would hand the fork a host directory (and another image, backend, root,
    workdir, labels) if any host code read it."""
    return json.dumps(
        {
            "type": "docker",
            "image": "busybox:planted",
            "mounts": [{"source": str(tmp_path), "target": "/host"}],
            "root": str(tmp_path / "planted-root"),
            "workdir": str(tmp_path),
            "labels": {"vf-sandbox.keep": "true", "planted": "yes"},
            "policy_user": None,
        }
    )


@pytest.mark.attack(12)
@pytest.mark.parametrize("hostile", ["subprocess", "docker-root", "ssh-user"], indirect=True)
async def test_config_files_the_policy_planted_are_never_read(
    hostile: Hostile, tmp_path: Path, scripted_models: ModelsFactory
) -> None:
    """The policy plants every config file name in its workdir (and ``/`` where it is root);
    the snapshot, the fork and a fork judge use the caller's config, never those."""
    config = config_of(hostile, tmp_path)
    planted = planted_config(tmp_path)
    places = [""] if hostile.privilege != "root" else ["", "/", "/tmp/"]
    async with open_runtime(config) as source:
        for place in places:
            for file in CONFIG_NAMES:
                path = f"{place}{file}" if place else file
                write = 'cat > "$1"'
                done = await source.exec(
                    ["sh", "-c", write, "sh", path], stdin=planted.encode(), user=hostile.user
                )
                assert done.exit_code == 0, done
        snap = await source.snapshot()
        try:
            assert snap.labels.get("planted") is None and not snap.kept
            assert snap.backend == config.type
            async with open_runtime(config, snapshot=snap) as fork:
                assert fork.config == config, "the fork's config is the caller's"
                assert await fork.read("vf-sandbox.yaml") == planted.encode()
                assert not await fork.exists("/host/" + tmp_path.name)
                mounts = await fork.exec(["sh", "-c", "grep -c ' /host ' /proc/mounts || true"])
                assert mounts.stdout.strip() == "0"
                if hostile.backend == "subprocess":
                    assert Path(fork.workdir).parent.parent == tmp_path / "root"
            judge = name("cfg")
            check = 'test ! -e /host && printf \'{"passed": false}\' > "$VF_AGENT_VERDICT"'
            models = scripted_models({judge: [bash_call(check), reply("done")]})
            runs, error = await judge_once(source, bash_judge(judge, placement="fork"), models)
            assert error is None, error
            assert runs[0].verdict == {"passed": False}
        finally:
            await remove_snapshot(snap)
        assert not (tmp_path / "planted-root").exists()
