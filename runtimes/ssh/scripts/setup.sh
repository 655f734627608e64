# shellcheck shell=sh
# Create a sandbox: a private directory (mktemp -d) holding work/, x/ (spooled wrapper scripts)
# and the metadata file (read from stdin). Prints the directory, the resolved workdir and the
# absolute paths of setsid, env and runuser (an empty line: no runuser), one per line.
#
# $1: the directory name prefix; $2: the metadata file name; $3: the workdir to use, created if
# missing ("": <directory>/work).
set -e
command -v setsid >/dev/null 2>&1 || { echo "setsid (util-linux) is not installed" >&2; exit 3; }
[ -r /proc/self/stat ] || { echo "/proc is not available (a Linux host is needed)" >&2; exit 3; }
d=$(mktemp -d -t "${1}XXXXXXXXXX")
mkdir "$d/work" "$d/x"
cat > "$d/$2"
w=$3
if [ -n "$w" ]; then
  if ! mkdir -p -- "$w" || ! w=$(cd -- "$w" && pwd -P); then rm -rf -- "$d"; exit 4; fi
else
  w=$(cd -- "$d/work" && pwd -P)
fi
printf '%s\n%s\n' "$d" "$w"
command -v setsid; command -v env; command -v runuser || echo
