#!/usr/bin/env bash
# Ensure a Docker engine answers `docker info`.
#
#   images/engine.sh
#
# * If `docker info` already succeeds, do nothing.
# * Otherwise install docker.io (apt, non-interactive) when dockerd or the docker CLI is
#   missing, start dockerd fully detached (own session, stdin from /dev/null, log in
#   /var/log/vf-sandbox-dockerd.log) so that it outlives make, and wait for it to answer.
# * Idempotent: a second run is a no-op; a dockerd that is already starting is waited
#   for, never started twice.
#
# Environment:
#   VF_SANDBOX_ENGINE_TIMEOUT  seconds to wait for the engine (default 60)
#   VF_SANDBOX_DOCKERD_LOG     dockerd log file (default /var/log/vf-sandbox-dockerd.log)
set -euo pipefail

log() { printf 'engine: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

timeout_s=${VF_SANDBOX_ENGINE_TIMEOUT:-60}
dockerd_log=${VF_SANDBOX_DOCKERD_LOG:-/var/log/vf-sandbox-dockerd.log}

engine_answers() { docker info >/dev/null 2>&1; }

if command -v docker >/dev/null 2>&1 && engine_answers; then
    log "Docker engine answers; nothing to do."
    exit 0
fi

# Root is needed from here on (apt, dockerd). Use sudo when we are not root.
if [ "$(id -u)" -eq 0 ]; then
    as_root() { "$@"; }
elif command -v sudo >/dev/null 2>&1; then
    as_root() { sudo -n -- "$@"; }
else
    die "no Docker engine answers and we are neither root nor able to sudo"
fi

have_dockerd() { command -v dockerd >/dev/null 2>&1 || [ -x /usr/sbin/dockerd ] || [ -x /usr/bin/dockerd ]; }

if ! have_dockerd || ! command -v docker >/dev/null 2>&1; then
    log "installing docker.io (apt-get, non-interactive)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q </dev/null
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        docker.io ca-certificates iptables </dev/null
fi
have_dockerd || die "dockerd still missing after installing docker.io"
dockerd_bin=$(command -v dockerd || true)
[ -n "$dockerd_bin" ] || for c in /usr/sbin/dockerd /usr/bin/dockerd; do [ -x "$c" ] && dockerd_bin=$c && break; done

# The package's postinst may have started the service already (systemd hosts).
if engine_answers; then
    log "Docker engine answers after installation."
    exit 0
fi

if pgrep -x dockerd >/dev/null 2>&1; then
    log "dockerd is already running (pid $(pgrep -x dockerd | tr '\n' ' ')); waiting for it to answer"
else
    log "starting $dockerd_bin in the background (log: $dockerd_log)"
    as_root mkdir -p "$(dirname "$dockerd_log")"
    # setsid: new session, so make's process group / terminal hang-ups never reach it.
    # nohup + </dev/null + redirected output: nothing ties it to this shell.
    # shellcheck disable=SC2016 # $1/$2 expand in the inner sh
    as_root sh -c 'setsid -f nohup "$1" >>"$2" 2>&1 </dev/null' sh "$dockerd_bin" "$dockerd_log"
fi

deadline=$((SECONDS + timeout_s))
until engine_answers; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        log "Docker engine did not answer within ${timeout_s}s. Last lines of $dockerd_log:"
        as_root tail -n 40 "$dockerd_log" >&2 || true
        die "no Docker engine"
    fi
    sleep 1
done
log "Docker engine answers (after $((SECONDS))s)."
