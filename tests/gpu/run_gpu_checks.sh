#!/usr/bin/env bash
# packd's GPU checks for a machine with an NVIDIA GPU, nvcc and a shell (none of packd's Debian
# packages needed): builds the GPU kernels with their standalone check (tests/gpu/gpu_check.cu),
# runs the byte-for-byte correctness cases and the benchmark table, and, where Python's torch
# with CUDA is present, times torch's x[mask] on the same shapes. Finishes in well under 5 minutes.
#
#   tests/gpu/run_gpu_checks.sh                # results also in $OUT (default /tmp/packd-gpu)
#   ARCH=sm_90 tests/gpu/run_gpu_checks.sh     # nvcc -arch (default: native, the installed GPU)
set -euo pipefail
cd "$(dirname "$0")/../.."
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
arch=${ARCH:-native}
out=${OUT:-/tmp/packd-gpu}
mkdir -p "$out"

echo "== build ($nvcc -arch=$arch)"
start=$(date +%s)
"$nvcc" -std=c++17 -O3 -arch="$arch" -I. tests/gpu/gpu_check.cu kernels/gpu/gpu_kernels.cu \
  -o "$out/gpu_check"
echo "built in $(($(date +%s) - start)) s"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
  --format=csv,noheader || true

echo "== correctness and benchmark"
status=0
"$out/gpu_check" | tee "$out/gpu_check.txt" || status=$?

echo "== torch x[mask] on the same shapes"
py=${PYTHON:-python3}
if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  "$py" tests/gpu/torch_baseline.py | tee "$out/torch_baseline.txt"
else
  echo "skipped: no Python torch with CUDA here"
fi
exit $status
