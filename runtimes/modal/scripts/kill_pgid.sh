#!/bin/sh
# Kill process group $1 (the shell's kill: procps' kill(1) refuses "-- -PGID").
kill -s KILL -- "-$1"
