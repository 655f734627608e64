"""Run inside a sandbox, as root, by :mod:`runtimes.recycle` (``python3 -I -S -c``, from
``/``, the machinery's ``PATH``): empties a sandbox's writable places and reports what is
left that a next user could see. Python 3.8+, standard library only; never imported by
the host (it reads this file's text).

``argv``: ``survey`` or ``reset``, the channel agent's pid (its session is the runtime's
own; 0: none), then ``PLACE=MODE:UID:GID`` for each writable place and ``+PLACE`` for each
place only root can write (listed one level deep, never emptied). ``reset`` empties every
place (links removed, never followed), gives it back that owner and mode, removes its
extended attributes and every System V IPC object (each as its owner), then surveys. The
survey, one JSON object on stdout: ``stray`` (processes outside session 1, the agent's
session and the probe's own), ``ipc``, ``net`` (the sockets the kernel lists: unix, udp,
raw, packet; this namespace's socket counts, TCP's in use and in ``TIME_WAIT``),
``mounts`` (the mount table without its ids), ``places`` (every entry under each place:
path, kind, mode, owner, size, SHA-256 or link target, extended attributes), ``errors``.
"""

from __future__ import annotations

import os
import stat
import sys

TYPE_CHECKING = False  # mypy takes it as true; importing typing costs the probe a millisecond
if TYPE_CHECKING:
    from collections.abc import Callable

# hashlib, shutil and subprocess are imported where needed, and json not at all: the probe
# runs at every reset, and its imports were most of its cost.

MAX_ENTRIES = 20000
"""Entries listed per place; past it the survey says ``truncated`` (never recycled)."""

NET_TABLES = ("unix", "udp", "udp6", "raw", "raw6", "packet")
"""Tables read whole. TCP's are not: reading ``/proc/net/tcp`` walks the kernel's whole
connection hash (every network namespace's), ~4.5 ms each; ``sockstat`` counts this
namespace's TCP sockets, ``TIME_WAIT`` ones included, for nothing."""

NAMESPACE_COUNTS = {
    "sockets": ("used",),
    "TCP": ("inuse", "tw"),
    "UDP": ("inuse",),
    "UDPLITE": ("inuse",),
    "RAW": ("inuse",),
    "TCP6": ("inuse",),
    "UDP6": ("inuse",),
    "UDPLITE6": ("inuse",),
    "RAW6": ("inuse",),
}
"""The fields of ``/proc/net/sockstat{,6}`` that count this network namespace's sockets
(``alloc``, ``orphan`` and ``mem`` are the whole machine's)."""


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def stray_processes(agent: int) -> list[list[object]]:
    spared = {1, os.getsid(0)}
    if agent:
        sid = session_of(agent)
        if sid is not None:
            spared.add(sid)
    stray: list[list[object]] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/stat", "rb") as handle:
                data = handle.read()
        except OSError:
            continue  # gone meanwhile
        comm = data[data.find(b"(") + 1 : data.rfind(b")")].decode("utf-8", "replace")
        fields = data[data.rfind(b")") + 2 :].split()
        if fields[0] in (b"Z", b"X", b"x"):
            continue  # dead: runs nothing
        if int(fields[3]) not in spared:
            stray.append([int(name), comm])
    return sorted(stray)


