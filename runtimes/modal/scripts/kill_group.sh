#!/bin/sh
# Kill the process group of the exec with this nonce ($1). The cancel marker is written before
# the group id is read, and the wrapper writes the group id before it reads the marker, so
# whichever runs second does the kill: a command never starts unsupervised after a cancel.
f=/tmp/.vf-sandbox/$1
: >"$f.cancel" 2>/dev/null
if [ -s "$f.pgid" ]; then
  # The pid first (the wrapper records it before setsid() runs), then its group.
  read -r g <"$f.pgid" && { kill -s KILL -- "$g" 2>/dev/null; kill -s KILL -- "-$g" 2>/dev/null; }
  rm -f "$f.pgid" "$f.cancel"
fi
exit 0
