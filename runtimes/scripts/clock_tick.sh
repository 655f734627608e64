# Prints the start time (clock ticks since boot) of the shell running it: every process
# started later has a start time at least this large (the sweep's since:T mode).
read -r s < "/proc/$$/stat"; set -f; set -- ${s##*) }; echo "${20}"
