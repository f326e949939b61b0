#!/usr/bin/env bash
# Makes a Debian 12 (bookworm) base image for the Dockerfile where none can be pulled from a
# registry: a minimal root file system from debootstrap, imported into the local Docker daemon.
#
#   deploy/make-base-image.sh [TAG]          # default TAG: packd-base:bookworm
#   docker build --build-arg BASE_IMAGE=packd-base:bookworm ...
#
# Does nothing when TAG is already present. Needs root, debootstrap and a running Docker daemon;
# MIRROR (default http://deb.debian.org/debian) picks the Debian mirror.
set -euo pipefail
tag=${1:-packd-base:bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$tag" >/dev/null 2>&1; then
  echo "make-base-image: $tag is already there"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "make-base-image: install debootstrap" >&2; exit 1; }
root=$(mktemp -d)
chmod 755 "$root"  # the image's /: mktemp makes it 0700
trap 'rm -rf "$root"' EXIT
echo "make-base-image: debootstrap --variant=minbase bookworm from $mirror"
debootstrap --variant=minbase bookworm "$root" "$mirror" >/dev/null
# What debian:bookworm-slim has and a build needs: apt's sources, no caches or docs.
echo "deb $mirror bookworm main" > "$root/etc/apt/sources.list"
echo "deb $mirror bookworm-updates main" >> "$root/etc/apt/sources.list"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
  "$root"/usr/share/doc/* "$root"/usr/share/man/*
mkdir -p "$root/var/lib/apt/lists/partial"
chroot "$root" chown _apt:root /var/lib/apt/lists/partial  # apt downloads as _apt
tar -C "$root" -c . | docker import - "$tag" >/dev/null
echo "make-base-image: $tag ($(docker image inspect -f '{{.Size}}' "$tag" | numfmt --to=iec))"