def table_rows(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return [line.strip() for line in handle.readlines()[1:] if line.strip()]
    except OSError as exc:
        return [f"unreadable: {exc}"]


def sockets() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for table in NET_TABLES:
        rows = []
        for row in table_rows("/proc/net/" + table):
            fields = row.split()
            if table == "unix":  # Type, St and Path: the rest are kernel addresses
                rows.append(" ".join(fields[4:6] + fields[7:]))
            elif table == "packet":
                rows.append(" ".join(fields[2:4]))
            else:  # local address, remote address, state
                rows.append(" ".join(fields[1:4]))
        found[table] = sorted(rows)
    counts = []
    for name in ("/proc/net/sockstat", "/proc/net/sockstat6"):
        for row in table_rows_all(name):
            label, _, rest = row.partition(":")
            fields = rest.split()
            pairs = {fields[i]: fields[i + 1] for i in range(0, len(fields) - 1, 2)}
            counts += [f"{label} {key} {pairs.get(key)}" for key in NAMESPACE_COUNTS.get(label, ())]
    found["sockstat"] = counts
    return found


def mounts() -> list[str]:
    return sorted(" ".join(row.split()[2:]) for row in table_rows_all("/proc/self/mountinfo"))


def table_rows_all(path: str) -> list[str]:
    with open(path, encoding="utf-8", errors="replace") as handle:
        return [line.strip() for line in handle if line.strip()]


def xattrs(path: str) -> list[str]:
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []
    if not names:
        return []
    import hashlib

    out = []
    for name in sorted(names):
        try:
            value = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            value = b"?"
        out.append(name + "=" + hashlib.sha256(value).hexdigest())
    return out


def describe(path: str, rel: str) -> list[object]:
    st = os.lstat(path)
    extra = ""
    if stat.S_ISREG(st.st_mode):
        import hashlib

        digest = hashlib.sha256()
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                digest.update(chunk)
        finally:
            os.close(fd)
        extra = digest.hexdigest()
    elif stat.S_ISLNK(st.st_mode):
        extra = os.readlink(path)
    size = st.st_size if stat.S_ISREG(st.st_mode) else 0
    return [
        rel,
        stat.S_IFMT(st.st_mode),
        stat.S_IMODE(st.st_mode),
        st.st_uid,
        st.st_gid,
        size,
        extra,
        xattrs(path),
    ]


def listing(place: str, errors: list[str]) -> tuple[list[list[object]], bool]:
    entries: list[list[object]] = []
    try:
        entries.append(describe(place, "."))
    except OSError as exc:
        errors.append(f"{place}: {exc}")
        return entries, False
    stack = [""]
    while stack:
        rel = stack.pop()
        here = os.path.join(place, rel) if rel else place
        try:
            names = sorted(os.listdir(here))
        except OSError as exc:
            errors.append(f"{here}: {exc}")
            continue
        for name in names:
            if len(entries) >= MAX_ENTRIES:
                return entries, True
            sub = os.path.join(rel, name) if rel else name
            path = os.path.join(place, sub)
            try:
                entry = describe(path, sub)
            except OSError as exc:
                errors.append(f"{path}: {exc}")
                continue
            entries.append(entry)
            if entry[1] == stat.S_IFDIR:
                stack.append(sub)
    return sorted(entries, key=lambda e: str(e[0])), False


def top_level(place: str, errors: list[str]) -> list[list[object]]:
    """The entries right under ``place`` (name, kind, mode, owner): a place only root can
    write, which the reset watches but never empties."""
    found: list[list[object]] = []
    try:
        names = sorted(os.listdir(place))
    except OSError as exc:
        errors.append(f"{place}: {exc}")
        return found
    for name in names:
        try:
            st = os.lstat(os.path.join(place, name))
        except OSError:
            continue  # gone meanwhile (a pty of a process that just died)
        found.append(
            [name, stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid]
        )
    return found


def survey(
    places: list[str], watched: list[str], agent: int, errors: list[str]
) -> dict[str, object]:
    listed = {}
    truncated = False
    for place in places:
        listed[place], cut = listing(place, errors)
        truncated = truncated or cut
    return {
        "watched": {place: top_level(place, errors) for place in watched},
        "stray": stray_processes(agent),
        "ipc": {kind: table_rows("/proc/sysvipc/" + kind) for kind in ("shm", "msg", "sem")},
        "net": sockets(),
        "mounts": mounts(),
        "places": listed,
        "truncated": truncated,
        "errors": errors,
    }


def empty(place: str, owner: list[int], errors: list[str]) -> None:
    try:
        names = os.listdir(place)
    except OSError as exc:
        errors.append(f"{place}: {exc}")
        return
    for name in names:
        path = os.path.join(place, name)
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                import shutil

                shutil.rmtree(path)  # by descriptor: links are removed, never followed
            else:
                os.unlink(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    mode, uid, gid = owner
    try:
        for name in os.listxattr(place):
            if not name.startswith("security."):
                os.removexattr(place, name)
        os.chown(place, uid, gid)
        os.chmod(place, mode)
    except OSError as exc:
        errors.append(f"{place}: {exc}")


def remove_ipc(errors: list[str]) -> None:
    """Remove every System V IPC object, each as its owner (root lacks CAP_IPC_OWNER)."""

    import subprocess

    for kind, flag, id_column in (("shm", "-m", 1), ("msg", "-q", 1), ("sem", "-s", 1)):
        for row in table_rows("/proc/sysvipc/" + kind):
            fields = row.split()
            owner = fields[{"shm": 7, "msg": 7, "sem": 4}[kind]]
            group = fields[{"shm": 8, "msg": 8, "sem": 5}[kind]]
            done = subprocess.run(
                ["ipcrm", flag, fields[id_column]],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                preexec_fn=as_owner(int(owner), int(group)),
            )
            if done.returncode != 0:
                errors.append("ipcrm: " + done.stderr.decode("utf-8", "replace").strip())


def as_owner(uid: int, gid: int) -> Callable[[], None]:
    def switch() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    return switch


def encode(value: object) -> str:
    """JSON of the survey: strings, ints, bools, lists and dicts of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return quote(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(encode(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(quote(k) + ":" + encode(v) for k, v in value.items()) + "}"
    raise TypeError(type(value).__name__)


def quote(text: str) -> str:
    out = []
    for char in text:
        code = ord(char)
        if 0x20 <= code < 0x7F and char not in '"\\':
            out.append(char)
        elif code > 0xFFFF:  # a surrogate pair
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
        else:
            out.append(f"\\u{code:04x}")
    return '"' + "".join(out) + '"'


def main() -> None:
    """``argv``: the mode, the agent's pid, then one ``place=mode:uid:gid`` per place and
    one ``+place`` per watched place."""
    mode, agent = sys.argv[1], int(sys.argv[2])
    owners: dict[str, list[int]] = {}
    watched: list[str] = []
    for item in sys.argv[3:]:
        if item.startswith("+"):
            watched.append(item[1:])
            continue
        place, _, fields = item.rpartition("=")
        owners[place] = [int(field) for field in fields.split(":")]
    errors: list[str] = []
    if mode == "reset":
        for place, owner in owners.items():
            empty(place, owner, errors)
        remove_ipc(errors)
    sys.stdout.write(encode(survey(list(owners), watched, agent, errors)))


if __name__ == "__main__":
    main()
