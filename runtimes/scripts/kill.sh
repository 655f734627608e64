# shellcheck shell=sh
# The one kill: SIGKILL process groups, each named by its leader's pid (the leader first, since a
# command may not lead its group yet between fork and setsid(), then the group). A group already
# gone is no error: prints nothing, always exits 0.
#
# --mark ENTRY first: kill only the groups whose leader's environment still carries ENTRY
# (NAME=value), for groups a runtime could not kill earlier (the sandbox was paused, the
# transport failed): after a restart the ids may name other processes.
mark=
if [ "$1" = --mark ]; then
  mark=$2
  shift 2
fi
for g in "$@"; do
  if [ -n "$mark" ] && ! tr '\0' '\n' 2>/dev/null <"/proc/$g/environ" | grep -qxF -- "$mark"; then
    continue
  fi
  kill -s KILL -- "$g" "-$g" 2>/dev/null
done
exit 0
