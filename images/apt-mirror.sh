# shellcheck shell=bash
# Sourced by build-base.sh and compose-plugin.sh: the Debian mirrors of the host's own apt
# sources (deb822 or one-line format, read through apt itself; never a hard-coded host).
#
#   suite=bookworm; . images/apt-mirror.sh
#   pick_uri main | other-main | security | updates   # the first such URI, no trailing /
#   debian_mirror                                     # $VF_SANDBOX_DEBIAN_MIRROR, else the
#                                                     # host's archive for $suite, else any main one

# `apt-get --print-uris update` prints (without fetching, and without needing any lists) the
# Release files `apt-get update` would fetch, whatever the sources format: ".../dists/<suite>/InRelease".
host_targets=$(apt-get --print-uris update 2>/dev/null </dev/null |
    sed -n "s|^'\(.*\)/dists/\(.*\)/InRelease'.*|\1 \2|p" | awk '!seen[$0]++' || true)

pick_uri() {
    awk -v kind="$1" -v suite="${suite:-}" '
        (kind == "main" && $2 == suite) ||
        (kind == "other-main" && $2 !~ /[-\/]/) ||
        (kind == "security" && ($2 ~ /-security$/ || $2 ~ /\/updates$/)) ||
        (kind == "updates" && $2 ~ /-updates$/) { sub(/\/+$/, "", $1); print $1; exit }' <<<"$host_targets"
}

debian_mirror() {
    local uri=${VF_SANDBOX_DEBIAN_MIRROR:-}
    [ -n "$uri" ] || uri=$(pick_uri main)
    # Host on another release: take its main archive (a release without a "-suffix").
    [ -n "$uri" ] || uri=$(pick_uri other-main)
    printf '%s\n' "${uri%/}"
}
