#!/usr/bin/env bash
# Installs the Debian packages packd needs to build, test and run. This is the one list: every other
# entry point (make test, make run, .ci/run, the Dockerfile) calls this script. Idempotent:
# packages already installed are skipped, so a second run does nothing and needs no network.
#
#   deploy/install-deps.sh                    # as root, or through sudo: everything make test needs
#   PACKD_DEPS=build deploy/install-deps.sh   # only what building packd and packctl needs (no
#                                             # libtorch, tests or tools): the image's build stage
#   PACKD_WITH_TORCH=1 PACKD_DEPS=build ...   # ... with the libtorch backend
#   PACKD_WITH_HIP=1 deploy/install-deps.sh   # also the ROCm compiler (hipcc)
#   PACKD_WITH_DOCKER=1 deploy/install-deps.sh  # also Docker and debootstrap (building the image)
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libabsl-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
)
case "${PACKD_DEPS:-all}" in
  build)
    if [[ "${PACKD_WITH_TORCH:-0}" == 1 ]]; then
      packages+=(libtorch-dev)
    fi
    ;;
  all)
    packages+=(
      clang-format clang libclang-rt-14-dev
      libtorch-dev
      libgtest-dev libgmock-dev libbenchmark-dev
      python3-torch python3-grpcio python3-pytest python3-venv python3-setuptools python3-wheel
      openssl patch xz-utils
    )
    ;;
  *)
    echo "install-deps: PACKD_DEPS must be all or build, not ${PACKD_DEPS}" >&2
    exit 2
    ;;
esac
if [[ "${PACKD_WITH_HIP:-0}" == 1 ]]; then
  packages+=(hipcc)
fi
if [[ "${PACKD_WITH_DOCKER:-0}" == 1 ]]; then
  packages+=(docker.io debootstrap)
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
