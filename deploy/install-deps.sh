#!/usr/bin/env bash
# Installs the Debian packages packd needs to build, test and run, and the PyPI stack its Python
# tests run on a second time. This is the one list: every other entry point (make test, make run,
# .ci/run, the Dockerfile) calls this script. Idempotent: packages already installed are skipped
# and the PyPI venv is cached, so a second run does nothing and needs no network.
#
#   deploy/install-deps.sh                    # as root, or through sudo: everything make test needs
#   PACKD_DEPS=build deploy/install-deps.sh   # only what building packd and packctl needs (no
#                                             # libtorch, tests or tools): the image's build stage
#   PACKD_WITH_TORCH=1 PACKD_DEPS=build ...   # ... with the libtorch backend
#   PACKD_WITH_HIP=1 deploy/install-deps.sh   # also the ROCm compiler (hipcc)
#   PACKD_WITH_DOCKER=1 deploy/install-deps.sh  # also Docker and debootstrap (building the image)
#   PACKD_PYPI=0 deploy/install-deps.sh       # without the PyPI stack's venv (below)
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libabsl-dev
  libprotobuf-dev protobuf-compiler
  libgrpc++-dev protobuf-compiler-grpc
  prometheus-cpp-dev
  libssl-dev  # SHA-256 for tenants named by their token's digest
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
      python3-matplotlib
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

sudo=()
if ((EUID != 0)); then
  sudo=(sudo)
fi
if ((${#missing[@]} > 0)); then
  if ((EUID != 0)) && ! command -v sudo >/dev/null; then
    echo "install-deps: need root or sudo to install: ${missing[*]}" >&2
    exit 1
  fi
  echo "install-deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The PyPI stack (deploy/pypi-venv.sh): the newest torch, grpcio, protobuf, numpy, transformers,
# verl and trl pinned in deploy/pypi-constraints.txt, in a virtual environment cached outside the
# checkout (about 3 GB downloaded once, 6 GB on disk), on which make test runs every Python test a
# second time. PACKD_PYPI=0 leaves it out (an offline machine): those tests then show as skipped.
if [[ "${PACKD_DEPS:-all}" == all && "${PACKD_PYPI:-1}" != 0 ]]; then
  "$(dirname "$0")/pypi-venv.sh" >/dev/null
fi
