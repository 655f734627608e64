# shellcheck shell=sh
# Remove a sandbox directory after sweeping (freeze, then kill) what still runs in it; exits with
# rm's status. Code in the sandbox may have put links where the directory or its workdir were
# (work -> /): neither the sweep nor the removal follows one.
#
# $1: the directory; $2: its work/, whose processes the sweep takes too ("": none);
# the rest: the sweep's argv (runtimes.sweep.sweep_argv) less its last argument, the workdir,
# run quietly. The workdir is passed on with the directory that holds the sandbox directory
# (the host's $TMPDIR, which may be reached through a link) resolved: the sweep takes no path
# with a link in it. The permission fix (chmod -R follows a link it is given) runs inside the
# directory, reached with no link on the way.
d=$1 h=$2
shift 2
up=$(cd -P -- "${d%/*}/" 2>/dev/null && pwd -P) || up=""
if [ -n "$h" ]; then
  p=${h%/*}
  if [ -n "$up" ] && [ "$p" = "$d" ]; then h=${up%/}/${d##*/}/${h##*/}; else h=""; fi
fi
if [ "$#" -gt 0 ]; then "$@" "$h" >/dev/null 2>&1; fi
if [ -n "$up" ]; then
  (cd -P -- "$d" 2>/dev/null && [ "$(pwd -P)" = "${up%/}/${d##*/}" ] && chmod -R u+rwx .) 2>/dev/null
fi
rm -rf -- "$d"
