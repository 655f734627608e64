# shellcheck shell=sh
# Kill process groups; one already gone is no error.
#
# $@: the groups, each as "-<pgid>".
if [ "$#" -gt 0 ]; then kill -s KILL -- "$@" 2>/dev/null; fi
true
