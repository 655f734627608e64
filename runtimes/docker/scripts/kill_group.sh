# Kill a command's process group (its leader's pid, $1), or the process alone if it leads none.
kill -9 "-$1" 2>/dev/null || kill -9 "$1" 2>/dev/null; exit 0
