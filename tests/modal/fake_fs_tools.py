"""Stand-in for Modal's ``modal-sandbox-fs-tools``, installed into every fake sandbox.

The real tool is a Rust binary the Modal worker puts at ``/__modal/.bin/modal-sandbox-fs-tools``;
``Sandbox.filesystem`` (the SDK's ``_SandboxFilesystem``) runs it with ``Sandbox.exec`` and one
JSON command argument, reads its stdout, and on a non-zero exit parses a JSON error payload
``{"error_kind", "message", "detail"}`` from its stderr (``modal/_utils/sandbox_fs_utils.py``).
This script speaks that protocol. What it cannot know is the exact ``error_kind`` the real tool
chooses in each situation; it follows Rust's ``std::io`` semantics (``create_dir_all``,
``remove_dir_all`` not following symlinks) and the kinds the SDK parses. Runs on the sandbox's
``python3``; standard library only.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import shutil
import stat
import sys
from typing import Any, NoReturn

MAX_READ_BYTES = 5 * 1024**3  # "read files of up to 5GB" (Modal's filesystem guide)
CHUNK = 1 << 20

_KINDS = {
    errno.ENOENT: "NotFound",
    errno.EACCES: "PermissionDenied",
    errno.EPERM: "PermissionDenied",
    errno.EISDIR: "IsDirectory",
    errno.ENOTDIR: "NotDirectory",
    errno.EEXIST: "AlreadyExists",
    errno.ENOTEMPTY: "DirectoryNotEmpty",
}


def fail(kind: str, message: str) -> NoReturn:
    sys.stderr.write(json.dumps({"error_kind": kind, "message": message, "detail": ""}))
    sys.exit(1)


def fail_os(exc: OSError, kinds: dict[int, str] | None = None) -> NoReturn:
    num = exc.errno or 0
    kind = (kinds or {}).get(num) or _KINDS.get(num, "Other")
    fail(kind, f"{os.strerror(num)} (os error {num})")


def create_dir_all(path: str) -> None:
    """Rust's ``std::fs::create_dir_all``: a file in the way is ``AlreadyExists``."""
    if path in ("", "/"):
        return
    try:
        os.mkdir(path)
        return
    except FileNotFoundError:
        pass
    except OSError:
        if os.path.isdir(path):
            return
        raise
    create_dir_all(os.path.dirname(path))
    try:
        os.mkdir(path)
    except OSError:
        if not os.path.isdir(path):
            raise


def read_file(path: str) -> None:
    try:
        info = os.stat(path)
    except OSError as exc:
        fail_os(exc)
    if stat.S_ISDIR(info.st_mode):
        fail("IsDirectory", "Is a directory (os error 21)")
    if info.st_size > MAX_READ_BYTES:
        fail("FileTooLarge", f"file is {info.st_size} bytes, the limit is {MAX_READ_BYTES}")
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError as exc:
        fail_os(exc)
    with handle:
        shutil.copyfileobj(handle, sys.stdout.buffer, CHUNK)


def write_file(path: str) -> None:
    try:
        create_dir_all(os.path.dirname(path))
    except OSError as exc:
        fail_os(exc)
    if os.path.isdir(path):
        fail("IsDirectory", "Is a directory (os error 21)")
    try:
        handle = open(path, "wb")  # noqa: SIM115 - closed below
    except OSError as exc:
        fail_os(exc)
    with handle:
        shutil.copyfileobj(sys.stdin.buffer, handle, CHUNK)


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def describe(path: str, info: os.stat_result) -> dict[str, Any]:
    if stat.S_ISLNK(info.st_mode):
        kind, target = "symlink", os.readlink(path)
    elif stat.S_ISDIR(info.st_mode):
        kind, target = "directory", None
    else:
        kind, target = "file", None
    return {
        "name": os.path.basename(path.rstrip("/")) or "/",
        "path": path,
        "type": kind,
        "size": info.st_size,
        "mode": info.st_mode,
        "permissions": stat.filemode(info.st_mode)[1:],
        "owner": _owner(info.st_uid),
        "group": _group(info.st_gid),
        "modified_time": info.st_mtime,
        "symlink_target": target,
    }


def stat_path(path: str) -> None:
    try:
        info = os.lstat(path)
    except OSError as exc:
        fail_os(exc)
    sys.stdout.write(json.dumps(describe(path, info)))


def list_files(path: str) -> None:
    try:
        names = sorted(os.listdir(path))
    except OSError as exc:
        fail_os(exc, {errno.ENOTDIR: "NotDirectory"})
    entries = []
    for name in names:
        full = os.path.join(path, name)
        try:
            entries.append(describe(full, os.lstat(full)))
        except OSError:
            continue
    sys.stdout.write(json.dumps(entries))


def make_directory(path: str, parents: bool) -> None:
    kinds = {errno.EEXIST: "PathAlreadyExists"}
    try:
        if parents:
            create_dir_all(path)
        else:
            os.mkdir(path)
    except OSError as exc:
        fail_os(exc, kinds)


def remove(path: str, recursive: bool) -> None:
    try:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            if recursive:
                shutil.rmtree(path)
            else:
                os.rmdir(path)
        else:
            os.unlink(path)  # a symlink is removed itself, never followed
    except OSError as exc:
        fail_os(exc)


def main() -> None:
    command = json.loads(sys.argv[1])
    (name, args), *_ = command.items()
    if name == "ReadFile":
        read_file(args["path"])
    elif name == "WriteFile":
        write_file(args["path"])
    elif name == "Stat":
        stat_path(args["path"])
    elif name == "ListFiles":
        list_files(args["path"])
    elif name == "MakeDirectory":
        make_directory(args["path"], bool(args.get("parents", True)))
    elif name == "Remove":
        remove(args["path"], bool(args.get("recursive", False)))
    else:
        fail("NotSupported", f"unknown command {name}")


if __name__ == "__main__":
    main()
