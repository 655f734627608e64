# Prints the start time (clock ticks since boot) of the shell running it: every process
# started later has a start time at least this large (the sweep's since:T mode).
# The fields are split on purpose (unquoted, globbing off), after the command name.
read -r s < "/proc/$$/stat"
set -f
# shellcheck disable=SC2086
set -- ${s##*) }
echo "${20}"
