# shellcheck shell=sh
# Snapshot a sandbox's workdir: a private directory (mktemp -d) holding the metadata file (read
# from stdin, written first: a holder killed mid-copy leaves a directory cleanup finds) and
# tree/, a copy of the workdir: by the copier of runtimes/subprocess/tree_copy.py when the host
# has python3 (it walks by descriptor: links copied as links, never followed, even one a leftover
# process swaps in while the copy runs), else by cp -a (links copied as links, but a directory
# swapped for a link during the copy can be read through). Prints the directory; exit 5: the
# workdir is not a directory (or a link), 3: the directory could not be made, 4: the copy failed
# (the directory is removed).
#
# $1: the directory name prefix; $2: the metadata file name; $3: the workdir; $4: the copier's
# Python source.
w=$3 copier=$4
if [ ! -d "$w" ] || [ -L "$w" ]; then echo "the workdir $w is not a directory" >&2; exit 5; fi
s=$(mktemp -d -t "${1}XXXXXXXXXX") || exit 3
cat > "$s/$2" || { rm -rf -- "$s"; exit 3; }
copy_workdir() {
  if command -v python3 >/dev/null 2>&1; then
    python3 -I -S -c "$copier" "$w" "$s/tree"
  elif cp --reflink=auto --version >/dev/null 2>&1; then
    cp -a --reflink=auto -- "$w" "$s/tree"
  else
    cp -a -- "$w" "$s/tree"
  fi
}
if ! copy_workdir; then
  chmod -R u+rwx -- "$s" 2>/dev/null; rm -rf -- "$s"; exit 4
fi
printf '%s\n' "$s"
