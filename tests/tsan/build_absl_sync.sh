#!/usr/bin/env bash
# Builds abseil's synchronization library (absl::Mutex, CondVar, Notification) with
# ThreadSanitizer, from Debian's own source package of the installed version, into DIR.
#
# The TSan suite (make tsan) runs with DIR first on LD_LIBRARY_PATH. Debian's build of abseil is
# not instrumented, so TSan would not see packd's (or gRPC's) locks and would report every access
# they guard; this one library, the same version with the same patches, makes them visible.
#
#   tests/tsan/build_absl_sync.sh build-tsan/absl-sync
set -euo pipefail
out=$(realpath -m "${1:?usage: build_absl_sync.sh DIR}")
if [[ -e "$out/libabsl_synchronization.so.20220623" ]]; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

version=$(dpkg-query -W -f='${source:Version}' libabsl-dev)
if ! apt-get source --download-only -qq "abseil=$version" >/dev/null 2>&1; then
  # The source of Debian's packages: the same mirrors as the binaries, as deb-src.
  if ((EUID != 0)); then
    echo "build_absl_sync: need root to add Debian's source repositories" >&2
    exit 1
  fi
  sed -e 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources \
    > /etc/apt/sources.list.d/packd-deb-src.sources
  apt-get update -qq
  apt-get source --download-only -qq "abseil=$version" >/dev/null
fi
tar xf abseil_*.orig.tar.gz
src=$(find . -maxdepth 1 -type d -name 'abseil-*' | head -1)
tar xf abseil_*.debian.tar.xz -C "$src"
for p in $(cat "$src/debian/patches/series"); do
  patch -d "$src" -p1 -s < "$src/debian/patches/$p"
done
cmake -S "$src" -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_STANDARD=17 -DABSL_PROPAGATE_CXX_STD=ON \
  -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF -DCMAKE_SKIP_RPATH=ON \
  -DCMAKE_CXX_FLAGS=-fsanitize=thread -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread >/dev/null
ninja -C build absl/synchronization/libabsl_synchronization.so >/dev/null
mkdir -p "$out"
cp -P build/absl/synchronization/libabsl_synchronization.so* "$out/"
echo "build_absl_sync: $out/libabsl_synchronization.so.20220623 (ThreadSanitizer)"
