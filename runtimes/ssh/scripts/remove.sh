# shellcheck shell=sh
# Remove a sandbox directory after sweeping (freeze, then kill) what still runs in it; exits with
# rm's status.
#
# $1: the directory; the rest: the sweep's argv (runtimes.base.sweep_argv), run quietly.
d=$1
shift
"$@" >/dev/null 2>&1
chmod -R u+rwx -- "$d" 2>/dev/null; rm -rf -- "$d"
