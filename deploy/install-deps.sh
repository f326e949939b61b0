#!/usr/bin/env bash
# Installs the Debian packages packd needs to build, test and run. This is the one list: every other
# entry point (make test, make run, .ci/run) calls this script. Idempotent: packages already
# installed are skipped, so a second run does nothing and needs no network.
#
#   deploy/install-deps.sh            # as root, or through sudo
#   PACKD_WITH_HIP=1 deploy/install-deps.sh   # also the ROCm compiler (hipcc)
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config clang-format
  clang libclang-rt-14-dev
  libabsl-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  libtorch-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3-torch python3-grpcio python3-pytest python3-venv python3-setuptools python3-wheel
  openssl patch xz-utils
)
if [[ "${PACKD_WITH_HIP:-0}" == 1 ]]; then
  packages+=(hipcc)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]} == 0)); then
  exit 0
fi

sudo=()
if ((EUID != 0)); then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
