#!/usr/bin/env bash
# Builds packd's server image from the Dockerfile, on a base image that is there: BASE_IMAGE when
# set, else debian:bookworm-slim (pulled when missing), else, where no registry serves it, a
# Debian 12 base made here by deploy/make-base-image.sh (kept for the next build).
#
#   deploy/build-image.sh [TAG] [docker build arguments...]     # default TAG: packd:latest
#   deploy/build-image.sh packd:cuda --build-arg BASE_IMAGE=nvidia/cuda:13.0.1-devel-ubuntu24.04 \
#       --build-arg RUNTIME_IMAGE=nvidia/cuda:13.0.1-base-ubuntu24.04 --build-arg PACKD_WITH_CUDA=ON
#
# The build stage needs the network for Debian's packages (docker build --network host).
set -euo pipefail
cd "$(dirname "$0")/.."
tag=${1:-packd:latest}
shift || true
base=${BASE_IMAGE:-}
if [[ -z "$base" ]]; then
  base=debian:bookworm-slim
  if ! docker image inspect "$base" >/dev/null 2>&1 && ! docker pull -q "$base" >/dev/null 2>&1; then
    echo "build-image: $base cannot be pulled; making a Debian 12 base instead"
    base=packd-base:bookworm
    deploy/make-base-image.sh "$base"
  fi
fi
echo "build-image: $tag on $base"
start=$SECONDS
docker build --network host --build-arg BASE_IMAGE="$base" -t "$tag" "$@" .
echo "build-image: $tag, $(($(docker image inspect -f '{{.Size}}' "$tag") / 1048576)) MiB, built in $((SECONDS - start)) s"
