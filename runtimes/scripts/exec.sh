#!/bin/sh
# The exec wrapper: every backend's plain path runs a command through it
# (runtimes/wrapper.py builds the arguments and parses the report).
#
#   sh -c "$(cat exec.sh)" sh NONCE CWD USER SWITCH TOOLS SEARCH SPOOL MODE K ENV1..ENVK ARGV...
#
#   NONCE   [A-Za-z0-9]+, names the report line (and, in track mode, the control files)
#   CWD     the working directory
#   USER    run as this user (name or uid), "" to run as the wrapper runs
#   SWITCH  how root switches users: "setpriv" (setpriv, else runuser) or "runuser"
#   TOOLS   the directories setsid/setpriv/runuser/env/id/mkdir/rm are taken from, ":"-separated
#           ("" = the usual system directories); never the caller's PATH
#   SEARCH  "PATH=<value>": the PATH the program is searched in; "" = the wrapper's own PATH
#   SPOOL   "" or a file holding one "set -- ..." line that resets all of these arguments
#           (a long argv, a big env); the wrapper removes it
#   MODE    exec: become the command (docker exec made the wrapper a session leader);
#           wait: run it under setsid in a session of its own, wait, exit with its status
#           (128+N for a death by signal N); track: wait, and record the group in
#           /tmp/.vf-sandbox/NONCE.pgid and honour NONCE.cancel (see kill protocol below)
#   K ENV.. the caller's environment as K pieces of shell code run last, just before the
#           command: "export A='1'" each, and for a name that is no shell identifier
#           "set -- 'a.b=1' \"\$@\"" each, then "set -- \"\$__vf_env\" -- \"\$@\"" (env(1))
#
# It reports exactly one line on stderr before any output of the command:
# "vf-sandbox-NONCE:ok:PGID" once the command runs in its own process group, or
# "vf-sandbox-NONCE:ERRNO:WHAT" (2 ENOENT, 13 EACCES, 20 ENOTDIR, 21 EISDIR, 22 EINVAL,
# 95 EOPNOTSUPP; WHAT: cwd, prog, user, argv, setsid) and exits 255 without running anything.
#
# The caller's environment reaches only the command: the wrapper runs with the sandbox's
# own, so no name the caller picks (IFS, PATH, __vf_*) can derail it. Its own stderr goes
# to /dev/null once the command is launched (no "Killed" notices among the command's).
#
# Kill protocol (track mode): the killer writes NONCE.cancel, then reads NONCE.pgid and
# kills that group; the launched group writes NONCE.pgid (as the wrapper's user, before
# any user switch), then reads NONCE.cancel and stops if it is there. Whichever runs
# second sees the other's file: a command never starts unsupervised after a cancel.

set -f
__vf_fail() {
  printf 'vf-sandbox-%s:%s:%s\n' "$__vf_n" "$1" "$2" >&2
  exit 255
}

# __vf_tool NAME: the path of NAME in TOOLS in $__vf_found, "" if it is not there.
__vf_tool() {
  __vf_found=
  IFS=:
  for __vf_d in $__vf_tools; do
    if [ -f "${__vf_d:-.}/$1" ] && [ -x "${__vf_d:-.}/$1" ]; then
      __vf_found=${__vf_d:-.}/$1
      break
    fi
  done
  unset IFS
}

__vf_n=$1 __vf_tools=${5:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}
__vf_spool=$7
if [ -n "$__vf_spool" ]; then
  if [ ! -f "$__vf_spool" ] || [ ! -r "$__vf_spool" ]; then __vf_fail 22 argv; fi
  # shellcheck disable=SC1090  # one "set --" line written by runtimes/wrapper.py
  . "$__vf_spool"
  __vf_tool rm
  "${__vf_found:-rm}" -f -- "$__vf_spool"
fi
__vf_n=$1 __vf_cwd=$2 __vf_user=$3 __vf_switch=$4 __vf_search=$6 __vf_mode=$8
shift 8
case $1 in
'' | *[!0-9]*) __vf_fail 22 argv ;;
esac
[ "$#" -gt "$(($1 + 1))" ] || __vf_fail 22 argv
__vf_p=
eval "__vf_p=\${$(($1 + 2))}"  # argv[0], after K and the K pieces

# The working directory. A relative one must not go through CDPATH.
case $__vf_cwd in
/*) ;;
*) __vf_cwd=./$__vf_cwd ;;
esac
if ! cd -- "$__vf_cwd" 2>/dev/null; then
  [ -e "$__vf_cwd" ] || __vf_fail 2 cwd
  [ -d "$__vf_cwd" ] || __vf_fail 20 cwd
  __vf_fail 13 cwd
fi

# The program: a path, or a name searched like execvp does (an empty entry is ".").
case $__vf_p in
*/*)
  [ -e "$__vf_p" ] || __vf_fail 2 prog
  [ -d "$__vf_p" ] && __vf_fail 21 prog
  [ -x "$__vf_p" ] || __vf_fail 13 prog
  ;;
