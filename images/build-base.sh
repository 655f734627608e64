#!/usr/bin/env bash
# Build the offline base image vf-sandbox/base:bookworm (also tagged vf-sandbox/base:latest).
#
#   images/build-base.sh [--force]
#
# No registry is reachable, so the image is not pulled: Debian bookworm is debootstrapped
# (--variant=minbase) from the host's own apt mirror into a scratch folder, tidied, and
# `docker import`ed. Nothing happens if the image already exists, unless --force is given.
#
# Environment:
#   VF_SANDBOX_DEBIAN_MIRROR           override the Debian mirror (default: read from host apt sources)
#   VF_SANDBOX_DEBIAN_SECURITY_MIRROR  override the security mirror (default: read from host apt
#                                      sources; the value "none" leaves security out)
#   VF_SANDBOX_BUILD_DIR               parent of the scratch folder (default /var/tmp)
#   VF_SANDBOX_CA_BUNDLE               CA bundle copied into the image
#                                      (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

image=vf-sandbox/base:bookworm
alias_image=vf-sandbox/base:latest
suite=bookworm
include_pkgs=python3,procps,coreutils,tar,ca-certificates,apt,gpgv,debian-archive-keyring
ca_bundle=${VF_SANDBOX_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
image_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

log() { printf 'build-base: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }

force=0
for arg in "$@"; do
    case $arg in
        --force) force=1 ;;
        -h | --help) usage; exit 0 ;;
        *) usage >&2; die "unknown argument: $arg" ;;
    esac
done

"$here/engine.sh"

if [ "$force" -eq 0 ] && docker image inspect "$image" >/dev/null 2>&1; then
    log "$image exists; nothing to do (--force rebuilds)."
    docker image inspect "$alias_image" >/dev/null 2>&1 || docker tag "$image" "$alias_image"
    exit 0
fi

[ "$(id -u)" -eq 0 ] || die "must run as root to build $image (debootstrap, chroot)"
start=$SECONDS

# --- prerequisites -------------------------------------------------------------------------
missing=()
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
[ -f /usr/share/keyrings/debian-archive-keyring.gpg ] || missing+=(debian-archive-keyring)
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]} (apt-get, non-interactive)"
    DEBIAN_FRONTEND=noninteractive apt-get update -q </dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" </dev/null
fi
[ -r "$ca_bundle" ] || die "CA bundle $ca_bundle not readable"

# --- mirror: the host's own apt sources -----------------------------------------------------------
# shellcheck source=images/apt-mirror.sh
. "$here/apt-mirror.sh"
mirror=$(debian_mirror)
[ -n "$mirror" ] || die "no Debian mirror found in the host apt sources; set VF_SANDBOX_DEBIAN_MIRROR"

security=${VF_SANDBOX_DEBIAN_SECURITY_MIRROR:-}
[ -n "$security" ] || security=$(pick_uri security)
[ "$security" != none ] || security=
security=${security%/}

updates=
if [ -n "$(pick_uri updates)" ]; then updates=" $suite-updates"; fi

log "mirror: $mirror${security:+ (security: $security)}"

# --- scratch folder ------------------------------------------------------------------------------
build_parent=${VF_SANDBOX_BUILD_DIR:-/var/tmp}
mkdir -p "$build_parent"
work=$(mktemp -d "$build_parent/vf-sandbox-base.XXXXXX")
rootfs=$work/rootfs

