#!/usr/bin/env bash
# Installs packd's wheel the way a user does (pip, offline) into a virtual environment over one of
# the two stacks the Python tests run on, and checks that `import packd` finds the installed
# package, stubs included, from outside the source tree, and prints the stack's versions.
#   install_package.sh PYTHON VENV WHEEL             # Debian's: a venv that sees the system's
#                                                    # torch, grpcio, protobuf and numpy
#   install_package.sh PYTHON VENV WHEEL BASE_VENV   # PyPI's: a venv over BASE_VENV's packages
#                                                    # (deploy/pypi-venv.sh)
# pip resolves the wheel's declared dependencies against the stack (no index): a stack older than
# what the wheel declares fails here.
set -euo pipefail
python=$1 venv=$2 wheel=$3 base=${4:-}
rm -rf "$venv"
if [[ -z "$base" ]]; then
  "$python" -m venv --system-site-packages "$venv"
else
  # No pip or setuptools of its own, which would shadow the base's: pip runs from the base.
  "$python" -m venv --without-pip "$venv"
  # The base venv's site-packages added as a site folder (its own .pth files processed too).
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  base_site=$("$base/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
  echo "import site; site.addsitedir('$base_site')" >"$site/packd-pypi-stack.pth"
fi
"$venv/bin/python" -m pip install --quiet --no-index --disable-pip-version-check "$wheel"
cd /
"$venv/bin/python" - "$venv" <<'PY'
import importlib.metadata as metadata
import os
import sys

import packd
from packd.v1 import pack_service_pb2, pack_service_pb2_grpc

where = os.path.realpath(packd.__file__)
assert where.startswith(os.path.realpath(sys.argv[1])), f"packd imported from {where}"
print(f"packd {packd.__version__} installed in {os.path.dirname(where)}")
print("stack: " + ", ".join(f"{p} {metadata.version(p)}"
                            for p in ("torch", "grpcio", "protobuf", "numpy")))
PY
