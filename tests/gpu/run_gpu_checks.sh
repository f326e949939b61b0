#!/usr/bin/env bash
# packd's GPU checks for a machine with an NVIDIA GPU, nvcc, Python and torch with CUDA (none of
# packd's Debian packages needed):
#   1. the GPU kernels with their standalone check (tests/gpu/gpu_check.cu): byte-for-byte
#      correctness cases and the benchmark table;
#   2. packd itself on the GPU with the Python client (tests/gpu/gpu_client_check.py): a device
#      region exported by a child process, Pack and Scatter of CUDA tensors of every dtype,
#      RemotePackOp backward, documents, layouts, Ulysses, shared prompts, the step
#      (PackMicroBatches) on device regions against the host step and against Plan + N x Pack,
#      and the regions' lifecycle, all byte for byte; this needs the bundle
#      tests/gpu/make_gpu_bundle.sh makes (.gpu/, carried with the tree);
#   3. torch's x[mask] on the kernel table's shapes.
# Ends with one table ($OUT/summary.txt: the parts, then part 2's rows); exits non-zero on any mismatch, and, where nvidia-smi sees a GPU,
# when any part was skipped (a missing bundle, torch without CUDA): a run on a GPU machine that
# tested nothing must not pass. About 2 minutes on an H200.
#
# The bundle (.gpu/: packd built with CUDA, its shared libraries, the Python client) is made on
# the machine where packd builds, and travels with the run (the device tool's `carry`):
#
#   tests/gpu/make_gpu_bundle.sh               # here, where packd builds
#   tests/gpu/run_gpu_checks.sh                # there; results also in $OUT (default /tmp/packd-gpu)
#   ARCH=sm_90 tests/gpu/run_gpu_checks.sh     # nvcc -arch (default: native, the installed GPU)
set -uo pipefail
cd "$(dirname "$0")/../.."
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
arch=${ARCH:-native}
out=${OUT:-/tmp/packd-gpu}
bundle=${PACKD_GPU_BUNDLE:-.gpu}
py=${PYTHON:-python3}
mkdir -p "$out"
summary=()
status=0
note() { summary+=("$(printf '%-28s %-9s %s' "$1" "$2" "$3")"); }

echo "== build ($nvcc -arch=$arch)"
start=$(date +%s)
if "$nvcc" -std=c++17 -O3 -arch="$arch" -I. tests/gpu/gpu_check.cu kernels/gpu/gpu_kernels.cu \
    -o "$out/gpu_check"; then
  note "kernels: build" ok "$(($(date +%s) - start)) s"
else
  note "kernels: build" FAILED "nvcc"
  status=1
fi
# Whether the machine has a GPU: then every part must run.
has_gpu=no
if command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader; then
  has_gpu=yes
fi
gpu=no
"$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && gpu=yes

echo "== 1. kernels: correctness and benchmark"
if [ -x "$out/gpu_check" ]; then
  "$out/gpu_check" | tee "$out/gpu_check.txt"
  code=${PIPESTATUS[0]}
  if grep -q SKIPPED "$out/gpu_check.txt"; then
    note "kernels: correctness" skipped "no GPU device"
  else
    line=$(grep '^correctness:' "$out/gpu_check.txt" || echo "no result")
    if [ "$code" -eq 0 ]; then note "kernels: correctness" ok "$line"; else
      note "kernels: correctness" MISMATCH "$line"; status=1; fi
  fi
fi

echo "== 2. packd on the GPU with the Python client"
if [ ! -x "$bundle/bin/packd" ]; then
  note "packd + Python client" skipped "no bundle $bundle (tests/gpu/make_gpu_bundle.sh)"
elif [ "$gpu" != yes ]; then
  note "packd + Python client" skipped "no Python torch with CUDA"
else
  export LD_LIBRARY_PATH="$PWD/$bundle/lib:${LD_LIBRARY_PATH:-}" PACKD_BINARY="$PWD/$bundle/bin/packd"
  export PYTHONPATH="$PWD/$bundle/python" PYTHONUNBUFFERED=1
  if ! "$py" -c 'import packd' 2>/dev/null; then
    # That protobuf does not take the stubs: the bundle's, in pure Python.
    export PYTHONPATH="$PYTHONPATH:$PWD/$bundle/pyproto" PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python
  fi
  timeout 300 "$py" tests/gpu/gpu_client_check.py | tee "$out/gpu_client_check.txt"
  code=${PIPESTATUS[0]}
  line=$(grep '^gpu client checks:' "$out/gpu_client_check.txt" || echo "did not finish")
  if [ "$code" -eq 0 ]; then note "packd + Python client" ok "$line"; else
    note "packd + Python client" MISMATCH "$line (exit $code)"; status=1; fi
fi

echo "== 3. torch x[mask] on the kernel table's shapes"
if [ "$gpu" = yes ]; then
  "$py" tests/gpu/torch_baseline.py | tee "$out/torch_baseline.txt" &&
    note "torch baseline" ok "torch_baseline.txt" || note "torch baseline" failed ""
else
  note "torch baseline" skipped "no Python torch with CUDA"
fi

echo "== summary"
{
  printf '%-28s %-9s %s\n' part result detail
  printf '%s\n' "${summary[@]}"
  # Part 2's rows (one per check, packd's and the peer's times): the table docs/gpu.md lists.
  if [ -s "$out/gpu_client_check.txt" ]; then
    echo
    grep -E '^check | (ok|MISMATCH) ' "$out/gpu_client_check.txt"
  fi
} | tee "$out/summary.txt"
if [ "$has_gpu" = yes ] && printf '%s\n' "${summary[@]}" | grep -q ' skipped '; then
  echo "FAILED: nvidia-smi sees a GPU, but a part was skipped (see the table): on a GPU machine" \
    "every part must run" | tee -a "$out/summary.txt"
  status=1
fi
exit $status
