# shellcheck shell=sh
# Snapshot a sandbox's workdir: a private directory (mktemp -d) holding the metadata file (read
# from stdin, written first: a holder killed mid-copy leaves a directory cleanup finds) and
# tree/, a copy of the workdir by cp -a (links copied as links, never followed; reflinks where
# the filesystem has them). Prints the directory; exit 5: the workdir is not a directory (or a
# link), 3: the directory could not be made, 4: the copy failed (the directory is removed).
#
# $1: the directory name prefix; $2: the metadata file name; $3: the workdir.
w=$3
if [ ! -d "$w" ] || [ -L "$w" ]; then echo "the workdir $w is not a directory" >&2; exit 5; fi
s=$(mktemp -d -t "${1}XXXXXXXXXX") || exit 3
cat > "$s/$2" || { rm -rf -- "$s"; exit 3; }
if cp --reflink=auto --version >/dev/null 2>&1; then set -- --reflink=auto; else set --; fi
if ! cp -a "$@" -- "$w" "$s/tree"; then
  chmod -R u+rwx -- "$s" 2>/dev/null; rm -rf -- "$s"; exit 4
fi
printf '%s\n' "$s"
