#!/usr/bin/env bash
# `make test` as a new user runs it: in a fresh Debian 12 (bookworm) root made by debootstrap
# (minbase), given only make, git and the CA certificates, on a clone of this checkout's HEAD. What
# the development machine happens to have installed cannot hide a missing dependency or a
# difference in what Debian resolves today (OpenBLAS, say, chosen for libtorch's BLAS on a machine
# that has none, where another machine has the reference BLAS).
#
#   deploy/fresh-machine-test.sh                  # clone, make test: the whole build (~11 min on 2 cores)
#   deploy/fresh-machine-test.sh --tests-only DIR # no build: the fresh root installs the packages
#                                                 # and runs the tests of the build in DIR (absolute, a
#                                                 # Release build of this checkout) against them, but
#                                                 # for the PyPI stack's (label pypi)
#   KEEP=1 deploy/fresh-machine-test.sh ...       # keep the root afterwards (its path is printed)
#
# Needs root, debootstrap and a Debian mirror (MIRROR, default http://deb.debian.org/debian). The
# root goes under ${TMPDIR:-/var/tmp}; everything mounted into it is unmounted when the script ends.
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$PWD
mirror=${MIRROR:-http://deb.debian.org/debian}

tests_only=""
if [[ "${1:-}" == "--tests-only" ]]; then
  tests_only=${2:?"--tests-only needs the build folder"}
  [[ "$tests_only" == /* && -f "$tests_only/CTestTestfile.cmake" ]] || {
    echo "fresh-machine-test: $tests_only is not an absolute path to a build folder" >&2
    exit 2
  }
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--tests-only BUILD_DIR]" >&2
  exit 2
fi
((EUID == 0)) || { echo "fresh-machine-test: run as root (debootstrap, chroot)" >&2; exit 1; }
command -v debootstrap >/dev/null || {
  echo "fresh-machine-test: install debootstrap (apt-get install debootstrap)" >&2
  exit 1
}

root=$(mktemp -d "${TMPDIR:-/var/tmp}/packd-fresh.XXXXXX")
chmod 755 "$root"
mounts=()
cleanup() {
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount -R -l "${mounts[i]}" 2>/dev/null || true
  done
  if [[ "${KEEP:-0}" == 1 ]]; then
    echo "fresh-machine-test: the root is kept at $root"
  else
    rm -rf --one-file-system "$root"
  fi
}
trap cleanup EXIT
mount_into() {  # mount_into WHERE ARGS...: a mount undone at the end
  local where=$root$1
  shift
  mkdir -p "$where"
  mount "$@" "$where"
  mounts+=("$where")
}

step() { echo "== fresh-machine-test: $* ($(date -u +%H:%M:%S))"; }

step "debootstrap --variant=minbase bookworm from $mirror into $root"
debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
  tail -20 "$root.debootstrap.log" >&2
  exit 1
}
rm -f "$root.debootstrap.log"
echo "deb $mirror bookworm main" >"$root/etc/apt/sources.list"
cp /etc/resolv.conf "$root/etc/resolv.conf"
mount_into /proc -t proc proc
mount_into /sys -t sysfs sys
mount_into /dev --rbind /dev
# A clean environment, but for this machine's proxy and trust settings (a proxy's CA bundle is
# copied to the same path in the root), which a fresh machine here would have too.
passed=()
for var in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY SSL_CERT_FILE \
  PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST PIP_CERT PIP_DEFAULT_TIMEOUT; do
  [[ -n "${!var:-}" ]] || continue
  passed+=("$var=${!var}")
  if [[ "${!var}" == /* && -f "${!var}" ]]; then
    mkdir -p "$root$(dirname "${!var}")"
    cp "${!var}" "$root${!var}"
  fi
done
# pip's own settings file, as this machine's pip reads it (the PyPI stack's downloads).
if [[ -f /etc/pip.conf ]]; then cp /etc/pip.conf "$root/etc/pip.conf"; fi
in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  DEBIAN_FRONTEND=noninteractive "${passed[@]}" "$@"; }

step "apt-get install make git ca-certificates (all the fresh root is given)"
in_root apt-get update -qq
in_root apt-get install -y -qq --no-install-recommends make git ca-certificates >/dev/null

if [[ -z "$tests_only" ]]; then
  step "git clone of $(git rev-parse --short HEAD), then make test"
  mount_into /src --bind "$checkout"
  mount -o remount,bind,ro "$root/src"
  in_root git config --global --add safe.directory '*'
  in_root git clone -q /src /packd
  # The design documents beside the checkout, as a clone on a developer's machine has them.
  if [[ -d "$checkout/../shared" ]]; then cp -r "$checkout/../shared" "$root/shared"; fi
  in_root bash -c 'cd /packd && make test'
else
  step "the packages (deploy/install-deps.sh), then the tests of $tests_only"
  # The checkout at its own path, so that the build's absolute paths hold in the root.
  mount_into "$checkout" --bind "$checkout"
  if [[ -d /usr/local/cuda ]]; then mount_into /usr/local/cuda --bind /usr/local/cuda; fi
  # Without the PyPI stack: its tests (label pypi) ran against this build already, on the same
  # Debian python3, and a venv made here would download its 3 GB again.
  in_root bash -c "cd '$checkout' && PACKD_PYPI=0 deploy/install-deps.sh >/dev/null"
  # One torch thread per test, as `make test` runs them (its TEST_THREADS).
  in_root bash -c "cd '$tests_only' && OMP_NUM_THREADS=1 ctest --output-on-failure -j $(nproc) -LE pypi"
fi
step "passed"
