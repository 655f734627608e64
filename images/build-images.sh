#!/usr/bin/env bash
# Build vf-sandbox/<name>:latest for every images/<name>/Dockerfile (those holding a BENCH_ONLY
# file only when named: `make bench` builds them).
#
#   images/build-images.sh [--force] [NAME...]
#
# The build context is images/<name>/. The host CA bundle is copied into it first as
# ca-certificates.crt (git-ignored), so a Dockerfile can
#   COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
# before apt/pip (TLS is intercepted on our machines). Builds use the host network
# (`--network host`: the host's DNS and proxies) and pass proxy variables through.
#
# An image is built when it is missing, or when it is stale: each image is labelled with a
# hash of its build context and of the base image's ID, so editing a Dockerfile or
# rebuilding the base image makes the next run rebuild it. --force always rebuilds, without
# the layer cache.
# All images are FROM vf-sandbox/base:bookworm (built first by images/build-base.sh if missing).
#
# Environment:
#   VF_SANDBOX_CA_BUNDLE  CA bundle to copy (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
base_image=vf-sandbox/base:bookworm
ca_bundle=${VF_SANDBOX_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

log() { printf 'build-images: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

force=0
names=()
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        -h | --help) usage; exit 0 ;;
        -*) usage >&2; die "unknown argument: $arg" ;;
        *) names+=("$arg") ;;
    esac
done
if [ "${#names[@]}" -eq 0 ]; then
    for dockerfile in "$here"/*/Dockerfile; do
        [ -f "$dockerfile" ] || continue
        # images/<name>/BENCH_ONLY: used by `make bench` only, built when named
        [ -e "$(dirname "$dockerfile")/BENCH_ONLY" ] && continue
        names+=("$(basename "$(dirname "$dockerfile")")")
    done
fi
[ "${#names[@]}" -gt 0 ] || { log "no images/<name>/Dockerfile found; nothing to do."; exit 0; }
[ -r "$ca_bundle" ] || die "CA bundle $ca_bundle not readable"

"$here/engine.sh"
docker image inspect "$base_image" >/dev/null 2>&1 || "$here/build-base.sh"
base_id=$(docker image inspect -f '{{.Id}}' "$base_image")

# Proxy settings of the host, passed as (predefined, not persisted) build args.
build_args=()
for var in http_proxy https_proxy no_proxy ftp_proxy all_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY FTP_PROXY ALL_PROXY; do
    if [ -n "${!var:-}" ]; then build_args+=(--build-arg "$var"); fi
done

context_hash() { # $1: context dir; hash of its files (names, modes, contents) and the base image
    {
        printf '%s\n' "$base_id"
        tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$1" -c .
    } | sha256sum | cut -d' ' -f1
}

no_cache=()
[ "$force" -eq 0 ] || no_cache=(--no-cache) # a forced rebuild re-runs every step (fresh packages)

total_start=$SECONDS
for name in "${names[@]}"; do
    ctx=$here/$name
    image=vf-sandbox/$name:latest
    [ -f "$ctx/Dockerfile" ] || die "no Dockerfile in $ctx"
    install -m 0644 "$ca_bundle" "$ctx/ca-certificates.crt"
    hash=$(context_hash "$ctx")

    if [ "$force" -eq 0 ]; then
        current=$(docker image inspect -f '{{index .Config.Labels "org.vf-sandbox.image.input-hash"}}' "$image" 2>/dev/null || true)
        if [ "$current" = "$hash" ]; then
            log "$image is up to date; skipping (--force rebuilds)."
            continue
        fi
        if [ -n "$current" ]; then
            log "$image is stale (context or base image changed); rebuilding."
        fi
    fi

    log "building $image from $ctx"
    t0=$SECONDS
    docker build --network host --pull=false "${no_cache[@]}" "${build_args[@]}" \
        --label "org.vf-sandbox.image.name=$image" \
        --label "org.vf-sandbox.image.base=$base_image" \
        --label "org.vf-sandbox.image.base-id=$base_id" \
        --label "org.vf-sandbox.image.input-hash=$hash" \
        --label "org.vf-sandbox.image.build-date=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
        -t "$image" "$ctx" </dev/null
    log "built $image in $((SECONDS - t0))s"
done
log "done in $((SECONDS - total_start))s"
