#!/usr/bin/env bash
# Install the Docker Compose v2 CLI plugin (`docker compose`), which inspect_ai's built-in
# docker sandbox drives (it needs compose >= 2.21).
#
#   images/compose-plugin.sh
#
# Nothing happens if `docker compose version` already works. Otherwise (as root): Debian
# bookworm's `docker-compose` is v1, so Debian trixie's `docker-compose` package (compose v2,
# a static Go binary) is fetched from the host's own Debian mirror with a private apt state
# under .build/compose-apt/ (the system's sources, lists and caches are not touched), unpacked
# with dpkg-deb, and its plugin binary installed as
# /usr/local/lib/docker/cli-plugins/docker-compose.
#
# Environment:
#   VF_SANDBOX_DEBIAN_MIRROR   override the Debian mirror (default: read from host apt sources)
#   VF_SANDBOX_COMPOSE_SUITE   the Debian suite to take docker-compose from (default trixie)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/.." && pwd)

compose_suite=${VF_SANDBOX_COMPOSE_SUITE:-trixie}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
plugin_in_deb=usr/libexec/docker/cli-plugins/docker-compose
plugin_dir=/usr/local/lib/docker/cli-plugins
state=$root/.build/compose-apt

log() { printf 'compose-plugin: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

if version=$(docker compose version 2>/dev/null </dev/null); then
    log "already installed: $version"
    exit 0
fi

[ "$(id -u)" -eq 0 ] || die "must run as root to install $plugin_dir/docker-compose"
command -v apt-get >/dev/null 2>&1 || die "apt-get is missing (not a Debian host?)"
command -v dpkg-deb >/dev/null 2>&1 || die "dpkg-deb is missing"
[ -f "$keyring" ] || die "$keyring is missing (apt-get install debian-archive-keyring)"

# --- mirror: the host's own apt sources (as images/build-base.sh reads them) ----------------------
suite=$(awk -F= '$1 == "VERSION_CODENAME" { gsub(/["\047]/, "", $2); print $2 }' /etc/os-release 2>/dev/null || true)
# shellcheck source=images/apt-mirror.sh
. "$here/apt-mirror.sh"
mirror=$(debian_mirror)
[ -n "$mirror" ] || die "no Debian mirror found in the host apt sources; set VF_SANDBOX_DEBIAN_MIRROR"
log "fetching docker-compose from $mirror $compose_suite main"

# --- private apt state ------------------------------------------------------------------------------
mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
printf 'deb [signed-by=%s] %s %s main\n' "$keyring" "$mirror" "$compose_suite" >"$state/sources.list"
apt_private=(
    -o "Dir::Etc::sourcelist=$state/sources.list"
    -o "Dir::Etc::sourceparts=-"
    -o "Dir::State::Lists=$state/lists"
    -o "Dir::Cache=$state/cache"
    -o "APT::Get::List-Cleanup=0"
    -o "Acquire::Languages=none"
)

work=$(mktemp -d "${TMPDIR:-/tmp}/vf-compose.XXXXXX")
trap 'rm -rf "$work"' EXIT

DEBIAN_FRONTEND=noninteractive apt-get "${apt_private[@]}" update -q </dev/null >"$work/update.log" 2>&1 || {
    tail -n 20 "$work/update.log" >&2
    die "apt-get update of the private $compose_suite list failed"
}
(cd "$work" && DEBIAN_FRONTEND=noninteractive apt-get "${apt_private[@]}" download docker-compose </dev/null) \
    >"$work/download.log" 2>&1 || {
    tail -n 20 "$work/download.log" >&2
    die "apt-get download docker-compose ($compose_suite) failed"
}
deb=$(find "$work" -maxdepth 1 -name 'docker-compose_*.deb' -print -quit)
[ -n "$deb" ] || die "apt-get download left no docker-compose_*.deb"
log "downloaded $(basename "$deb")"

# --- install -------------------------------------------------------------------------------------------
dpkg-deb -x "$deb" "$work/root"
[ -f "$work/root/$plugin_in_deb" ] || die "$plugin_in_deb is not in $(basename "$deb")"
install -d -m 0755 "$plugin_dir"
install -m 0755 "$work/root/$plugin_in_deb" "$plugin_dir/docker-compose"

version=$(docker compose version </dev/null) || die "docker compose does not run after installing $plugin_dir/docker-compose"
log "installed $plugin_dir/docker-compose: $version"
