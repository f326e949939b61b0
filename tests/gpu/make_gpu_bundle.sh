#!/usr/bin/env bash
# Prepares, on a machine with packd's build dependencies, what run_gpu_checks.sh needs on a GPU
# machine that has none of them (only nvcc, Python and torch with CUDA): packd built with CUDA
# and without libtorch, the shared libraries it loads (less the C and C++ runtimes and the
# driver) behind a wrapper that gives them to packd alone, the Python client with its generated
# stubs, and the wheels of the client's dependencies that such a machine may lack (grpcio,
# typing_extensions, protobuf: the constraints file's versions, for CPython 3.12 by default),
# unpacked there only for a module its Python cannot import. Writes .gpu/ (ignored by git) at the
# top of the tree; carry it to the GPU machine with the tree.
#
#   tests/gpu/make_gpu_bundle.sh          # then, there: tests/gpu/run_gpu_checks.sh
#
#   .gpu/bin/packd        the wrapper: LD_LIBRARY_PATH=.gpu/lib for packd only, then
#   .gpu/libexec/packd    the server
#   .gpu/python/packd     the Python client and its stubs
#   .gpu/wheels/          grpcio, typing_extensions, protobuf
#   .gpu/bin/gpu_check    the kernels' standalone check, prebuilt for sm_80 and sm_90 (with PTX)
#                         for a GPU machine without nvcc (run_gpu_checks.sh builds it with nvcc
#                         where there is one)
#
# BUNDLE_PYTHONS: the CPython versions to carry grpcio for ("3.12"; "" for none). FROM_BUILD=DIR
# bundles the binaries of an existing build (packd and, where built, packd_testing) instead of
# building packd: tests/gpu/rehearse.sh bundles the build under test that way.
set -euo pipefail
cd "$(dirname "$0")/../.."
bundle=${BUNDLE:-.gpu}
pythons=${BUNDLE_PYTHONS-3.12}
start=$(date +%s)
if [[ -n "${FROM_BUILD:-}" ]]; then
  build=$FROM_BUILD
  cmake --build "$build" --target packd packd_python >/dev/null
else
  build=${BUILD:-/tmp/packd-gpu-bundle}
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DPACKD_WITH_TORCH=OFF \
    -DPACKD_WITH_CUDA=ON >/dev/null
  cmake --build "$build" --target packd packd_python
fi
rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/libexec" "$bundle/lib" "$bundle/python" "$bundle/wheels"
for binary in packd packd_testing; do
  [[ -x "$build/bin/$binary" ]] || continue
  cp "$build/bin/$binary" "$bundle/libexec/"
  cat >"$bundle/bin/$binary" <<'EOF'
#!/bin/sh
# The bundle's libraries (Debian's gRPC, protobuf, abseil, OpenSSL, ...) on this server's library
# path alone: the Python process that starts it, and torch there, keep their own.
here=$(cd "$(dirname "$0")/.." && pwd)
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/libexec/$(basename "$0")" "$@"
EOF
  chmod +x "$bundle/bin/$binary"
  ldd "$build/bin/$binary" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
    grep -v -E '/(libc|libm|libpthread|libdl|librt|libgcc_s|libstdc\+\+|libcuda)\.so' |
    while read -r lib; do cp -L -n "$lib" "$bundle/lib/"; done
done
# The kernels' check for a machine without nvcc (GPU_CHECK_ARCHS: compute capabilities).
if [[ -z "${FROM_BUILD:-}" ]]; then
  nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
  gencode=()
  for cc in ${GPU_CHECK_ARCHS:-80 90}; do gencode+=(-gencode "arch=compute_$cc,code=sm_$cc"); done
  gencode+=(-gencode "arch=compute_$cc,code=compute_$cc")  # PTX of the newest, for later GPUs
  "$nvcc" -std=c++17 -O3 "${gencode[@]}" -I. tests/gpu/gpu_check.cu kernels/gpu/gpu_kernels.cu \
    -o "$bundle/bin/gpu_check"
fi
cp -r python/packd "$bundle/python/"
cp -r "$build/python/packd/v1" "$bundle/python/packd/"
find "$bundle/python" -name __pycache__ -prune -exec rm -rf {} +

# The client's dependencies as wheels, from PyPI (cached with the PyPI stack's wheels).
if [[ -n "$pythons" ]]; then
  cache=${PACKD_PYPI_CACHE:-$HOME/.cache/packd}/wheels
  mkdir -p "$cache"
  pip=()
  for py in python3 /usr/bin/python3; do
    if "$py" -m pip --version >/dev/null 2>&1; then pip=("$py" -m pip); break; fi
  done
  [[ ${#pip[@]} -gt 0 ]] || { echo "make_gpu_bundle: no pip to fetch the client's wheels" >&2; exit 1; }
  pinned() { grep -E "^$1==" deploy/pypi-constraints.txt; }
  for version in $pythons; do
    "${pip[@]}" download --quiet --no-deps --only-binary=:all: --dest "$cache" \
      --python-version "$version" --implementation cp --platform manylinux2014_x86_64 \
      "$(pinned grpcio)" "$(pinned protobuf)" "$(pinned typing_extensions)"
    tag=cp${version/./}
    cp "$cache"/grpcio-"$(pinned grpcio | cut -d= -f3)"-"$tag"-*.whl "$bundle/wheels/"
  done
  cp "$cache"/protobuf-"$(pinned protobuf | cut -d= -f3)"-*abi3*.whl "$bundle/wheels/"
  cp "$cache"/typing_extensions-"$(pinned typing_extensions | cut -d= -f3)"-*.whl "$bundle/wheels/"
fi
echo "bundle $bundle: $(du -sh "$bundle" | cut -f1), made in $(($(date +%s) - start)) s"
