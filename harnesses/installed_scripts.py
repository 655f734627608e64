"""The programs :class:`~harnesses.installed.InstalledHarness` runs inside the sandbox to
install an agent: the install base made without following links (:data:`MAKE_BASE`), the
locked venv install from a wheelhouse (:data:`INSTALL_SCRIPT`), the venv's tree digest
(:data:`TREE_DIGEST`), a package's version (:data:`VERSION_CHECK`) and the interpreter's
platform (:data:`PYTHON_PROBE`). Their output comes from the sandbox: the caller reads it as
hostile."""

from __future__ import annotations

__all__ = ["INSTALL_SCRIPT", "MAKE_BASE", "PYTHON_PROBE", "TREE_DIGEST", "VERSION_CHECK"]

MAKE_BASE = r"""
set -eu
root=$1 dir=$2 base=$3
for d in "$root" "$dir"; do
  if [ -L "$d" ]; then echo "vf-install: refusing a symlink at $d" >&2; exit 92; fi
done
mkdir -p "$dir"
mkdir -m 0755 "$base"
"""

INSTALL_SCRIPT = r"""
set -eu
dir=$1 base=$2 venv=$3 wheels=$4 py=$5 wait=$6
shift 6
req="$*"
trap 'st=$?; rm -rf "$wheels"; [ "$st" -eq 0 ] || rm -rf "$base"' EXIT
if ! command -v flock >/dev/null 2>&1; then
  echo "vf-install: flock is missing in the sandbox" >&2; exit 90
fi
exec 9>>"$dir/install.lock"
if ! flock -w "$wait" 9; then
  echo "vf-install: timed out waiting for $dir/install.lock" >&2; exit 91
fi
"$py" -I -m venv "$venv"
"$venv/bin/python" -I -m pip install --isolated --no-input --disable-pip-version-check \
  --no-cache-dir --quiet --only-binary=:all: --no-index --find-links "$wheels" "$@"
echo "$(date -u +%Y-%m-%dT%H:%M:%SZ) installed $req into $venv pid=$$" >> "$dir/install.log"
echo "vf-install: installed $req"
"""

# The venv's tree digest, computed by the sandbox's interpreter in isolated mode (no
# site, no user path) from ``lstat`` alone: every path with its type, mode, owner, size,
# inode, mtime and ctime, and link targets (never followed). Changing or replacing a file
# changes its ctime or inode, which no unprivileged process can set back; reading
# nothing keeps the check fast on a large venv.
TREE_DIGEST = r"""
import hashlib, os, stat, sys
digest = hashlib.sha256()
def walk(path, rel):
    st = os.lstat(path)
    fields = (rel, st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_ino, st.st_mtime_ns,
              st.st_ctime_ns)
    digest.update(repr(fields).encode("utf-8", "surrogateescape"))
    if stat.S_ISLNK(st.st_mode):
        digest.update(os.fsencode(os.readlink(path)))
    elif stat.S_ISDIR(st.st_mode):
        for name in sorted(os.listdir(path)):
            walk(os.path.join(path, name), rel + "/" + name)
    digest.update(b"\n")
walk(sys.argv[1], ".")
print(digest.hexdigest())
"""

VERSION_CHECK = (
    "import importlib.metadata as m, sys\n"
    "try:\n    print(m.version(sys.argv[1]))\n"
    "except m.PackageNotFoundError:\n    sys.exit(3)\n"
)

PYTHON_PROBE = (
    "import platform, sys\n"
    "print(f'{sys.version_info[0]}.{sys.version_info[1]}', platform.machine(), "
    "platform.libc_ver()[1] or 'none')\n"
)
