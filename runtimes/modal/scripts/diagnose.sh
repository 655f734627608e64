#!/bin/sh
# Print the errno a read (r) or write (w) of $1 most likely failed with, 0 if unknown.
p=$1 m=$2
if [ ! -e "$p" ] && [ -L "$p" ]; then echo 2; exit 0; fi
if [ -e "$p" ]; then
  if [ -d "$p" ]; then echo 21
  elif [ "$m" = r ] && [ ! -r "$p" ]; then echo 13
  elif [ "$m" = w ] && [ ! -w "$p" ]; then echo 13
  else echo 0; fi
  exit 0
fi
q=$p
while :; do
  case $q in */*) q=${q%/*};; *) q=;; esac
  [ -n "$q" ] || q=/
  if [ -e "$q" ]; then
    if [ ! -d "$q" ]; then echo 20
    elif [ ! -x "$q" ]; then echo 13
    elif [ "$m" = w ] && [ ! -w "$q" ]; then echo 13
    elif [ "$m" = r ]; then echo 2
    else echo 0; fi
    exit 0
  fi
  [ "$q" = / ] && { echo 2; exit 0; }
done
