#!/usr/bin/env bash
# Builds packd's wheel offline, as `make wheel` and the build do: pip wheel with the setuptools and
# wheel that PYTHON's system has (Debian's python3-setuptools and python3-wheel), from a copy of
# python/ so that the checkout stays clean; setup.py generates the stubs from proto/.
#   python/make_wheel.sh PYTHON OUT_DIR     # writes OUT_DIR/packd-VERSION-py3-none-any.whl
set -euo pipefail
python=$1 out=$2
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/python" "$work/python"
# Leftovers of an in-tree build would be packed instead of the sources.
rm -rf "$work/python/build" "$work/python/"*.egg-info
"$python" -m venv --system-site-packages "$work/venv"
mkdir -p "$out"
rm -f "$out"/packd-*.whl
PACKD_PROTO_DIR=$root/proto "$work/venv/bin/python" -m pip wheel --quiet --no-build-isolation \
  --no-deps --no-index --disable-pip-version-check -w "$out" "$work/python"
