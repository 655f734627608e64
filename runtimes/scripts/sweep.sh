# Freeze, then kill: every matching process is sent SIGSTOP (which cannot be caught) until a
# whole pass over /proc finds none still running and no process it had not seen before, so a
# fork loop cannot outrun the sweep; then all of them get SIGKILL. Arguments: the mode, the
# mark (NAME=value), a pid whose session is spared (the channel agent, or ""), users (comma-
# separated) all of whose processes are the sandbox's: the policy's and the judges' ("").
# Modes: ``all``, every process outside session 1 (a container of ours: its keep-alive is
# session 1); ``since:T``, every process started at or after clock tick T (a sandbox of ours
# whose own processes predate T); ``mark``, processes carrying the mark in their environment
# or owned by one of the users, or whose working directory is $5 (the sandbox's own). The sweep's
# own session and its ancestors are always spared.
mode=$1 mark=$2 keep=$3 user=$4 home=$5
since=""; case $mode in since:*) since=${mode#since:} ;; esac
# $5 counts only as the directory its path names with no link on the way (code in the sandbox
# may replace its workdir by one: work -> /): the sweep walks there a name at a time, each
# step checked to have led where its name says, and compares each process's working
# directory with its own; a path with a link in it (or "..") matches no process.
if [ -n "$home" ]; then
  rest=$home home="" at=""
  case $rest in /*) cd / && home=. ;; esac
  while [ -n "$home" ] && [ -n "$rest" ]; do
    c=${rest%%/*}
    case $rest in */*) rest=${rest#*/} ;; *) rest="" ;; esac
    case $c in ""|.) continue ;; ..) home=""; break ;; esac
    if ! cd -P -- "$c" 2>/dev/null || [ "$(pwd -P)" != "$at/$c" ]; then home=""; fi
    at=$at/$c
  done
  [ -n "$at" ] || home=""
fi
# /proc/PID/stat is split into fields on purpose (unquoted, globbing off), after the command
# name, which may hold anything, newlines included: stat_of reads every line of it (into $__s,
# joined; false when the process is gone), so the fields are found after the last ") ".
stat_of() {
  __s="" __l=""
  { while IFS= read -r __l; do __s="$__s $__l"; done < "/proc/$1/stat"; } 2>/dev/null
  [ -n "$__s" ]
}
sid_of() {
  stat_of "$1" || return 1
  set -f
  # shellcheck disable=SC2086
  set -- ${__s##*) }
  set +f; echo "$4"
}
ancestors() {
  __p=$1
  while [ -n "$__p" ] && [ "$__p" -gt 1 ] 2>/dev/null; do
    echo "$__p"
    stat_of "$__p" || return 0
    set -f
    # shellcheck disable=SC2086
    set -- ${__s##*) }
    set +f; __p=$2
  done
}
mine=$(sid_of $$)
spare=""; [ -n "$keep" ] && spare=$(sid_of "$keep")
kept=" $(ancestors $$ | tr '\n' ' ') "
[ -n "$keep" ] && kept="$kept$(ancestors "$keep" | tr '\n' ' ') "
# $4 may name several accounts, comma-separated (the policy's and the judges'); the sweep's
# own uid is never one of them.
uids=" "; me=$(id -u)
for u in $(printf '%s' "$user" | tr ',' ' '); do
  i=$(id -u -- "$u" 2>/dev/null) && [ "$i" != "$me" ] && uids="$uids$i "
done
# look PID NEW: freeze PID if it matches; NEW=1 for a pid the pass before did not list.
look() {
  case $kept in *" $1 "*) return ;; esac
  if ! stat_of "$1"; then unsure=$((unsure | $2)); return; fi
  set -f
  # shellcheck disable=SC2086
  set -- "$1" "$2" ${__s##*) }
  set +f
  state=$3 sid=$6 started=${22}
  case $state in Z|X|x) unsure=$((unsure | $2)); return ;; esac
  case $other in *" $1:$started "*) return ;; esac
  hit=1
  if [ "$sid" = "$mine" ] || { [ -n "$spare" ] && [ "$sid" = "$spare" ]; }; then hit=0
  elif [ "$mode" = all ]; then
    [ "$sid" = 1 ] && hit=0
  elif [ -n "$since" ]; then
    [ "$started" -ge "$since" ] || hit=0
  else
    hit=0
    if [ "$uids" != " " ]; then
      while read -r k v _; do
        [ "$k" = Uid: ] && { case $uids in *" $v "*) hit=1 ;; esac; break; }
      done 2>/dev/null < "/proc/$1/status"
    fi
    # -ef (same file) is not in POSIX, but dash, bash and busybox sh all have it.
    # shellcheck disable=SC3013
    if [ "$hit" = 1 ]; then :
    elif [ -n "$home" ] && [ "/proc/$1/cwd" -ef "$home" ]; then hit=1
    elif tr '\0' '\n' 2>/dev/null < "/proc/$1/environ" | grep -qxF -- "$mark"; then hit=1; fi
  fi
  if [ "$hit" = 0 ]; then other="$other$1:$started "; return; fi
  case $seen in *" $1 "*) ;; *) seen="$seen$1 " ;; esac
  case $state in T|t) ;; *) kill -STOP "$1" 2>/dev/null && running=$((running + 1)) ;; esac
}
seen=" " other=" " listed=" " pass=0 quiet=0
while [ "$pass" -lt 500 ]; do
  pass=$((pass + 1)); running=0 unsure=0 before=$listed listed=" " new="" old=""
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    listed="$listed$p "
    case $before in *" $p "*) old="$old $p" ;; *) new="$new $p" ;; esac
  done
  # New processes first: a fork loop's live member is among them, and about to exit.
  for p in $new; do look "$p" 1; done
  for p in $old; do look "$p" 0; done
  # In a sandbox of our own (all, since): done once a pass froze nothing and read every
  # process new since the pass before: one that forked and exited in between (unreadable, or
  # a zombie) may have left a child only the next pass lists. Beside a host's other
  # processes (mark), which come and go all the time: three passes in a row that froze
  # nothing. Processes found not to match are not read again.
  if [ "$running" -eq 0 ]; then quiet=$((quiet + 1)); else quiet=0; fi
  if [ "$mode" = mark ]; then [ "$quiet" -ge 3 ] && break
  else [ "$running" -eq 0 ] && [ "$unsure" -eq 0 ] && [ "$pass" -gt 1 ] && break; fi
done
# What was dying already (exiting, stat's flags; or a SIGKILL pending: a timed-out command's,
# which the loaded machine has not yet run) is killed again but not counted.
total=0
for p in $seen; do
  doomed=0
  if stat_of "$p"; then
    set -f
    # shellcheck disable=SC2086
    set -- ${__s##*) }
    set +f
    case $7 in '' | *[!0-9]*) ;; *) [ $(($7 & 4)) -eq 0 ] || doomed=1 ;; esac
  fi
  while read -r k v _; do
    case $k in SigPnd: | ShdPnd:)
      case $v in '' | *[!0-9a-fA-F]*) ;; *) [ $((0x$v & 256)) -eq 0 ] || doomed=1 ;; esac ;;
    esac
  done 2>/dev/null < "/proc/$p/status"
  kill -KILL "$p" 2>/dev/null && [ "$doomed" = 0 ] && total=$((total + 1))
done
echo "$total"