cleanup() {
    local rc=$? mnt
    # debootstrap mounts /proc and /sys inside the target; never rm -rf through a mount.
    if [ -d "$rootfs" ]; then
        while read -r mnt; do
            umount -l "$mnt" 2>/dev/null || true
        done < <(awk -v r="$rootfs" 'index($2, r) == 1 { print $2 }' /proc/mounts | sort -r)
    fi
    if awk -v r="$work" 'index($2, r) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
        log "WARNING: mounts remain under $work; not removing it"
    else
        rm -rf --one-file-system "$work"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- debootstrap -----------------------------------------------------------------------------------
log "debootstrap --variant=minbase $suite into $rootfs"
t0=$SECONDS
debootstrap --variant=minbase --components=main --include="$include_pkgs" \
    "$suite" "$rootfs" "$mirror" </dev/null >"$work/debootstrap.log" 2>&1 || {
    tail -n 40 "$work/debootstrap.log" >&2
    [ -f "$rootfs/debootstrap/debootstrap.log" ] && tail -n 40 "$rootfs/debootstrap/debootstrap.log" >&2
    die "debootstrap failed"
}
log "debootstrap done in $((SECONDS - t0))s"

# --- apt inside the image: same mirror as the host ---------------------------------------------
rm -f "$rootfs/etc/apt/sources.list"
mkdir -p "$rootfs/etc/apt/sources.list.d"
{
    printf 'Types: deb\nURIs: %s\nSuites: %s%s\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$mirror" "$suite" "$updates"
    if [ -n "$security" ]; then
        printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
            "$security" "$suite"
    fi
} >"$rootfs/etc/apt/sources.list.d/debian.sources"

# Container conventions (as in Debian's official images): no service starts during package
# installation, no apt caches or translations, no docs/man pages in later installs.
printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
cat >"$rootfs/etc/apt/apt.conf.d/docker-clean" <<'APT'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
APT
echo 'Acquire::Languages "none";' >"$rootfs/etc/apt/apt.conf.d/docker-no-languages"
echo 'Acquire::GzipIndexes "true";' >"$rootfs/etc/apt/apt.conf.d/docker-gzip-indexes"
echo 'Apt::AutoRemove::SuggestsImportant "false";' >"$rootfs/etc/apt/apt.conf.d/docker-autoremove-suggests"
mkdir -p "$rootfs/etc/dpkg/dpkg.cfg.d"
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/docker-slim" <<'DPKG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
DPKG
find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "${rootfs:?}"/usr/share/{man,groff,info,lintian,linda,locale}/*

# --- CA bundle: the host's (TLS is intercepted here) --------------------------------------------
# The certificates the host trusts beyond Debian's set go to /usr/local/share/ca-certificates so
# that a later update-ca-certificates (a package trigger) keeps them; the bundle itself is the host's.
pem_blocks() { # NUL-separated, whitespace-normalised PEM certificates of a bundle
    awk '/-----BEGIN CERTIFICATE-----/ { b = ""; inb = 1 }
         inb { sub(/[ \t\r]+$/, ""); b = b $0 "\n" }
         /-----END CERTIFICATE-----/ { if (inb) printf "%s%c", b, 0; inb = 0 }' "$1"
}
declare -A known=()
while IFS= read -r -d '' pem; do known[$pem]=1; done < <(pem_blocks "$rootfs/etc/ssl/certs/ca-certificates.crt")
mkdir -p "$rootfs/usr/local/share/ca-certificates"
n=0
while IFS= read -r -d '' pem; do
    [ -n "${known[$pem]:-}" ] && continue
    n=$((n + 1))
    printf '%s' "$pem" >"$rootfs/usr/local/share/ca-certificates/vf-sandbox-host-$n.crt"
done < <(pem_blocks "$ca_bundle")
log "host CA bundle: $n certificate(s) beyond Debian's set"
if [ "$n" -gt 0 ]; then
    chroot "$rootfs" /usr/sbin/update-ca-certificates >/dev/null 2>&1 ||
        log "WARNING: update-ca-certificates in the rootfs failed; the copied bundle still applies"
fi
install -m 0644 "$ca_bundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"

# --- tidy --------------------------------------------------------------------------------------------
rm -rf "${rootfs:?}"/var/lib/apt/lists/* "${rootfs:?}"/var/cache/apt/* "${rootfs:?}"/var/cache/debconf/*-old \
    "${rootfs:?}"/var/lib/dpkg/*-old "${rootfs:?}"/tmp/* "${rootfs:?}"/var/tmp/* "${rootfs:?}"/debootstrap
mkdir -p "$rootfs/var/lib/apt/lists/partial" "$rootfs/var/cache/apt/archives/partial"
find "$rootfs/var/log" -type f -delete
# Docker provides these at run time.
: >"$rootfs/etc/resolv.conf"
: >"$rootfs/etc/hostname"
[ -e "$rootfs/etc/machine-id" ] && : >"$rootfs/etc/machine-id"

# --- import ----------------------------------------------------------------------------------------------
build_date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
log "docker import -> $image"
tar --numeric-owner -C "$rootfs" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -c . |
    docker import \
        --change "ENV PATH=$image_path" \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        --change "LABEL org.vf-sandbox.image.name=\"$image\" org.vf-sandbox.image.debian-suite=\"$suite\" org.vf-sandbox.image.debian-mirror=\"$mirror\" org.vf-sandbox.image.debian-security-mirror=\"$security\" org.vf-sandbox.image.build-date=\"$build_date\" org.opencontainers.image.created=\"$build_date\"" \
        - "$image" >/dev/null
docker tag "$image" "$alias_image"

# --- check ---------------------------------------------------------------------------------------------------
out=$(docker run --rm "$image" python3 -c 'print(1)') || die "python3 does not run in $image"
[ "$out" = 1 ] || die "python3 in $image printed '$out', expected 1"
size=$(docker image inspect -f '{{.Size}}' "$image")
log "built $image (+ $alias_image), $((size / 1024 / 1024)) MiB, in $((SECONDS - start))s; python3 check OK"
