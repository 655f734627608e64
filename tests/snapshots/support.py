"""What the snapshot tests share: the backends they run on, a tree that exercises what a copy or a
commit can get wrong, and probes run inside the sandboxes (a manifest of the workdir, the
processes running in it)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtimes import Runtime
from runtimes.config import RuntimeConfig

REPO = Path(__file__).resolve().parents[2]

MANIFEST = r"""
import hashlib, json, os, stat, sys
root = sys.argv[1]
seen, out = {}, {}
for top, dirs, files in os.walk(root):
    dirs.sort()
    for name in sorted(dirs + files):
        path = os.path.join(top, name)
        st = os.lstat(path)
        rel = os.path.relpath(path, root)
        entry = {"mode": oct(stat.S_IMODE(st.st_mode)), "owner": [st.st_uid, st.st_gid]}
        if stat.S_ISLNK(st.st_mode):
            entry["link"] = os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as fh:
                entry["sha256"] = hashlib.sha256(fh.read()).hexdigest()
            entry["mtime"] = int(st.st_mtime)
            key = (st.st_dev, st.st_ino)
            entry["same_as"] = seen.setdefault(key, rel)
        elif stat.S_ISDIR(st.st_mode):
            entry["kind"] = "dir"
        else:
            entry["kind"] = oct(stat.S_IFMT(st.st_mode))
        out[rel] = entry
print(json.dumps(out, sort_keys=True))
"""
"""``python3 -c MANIFEST DIR``: every entry under DIR (links not followed) with its mode, owner,
link target or content digest, and which earlier path a hard link shares its inode with."""

PROCESSES = r"""
import os, sys
under, argv = os.path.realpath(sys.argv[1]), sys.argv[2:]
want = ("\0".join(argv) + "\0").encode()
count = 0
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if open(f"/proc/{pid}/cmdline", "rb").read() != want:
            continue
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        continue
    if cwd == under or cwd.startswith(under + "/"):
        count += 1
print(count)
"""
"""``python3 -c PROCESSES DIR ARGV...``: how many processes run exactly ARGV with their working
directory in DIR (sandboxes on one host tell theirs apart by it)."""

SLEEPER = ["sleep", "4321"]

POPULATE = r"""
set -e
mkdir -p keep/sub empty
printf 'v1' > changed.txt
printf 'gone' > deleted.txt
printf '\000\001\377binary' > keep/sub/bin.dat
printf 'data' > hard1
ln hard1 hard2
printf '#!/bin/sh\necho hi\n' > script.sh
chmod 0750 script.sh
chmod 0600 keep/sub/bin.dat
printf 'x' > "$(printf 'new\nline')"
ln -s changed.txt link
ln -s no-such-target dangling
ln -s /etc/shadow evil
ln -s ../../ up
ln -s /etc etc_dir
"""
"""Run in the workdir as the policy: a tree with what a copy or a commit may get wrong."""

CHANGE = r"""
set -e
printf 'v2, longer' > changed.txt
rm deleted.txt
printf 'new' > keep/added.txt
"""
"""Run after POPULATE: a change, a deletion, an addition (the same instant as a snapshot would
show them)."""


@dataclass
class Backend:
    """One backend the snapshot tests run on."""

    name: str
    config: RuntimeConfig
    modal_state: Path | None = None
    """The fake Modal service's state directory (children share it)."""

    @property
    def holds_filesystem(self) -> bool:
        return self.config.type in ("docker", "modal")


def policy(rt: Runtime) -> str | None:
    """Who the policy runs as in ``rt``."""
    return rt.policy_user


async def populate(rt: Runtime) -> None:
    """The tree of :data:`POPULATE` and :data:`CHANGE`, written by the policy, plus a file the
    machinery writes (its owner must survive too)."""
    for script in (POPULATE, CHANGE):
        result = await rt.exec(["sh", "-c", script], user=policy(rt), timeout=60)
        assert result.exit_code == 0, result
    await rt.write("machinery.txt", b"written by the host")


async def manifest(rt: Runtime) -> dict[str, Any]:
    result = await rt.exec(["python3", "-c", MANIFEST, rt.workdir], timeout=60)
    assert result.exit_code == 0, result
    found: dict[str, Any] = json.loads(result.stdout)
    return found


async def start_sleeper(rt: Runtime) -> None:
    argv = ["sh", "-c", 'exec "$@" >/dev/null 2>&1 </dev/null &', "sh", *SLEEPER]
    result = await rt.exec(argv, user=policy(rt), timeout=30)
    assert result.exit_code == 0, result


async def sleepers(rt: Runtime) -> int:
    # as the policy: a container's root may not read the working directory of another user's
    # process (no CAP_SYS_PTRACE)
    argv = ["python3", "-c", PROCESSES, rt.workdir, *SLEEPER]
    result = await rt.exec(argv, user=policy(rt), timeout=30)
    assert result.exit_code == 0, result
    return int(result.stdout)


def child_process(backend: Backend, mode: str, *, keep: bool = False) -> tuple[Any, dict[str, Any]]:
    """A python process that opens a sandbox of ``backend``, snapshots it and prints the
    snapshot (``mode``: ``hang`` until killed, or ``exit`` without closing anything)."""
    args = [
        sys.executable,
        "-m",
        "tests.snapshots.child",
        json.dumps(backend.config.model_dump(mode="json")),
        str(backend.modal_state or ""),
        mode,
        "keep" if keep else "",
    ]
    child = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.kill()
        _, err = child.communicate(timeout=60)
        raise AssertionError(f"the child failed: {err}")
    return child, json.loads(line)
