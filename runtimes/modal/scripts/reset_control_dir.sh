#!/bin/sh
# Make the exec wrapper's control directory ($1) anew in a sandbox opened from a snapshot: the
# source's commands may have left files in it, or swapped it for a link (rm removes the link
# itself, never what it points to). Run as root before any command of the new sandbox.
rm -rf -- "$1" && mkdir -m 1777 -- "$1"
