#!/usr/bin/env bash
# What a new user does with packd's wheel: a fresh virtual environment with no system packages,
# `pip install` of the wheel with its declared dependencies (torch, grpcio, protobuf, numpy),
# resolved offline from the PyPI stack's downloaded wheels (deploy/pypi-venv.sh --wheels), then
# the README's first Pack call, word for word, against a packd (readme_first_call.py).
#   fresh_venv_first_call.sh PYTHON WHEEL WHEELS_DIR PACKD_BINARY README
set -euo pipefail
python=$1 wheel=$2 wheels=$3 packd=$4 readme=$5
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m venv "$work/venv"
started=$SECONDS
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index \
  --find-links "$wheels" "$wheel"
echo "pip install of the wheel and its dependencies (offline): $((SECONDS - started)) s," \
  "$(du -sm "$work/venv" | cut -f1) MB"
"$work/venv/bin/python" -m pip check
cd "$work"
PYTHONPATH=$here/../support "$work/venv/bin/python" "$here/readme_first_call.py" "$packd" "$readme"