*)
  case $__vf_search in
  PATH=*) __vf_search=${__vf_search#PATH=} ;;
  *) __vf_search=${PATH-} ;;
  esac
  __vf_s=2
  IFS=:
  for __vf_d in $__vf_search; do
    if [ -f "${__vf_d:-.}/$__vf_p" ]; then
      if [ -x "${__vf_d:-.}/$__vf_p" ]; then
        __vf_s=0
        break
      fi
      __vf_s=13
    fi
  done
  unset IFS
  [ "$__vf_s" = 0 ] || __vf_fail "$__vf_s" prog
  ;;
esac

# The user: nothing to do when it is the wrapper's own; else root switches with setpriv
# (SWITCH=setpriv, when installed) or runuser. __vf_how/__vf_with/__vf_who/__vf_gid
# tell the last step how.
__vf_how='' __vf_with='' __vf_who='' __vf_gid=''
if [ -n "$__vf_user" ]; then
  __vf_tool id
  __vf_id=${__vf_found:-id}
  __vf_who=$("$__vf_id" -u -- "$__vf_user" 2>/dev/null) || __vf_fail 22 user
  __vf_me=$("$__vf_id" -u 2>/dev/null)
  if [ "$__vf_who" != "$__vf_me" ]; then
    [ "$__vf_me" = 0 ] || __vf_fail 13 user
    __vf_found=
    [ "$__vf_switch" = setpriv ] && __vf_tool setpriv
    if [ -n "$__vf_found" ]; then
      __vf_how=setpriv __vf_with=$__vf_found
      __vf_gid=$("$__vf_id" -g -- "$__vf_user" 2>/dev/null) || __vf_fail 22 user
    else
      __vf_tool runuser
      [ -n "$__vf_found" ] || __vf_fail 95 user
      __vf_how=runuser __vf_with=$__vf_found
      __vf_who=$("$__vf_id" -nu -- "$__vf_user" 2>/dev/null) || __vf_fail 22 user
    fi
  fi
fi

__vf_env=
if [ "$1" -gt 0 ]; then
  __vf_tool env
  __vf_env=${__vf_found:-env}
fi

# The last step, in the process that becomes the command ($__vf_me: its pid): record and
# report its group, switch the user, enter a session of its own ($__vf_pre: setsid, in the
# wait and track modes), apply the caller's environment (after which no variable is read),
# exec. Arguments: control-file prefix, mode, nonce, env(1), how/with/who/gid, K, ENV..,
# ARGV...
# shellcheck disable=SC2016  # expanded where it runs
__vf_last='
if [ "$2" = track ]; then
  { printf "%s\n" "$__vf_me" >"$1.pgid"; } 2>/dev/null
  [ -e "$1.cancel" ] && exit 137
fi
printf "vf-sandbox-%s:ok:%s\n" "$3" "$__vf_me" >&2
__vf_env=$4 __vf_how=$5 __vf_with=$6 __vf_who=$7 __vf_gid=$8 __vf_k=$9 __vf_code=
shift 9
while [ "$__vf_k" -gt 0 ]; do
  __vf_code="$__vf_code
$1"
  shift
  __vf_k=$((__vf_k - 1))
done
case $__vf_how in
setpriv) set -- "$__vf_with" --reuid="$__vf_who" --regid="$__vf_gid" --init-groups -- "$@" ;;
runuser) set -- "$__vf_with" -u "$__vf_who" -- "$@" ;;
esac
[ -n "$__vf_pre" ] && set -- "$__vf_pre" -- "$@"
eval "$__vf_code"
exec "$@"'
__vf_f=/tmp/.vf-sandbox/$__vf_n
set -- "$__vf_f" "$__vf_mode" "$__vf_n" "$__vf_env" "$__vf_how" "$__vf_with" "$__vf_who" "$__vf_gid" "$@"

if [ "$__vf_mode" = exec ]; then
  __vf_me=$$ __vf_pre=
  eval "$__vf_last"
fi

__vf_tool setsid
[ -n "$__vf_found" ] || __vf_fail 95 setsid
__vf_setsid=$__vf_found
if [ "$__vf_mode" = track ] && [ ! -d /tmp/.vf-sandbox ]; then
  __vf_tool mkdir
  "${__vf_found:-mkdir}" -p -m 1777 /tmp/.vf-sandbox 2>/dev/null
fi

# The last step runs in a background subshell that becomes the command through setsid:
# pid == pgid == sid (setsid(1) does not fork: a background job of a non-interactive shell
# is no group leader), and no other program starts on the way. Its pid is read from
# /proc/self/stat by a builtin ($$ is the wrapper's). It reports that pid before setsid()
# has run, so a kill signals the pid first, then the group: whichever state it finds, the
# command cannot start unsignalled (the kill scripts do both). A background job's stdin is
# /dev/null unless redirected: the command's stdin goes through fd 3. The wrapper keeps
# the original stderr on fd 4 for the command and silences its own.
__vf_pre=$__vf_setsid
exec 3<&0 4>&2 2>/dev/null
(
  read -r __vf_me __vf_rest </proc/self/stat || exit 126
  eval "$__vf_last"
) <&3 3<&- 2>&4 4>&- &
exec 3<&- 4>&- </dev/null
wait "$!"
__vf_s=$?
if [ "$__vf_mode" = track ]; then
  __vf_tool rm
  "${__vf_found:-rm}" -f -- "$__vf_f.pgid" "$__vf_f.cancel"
fi
exit "$__vf_s"
