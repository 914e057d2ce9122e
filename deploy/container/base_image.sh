#!/usr/bin/env bash
# Makes the local Debian 12 base image that the CPU image, the load balancer
# and Prometheus are built on (no registry is reachable from the build
# machine, so nothing is pulled): debootstrap --variant=minbase bookworm from
# the mirror in apt's sources, apt's lists and .deb cache removed, then
# `docker import`.
#
#   deploy/container/base_image.sh [TAG]      # default local/debian:12
#
# Needs root, debootstrap and a running dockerd ($DOCKER_HOST). The root is
# kept as a tarball in $TE_BASE_CACHE (default /var/cache/te_docker), so a
# later run, or one after dockerd's images were wiped, only imports it again.
set -euo pipefail
tag="${1:-local/debian:12}"
docker="${DOCKER:-/usr/bin/docker}"
cache="${TE_BASE_CACHE:-/var/cache/te_docker}"
tarball="$cache/debian12-minbase.tar"

if "$docker" image inspect "$tag" >/dev/null 2>&1; then
  echo "base_image: $tag present" >&2
  exit 0
fi
if [ ! -s "$tarball" ]; then
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
  if [ -z "$mirror" ]; then
    mirror="$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)"
  fi
  mirror="${mirror:-http://deb.debian.org/debian}"
  root="$(mktemp -d /tmp/te_base_root.XXXXXX)"
  trap 'rm -rf "$root"' EXIT
  echo "base_image: debootstrap minbase bookworm from $mirror" >&2
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 ||
    { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
  rm -f "$root.log"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/var/log/*.log
  mkdir -p "$cache"
  tar --numeric-owner -C "$root" -cf "$tarball.tmp" .
  mv "$tarball.tmp" "$tarball"
fi
echo "base_image: importing $tarball as $tag" >&2
"$docker" import - "$tag" <"$tarball" >/dev/null
