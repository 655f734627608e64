# shellcheck shell=sh
# Kill process groups; one already gone is no error.
#
# $@: what to kill: a group leader's pid, then its group as "-<pgid>", for each group.
if [ "$#" -gt 0 ]; then kill -s KILL -- "$@" 2>/dev/null; fi
true
