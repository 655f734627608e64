"""The channel agent: runs INSIDE a sandbox, serving one host over its stdin and stdout.

Standard library only, Python >= 3.8. It is written as the parts of this package, each a
module the linters check, and shipped as ONE source: :func:`joined_source` joins the parts in
:data:`PARTS` order, dropping each part's docstring, its imports of other parts (relative
imports) and of ``typing``, and its ``if TYPE_CHECKING:`` blocks, and hoisting the standard
library imports into one block. The host sends that source through the stream it just opened
(see ``BOOTSTRAP`` in :mod:`runtimes.channel.bootstrap`), so nothing is installed and nothing
costs a round trip per request. The agent never imports anything from ``runtimes``; the host
imports the shared parts, :mod:`.wire` (frame layout, kinds, typed headers), :mod:`.codec`
(sealing and opening authenticated frames; the shell driver's too) and :mod:`.stream` (a
relayed connection's windowed pumps), so that both sides speak from one definition; the
subprocess backend imports :mod:`.sweep` (with :mod:`.procs`), the one freeze-then-kill sweep,
to run it on the host (the installed package's code, loaded by the machinery as any other
module of it: nothing a sandbox could write).

Framing, both directions: ``type (u8) | request id (u32) | length (u32) | payload | tag``,
integers big-endian; ``tag`` is HMAC-SHA256 (truncated to 16 bytes) under the per-start key
over the direction's frame sequence number (u64), the header and the payload. The key comes
over stdin right after the source (the bootstrap made the process non-dumpable first, and says
``ready``): it never appears in argv, the environment or a file. A frame from the host that
fails authentication makes the agent say ``ALERT`` and exit; see ``docs/channel.md``.

Everything is binary: data (stdin, file contents, output) travels raw, and request headers
(:mod:`.wire`: ``ExecHeader``, ``ReadHeader``...) are fixed fields plus ``text`` strings
(``u32`` length + UTF-8 with surrogateescape), so no payload byte is ever escaped. Requests
are multiplexed: each runs in its own worker thread, so a slow command or a blocked pipe never
stalls the others, and the main thread only reads frames and hands them out (and spawns
commands, so they start at once).

Requests (host -> agent):

* ``EXEC``: ``u32 header length | header | inline stdin``; header = ``u8 flags`` (1: stdin
  follows, 2: stdin complete) ``| u64 output cap | text cwd | text user ("": the agent's) |
  u32 argc | argc x text | u32 envc | envc x (text name, text value)``. Answered by
  ``STARTED`` (``u32`` process group id: every command runs in its own session, ``setsid``),
  ``STDOUT`` / ``STDERR`` chunks as they arrive, then ``EXIT`` (``i32``; 128+N for a death by
  signal N), or by one ``ERROR`` if it could not start.
* ``DATA`` / ``EOF``: more stdin of an ``EXEC``, or more content of a ``WRITE``. Each chunk
  sent as ``DATA`` is acknowledged with ``ACK`` (``u32`` bytes consumed) once written: the
  host keeps a bounded window in flight, so memory here stays bounded whatever the size.
  The host may send stdin as it comes (an EXEC with stdin following, nothing inline, DATA
  frames as the caller yields them); it sends none before ``STARTED``, which such an EXEC
  gets at once (others get it with the first output, or a few milliseconds in). A command
  that stops reading (it closed its stdin or exited) is reported once by ``STDIN_CLOSED``:
  the host stops sending; later DATA is acknowledged and dropped.
* ``KILL``: kill the request's whole process group (``EXEC``), or abandon a transfer.
* ``READ`` (``u64 cap | text path``): ``CHUNK`` frames, then ``DONE``; a file over the cap is
  refused before anything is sent.
* ``WRITE`` (``u32 header length | u8 flags (2: complete) | text path | inline data``):
  parents created, then ``DONE``.
* ``STAT`` (``text path``): ``DONE`` with one byte, 1 if something is there (``lstat``: a
  dangling link exists). ``REMOVE`` (``text path``): a file, a link or a tree, then ``DONE``.
* ``LSTAT`` (``u64 cap | text path``): ``DONE`` with ``u8 kind | u32 mode | u32 uid | u32 gid
  | u32 links | u64 size | text link target | content`` (:mod:`.paths`): never follows a
  link; a regular file's first cap + 1 bytes through ``O_NOFOLLOW``. ``MKDIR`` (``u32 mode |
  i32 uid | i32 gid | text path``): one fresh directory in a parent that is no link, with
  exactly that mode and owner, then ``DONE``. The judge machinery's probes use these instead
  of ``sh``, ``stat`` and ``mkdir`` in the sandbox.
* ``HALT`` (empty, at close): ``kill(-1, SIGSTOP)`` — every process the agent may signal but
  itself and PID 1, in one call the kernel makes atomic against ``fork`` — then SIGKILL to all
  but the keep-alive until ``/proc`` lists no other process but zombies (a signalled process
  dies when it next runs), ``DONE``, and the keep-alive's SIGKILL; ``ERROR`` (``ETIMEDOUT``) if
  one still runs after ``HALT_SETTLE`` seconds.
* ``SWEEP`` (``text mode | text mark | text user | text home``: ``scripts/sweep.sh``'s
  arguments): ``stop_processes()`` done by the agent itself, on its main thread, forking
  nothing (:mod:`.sweep`): it works at the sandbox's process limit, where the script cannot
  start. ``DONE`` with ``u32`` the number killed.

``HELLO`` (request id 0, first frame): ``u32 version, pid, sid, uid, gid, flags | text python
| text executable`` (flags: 1 non-dumpable). ``DIGEST`` (request id 0, when the host asked at
the first start): sha256 of the interpreter, of every module loaded and of
``/etc/ld.so.preload`` (zeros: absent), for the host to verify before a restart.
``ERROR``: ``i32 errno | text what | text message``; ``what`` is ``prog``, ``cwd``, ``user``,
``path``, ``limit``, ``special`` (a FIFO or a socket where a file is expected: refused, never
waited on), ``pids`` (no process, or no thread to serve the request, could be made: the
process limit; the message is the cgroup's ``pids.max``), ``internal`` (an unexpected
failure, message attached) or ``unsupported`` (the host then uses its plain path).

The relay (``LISTEN``, see :mod:`.relay`): a TCP listener on the sandbox's loopback whose
connections are carried as streams over this channel to a port on the host (the model proxy),
each with a bounded window of unacknowledged bytes per direction.

On EOF of its stdin (the host closed the channel, or died) the agent kills the process group
of every command still running, closes every relayed connection, then exits.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PARTS = (
    "wire",
    "codec",
    "stream",
    "output",
    "procs",
    "sweep",
    "execute",
    "files",
    "paths",
    "relay",
    "serve",
    "main",
)
"""The agent's parts, in the order they are joined: a part only uses names of earlier parts
at import time (class bases, module constants)."""

PROLOGUE = (
    '"""The vf-sandbox channel agent, joined from runtimes/channel/agent/ '
    '(see docs/channel.md)."""\n\nfrom __future__ import annotations\n\n'
)


