#!/usr/bin/env bash
# Prepares, on a machine with packd's build dependencies, what run_gpu_checks.sh needs on a GPU
# machine that has none of them (only nvcc, Python and torch with CUDA): packd built with CUDA
# and without libtorch, the shared libraries it loads (less the C and C++ runtimes and the
# driver), the Python client with its generated stubs, and this machine's protobuf for Python as
# a fallback for an older or newer one there. Writes .gpu/ (ignored by git) at the top of the
# tree; carry it to the GPU machine with the tree.
#
#   tests/gpu/make_gpu_bundle.sh          # then, there: tests/gpu/run_gpu_checks.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${BUNDLE:-.gpu}
build=${BUILD:-/tmp/packd-gpu-bundle}
start=$(date +%s)
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPACKD_WITH_TORCH=OFF \
  -DPACKD_WITH_CUDA=ON >/dev/null
cmake --build "$build" --target packd packd_python
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib" "$bundle/python" "$bundle/pyproto/google"
cp "$build/bin/packd" "$bundle/bin/"
ldd "$build/bin/packd" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
  grep -v -E '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|libcuda)\.so' |
  while read -r lib; do cp -L "$lib" "$bundle/lib/"; done
cp -r python/packd "$bundle/python/"
cp -r "$build/python/packd/v1" "$bundle/python/packd/"
find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +
protobuf=$(/usr/bin/python3 -c 'import google.protobuf, os; print(os.path.dirname(google.protobuf.__file__))')
cp -r "$protobuf" "$bundle/pyproto/google/"
find "$bundle/pyproto" \( -name __pycache__ -o -name '*.so' \) -prune -exec rm -rf {} +
echo "bundle $bundle: $(du -sh "$bundle" | cut -f1), made in $(($(date +%s) - start)) s"
