# Read file $1 as the sandbox's (non-root) user, at most $2 bytes: exit 21 for a directory,
# 27 for a file larger than the limit.
if [ -d "$1" ]; then exit 21; fi
if [ -f "$1" ] && [ -r "$1" ]; then
  __vf_n=$(wc -c < "$1") && [ "$__vf_n" -gt "$2" ] && exit 27
fi
exec cat -- "$1"