@cache
def joined_source() -> str:
    """The agent's one source, as the bootstrap runs it.

    Raises:
        RuntimeError: a part imports a part that is not joined before it.
    """
    return join_sources([Path(__file__).parent / f"{name}.py" for name in PARTS], PROLOGUE)


def join_sources(paths: list[Path], prologue: str) -> str:
    """Modules joined into one source as :func:`joined_source` joins the agent's parts (the
    shell driver is joined this way too, after :mod:`.wire` and :mod:`.codec`): a module's
    relative imports may only name modules before it in ``paths``.

    Raises:
        RuntimeError: a module imports a module that is not joined before it.
    """
    imports: list[str] = []
    bodies: list[str] = []
    stems = tuple(path.stem for path in paths)
    for index, path in enumerate(paths):
        source = path.read_text(encoding="utf-8")
        hoisted, body = _split_part(path.stem, source, stems[:index])
        imports += hoisted
        bodies.append(body)
    return prologue + "".join(sorted(set(imports))) + "\n\n" + "\n\n".join(bodies)


def _split_part(name: str, source: str, earlier: tuple[str, ...]) -> tuple[list[str], str]:
    """(standard library import lines, the rest) of one part, without what joining drops."""
    lines = source.splitlines(keepends=True)
    dropped: set[int] = set()
    hoisted = []
    tree = ast.parse(source, f"{name}.py")
    for index, node in enumerate(tree.body):
        span = range(node.lineno - 1, (node.end_lineno or node.lineno))
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            dropped.update(span)  # the part's docstring
        elif _is_type_checking_block(node):
            dropped.update(span)
        elif isinstance(node, ast.ImportFrom) and node.level:
            if (node.module or "").rsplit(".", 1)[-1] not in earlier:
                raise RuntimeError(f"agent part {name!r} imports {node.module!r}: not before it")
            dropped.update(span)
        elif isinstance(node, ast.ImportFrom) and node.module in ("__future__", "typing"):
            dropped.update(span)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            if any(alias.name == "typing" for alias in node.names):
                raise RuntimeError(f"agent part {name!r} imports typing at run time")
            dropped.update(span)
            hoisted.append("".join(lines[i] for i in span))
    body = "".join(line for i, line in enumerate(lines) if i not in dropped)
    return hoisted, body.strip("\n") + "\n"


def _is_type_checking_block(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Name)
        and node.test.id == "TYPE_CHECKING"
        and not node.orelse
    )
