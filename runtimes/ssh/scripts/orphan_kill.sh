# shellcheck shell=sh
# Kill each process group whose leader's environment carries the sandbox's marker entry (after a
# reboot the ids may name other processes).
#
# $1: the marker entry (NAME=value); the rest: the process group ids.
entry=$1
shift
for g in "$@"; do
  if grep -qsxzF -e "$entry" "/proc/$g/environ"; then kill -s KILL -- "-$g" 2>/dev/null; fi
done
true
