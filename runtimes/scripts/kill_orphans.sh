# Kill process groups a runtime could not kill earlier (the sandbox was paused, the transport
# failed), but only those whose leader still carries the mark in its environment: after a
# restart the ids may belong to other processes. Arguments: the mark (NAME=value), then the
# group ids. Prints nothing; always exits 0 (a group already gone is not an error).
mark=$1
shift
for g in "$@"; do
  if tr '\0' '\n' 2>/dev/null < "/proc/$g/environ" | grep -qxF -- "$mark"; then
    kill -9 "-$g" 2>/dev/null
  fi
done
exit 0
