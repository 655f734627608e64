# Write stdin to file $1 as the sandbox's (non-root) user, creating its parents: exit 21 for a
# directory, 20 when a parent is not a directory.
if [ -d "$1" ]; then exit 21; fi
__vf_d=${1%/*}
if [ -e "${__vf_d:-/}" ] && [ ! -d "${__vf_d:-/}" ]; then exit 20; fi
mkdir -p -- "${__vf_d:-/}" || exit 1
exec cat > "$1"
