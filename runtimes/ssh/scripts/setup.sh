# shellcheck shell=sh
# Create a sandbox: a private directory in $TMPDIR (else /tmp), mode 0700, named after the
# runtime's mark, which is random (mkdir fails on a name already taken), holding work/, x/
# (spooled wrapper scripts) and the metadata file (read from stdin). Prints the directory, the
# resolved workdir and the absolute paths of setsid, env, runuser and prlimit (an empty line:
# not installed), one per line.
#
# $1: the directory's name; $2: the metadata file name; $3: the workdir to use, created if
# missing ("": <directory>/work); $4: a snapshot directory whose tree/ is copied as work/ by
# cp -a, links as links (exit 6: it is gone; 7: the copy failed), "": an empty work/; $5: "1"
# to let other users pass the directory (the policy's account, whose workdir the copy is).
set -e
command -v setsid >/dev/null 2>&1 || { echo "setsid (util-linux) is not installed" >&2; exit 3; }
[ -r /proc/self/stat ] || { echo "/proc is not available (a Linux host is needed)" >&2; exit 3; }
t=${TMPDIR:-/tmp}
d=${t%/}/$1
mkdir -m 700 -- "$d"
mkdir "$d/x"
cat > "$d/$2"
if [ -n "$4" ]; then
  if [ ! -d "$4/tree" ] || [ -L "$4/tree" ]; then
    echo "no snapshot at $4" >&2; rm -rf -- "$d"; exit 6
  fi
  if cp --reflink=auto --version >/dev/null 2>&1; then r=--reflink=auto; else r=-a; fi
  if ! cp -a "$r" -- "$4/tree" "$d/work" || [ ! -d "$d/work" ] || [ -L "$d/work" ]; then
    chmod -R u+rwx -- "$d" 2>/dev/null || true; rm -rf -- "$d"; exit 7
  fi
else
  mkdir "$d/work"
fi
if [ "$5" = 1 ]; then chmod o+x -- "$d"; fi
w=$3
if [ -n "$w" ]; then
  if ! mkdir -p -- "$w" || ! w=$(cd -- "$w" && pwd -P); then rm -rf -- "$d"; exit 4; fi
else
  w=$(cd -- "$d/work" && pwd -P)
fi
printf '%s\n%s\n' "$d" "$w"
command -v setsid; command -v env; command -v runuser || echo; command -v prlimit || echo
