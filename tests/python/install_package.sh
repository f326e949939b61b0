#!/usr/bin/env bash
# Installs the Python client the way a user does (pip, offline, into a virtual environment that
# sees the system's torch and grpcio), from a copy of the sources so that the checkout stays
# clean, and checks that `import packd` finds the installed package from outside the tree.
#   install_package.sh PYTHON VENV SOURCE_ROOT
set -euo pipefail
python=$1 venv=$2 root=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/python" "$root/proto" "$work/"
# Leftovers of a build in the checkout (pip install ./python there) would be installed instead of
# the sources: the copies' times are all the same, so setuptools takes them as up to date.
rm -rf "$work/python/build" "$work/python/"*.egg-info
rm -rf "$venv"
"$python" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet --no-build-isolation --no-index --no-deps \
  --disable-pip-version-check "$work/python"
cd /
"$venv/bin/python" - "$venv" <<'PY'
import os, sys
import packd
from packd.v1 import pack_service_pb2, pack_service_pb2_grpc
where = os.path.realpath(packd.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), f"packd imported from {where}"
print(f"packd installed in {os.path.dirname(where)}")
PY
