"""The agent's entry point: private copies of the stream, the key, the digests of the files
it runs from, then the main loop (agent part, always the last).

Part of the agent's joined source (:mod:`runtimes.channel.agent`): standard library only,
Python >= 3.8; never imported by the host.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .serve import Agent
from .wire import DIGEST, DIGEST_SIZE, KEY, NON_DUMPABLE, READ_CHUNK, digests_to_wire


def main() -> None:
    # Private copies of the stream; fds 0 and 1 point at /dev/null so that nothing written
    # to sys.stdout by accident can corrupt the framing.
    in_fd = os.dup(0)
    out_fd = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    for fd in (in_fd, out_fd):
        os.set_inheritable(fd, False)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # The bootstrap made the process non-dumpable before it read anything (set in the
    # namespace it runs this source in); the key arrives only after it said so.
    flags = NON_DUMPABLE if globals().get("_vf_nodump") else 0
    opening = read_exact(in_fd, KEY + 1)
    agent = Agent(in_fd, out_fd, opening[:KEY], flags)
    files = open_own_files() if opening[KEY] & 1 else None
    if files is not None:
        # Opened before HELLO (before any command can run): a file replaced afterwards is a
        # new inode, and the running interpreter cannot be rewritten in place (ETXTBSY).
        threading.Thread(target=report_digests, args=(agent, files), daemon=True).start()
    agent.serve()


def read_exact(fd: int, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            os._exit(3)
        data += chunk
    return data


def own_files() -> list[str]:
    """The files this agent's code comes from: the interpreter, every module loaded (source
    and cached bytecode), and the dynamic loader's preload list (absent or not)."""
    paths = [os.path.realpath(sys.executable), "/etc/ld.so.preload"]
    for module in list(sys.modules.values()):
        spec = getattr(module, "__spec__", None)
        for name in (getattr(spec, "origin", None), getattr(spec, "cached", None)):
            if name and os.path.isabs(name) and name not in paths:
                paths.append(name)
    return paths


def open_own_files() -> list[tuple[str, int]]:
    opened = []
    for path in own_files():
        try:
            opened.append((path, os.open(path, os.O_RDONLY | os.O_CLOEXEC)))
        except OSError:
            opened.append((path, -1))  # absent (a bytecode cache, the preload list)
    return opened


def report_digests(agent: Agent, files: list[tuple[str, int]]) -> None:
    import hashlib

    digests = []
    for path, fd in files:
        if fd < 0:
            digests.append((path, bytes(DIGEST_SIZE)))
            continue
        digest = hashlib.sha256()
        try:
            while chunk := os.read(fd, READ_CHUNK):
                digest.update(chunk)
        except OSError:
            continue
        finally:
            os.close(fd)
        digests.append((path, digest.digest()))
    agent.out.send(DIGEST, 0, digests_to_wire(digests))


if __name__ in ("__main__", "__vf_sandbox_agent__"):
    main()
