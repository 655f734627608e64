# shellcheck shell=sh
# List the sandboxes of this host: for each directory "${TMPDIR:-/tmp}/<prefix>*" holding the
# metadata file, its path, a NUL byte, the file's content and a NUL byte.
#
# $1: the directory name prefix; $2: the metadata file name.
for d in "${TMPDIR:-/tmp}/$1"*; do
  [ -f "$d/$2" ] || continue
  printf '%s\0' "$d"; cat "$d/$2"; printf '\0'
done
