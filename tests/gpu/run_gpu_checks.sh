#!/usr/bin/env bash
# packd's GPU checks for a machine with an NVIDIA GPU, nvcc, Python and torch with CUDA (none of
# packd's Debian packages needed). In order, each with its budget on an H200 (what the parts took
# on the fake GPU or on this 2-core machine, then the limit; the machine's own start not counted):
#   0. preflight (tests/gpu/ipc_preflight.py): a child process exports 1 MiB by CUDA IPC and this
#      one opens it; ~1 s, at most 20. A machine that refuses is reported as such, with the
#      driver's error ("this machine refuses CUDA IPC", exit 3), not as a packd mismatch, and
#      part 2, which needs IPC, does not run.
#   1. the GPU kernels with their standalone check (tests/gpu/gpu_check.cu): nvcc for one
#      architecture (~5 s here), byte-for-byte correctness cases (the one over 4 GiB ~40 s of
#      host reference; PACKD_GPU_CHECK_SKIP_LARGE=1 leaves it out) and the benchmark table
#      (~5 s); at most 2 minutes.
#   2. packd itself on the GPU with the Python client (tests/gpu/gpu_client_check.py): a device
#      region exported by a child process, Pack and Scatter of CUDA tensors of every dtype,
#      RemotePackOp, documents, layouts, Ulysses, shared prompts, the step on device regions, the
#      regions' lifecycle and the server's exit, every check on its own (one row each; an
#      exception is its row's MISMATCH); ~45 s on the fake GPU (2 cores; torch's CUDA start, in
#      two processes, comes on top: ~90 s), killed at 180 s (120 with --quick). Needs the bundle
#      tests/gpu/make_gpu_bundle.sh makes (.gpu/, carried with the tree).
#   3. torch's x[mask] on the kernel table's shapes: ~30 s, at most 1 minute.
# In all ~3 minutes, 6.5 at the most; --quick (no case over 4 GiB, one timing a call, no part 3)
# ~1.5, 4 at the most. Ends with one table ($OUT/summary.txt: the parts, then part 2's rows),
# printed however the run ends; exits 1 on any mismatch, 3 when the machine refuses CUDA IPC and
# nothing else failed, and, where nvidia-smi sees a GPU, 1 when any part was skipped (a missing
# bundle, torch without CUDA): a run on a GPU machine that tested nothing must not pass.
#
#   tests/gpu/make_gpu_bundle.sh               # here, where packd builds
#   tests/gpu/run_gpu_checks.sh [--quick]      # there; results also in $OUT (default /tmp/packd-gpu)
#
# ARCH: nvcc -arch (default sm_XY from nvidia-smi's compute capability, else native).
# PACKD_GPU_CHECK_SKIP_LARGE=1: the rerun mode (the 4.3 GB case left out).
# PACKD_FAKE_GPU_LIB=libpackd_fake_gpu_c.so: the rehearsal (tests/gpu/rehearse.sh): parts 0 and 2
# against packd's fake GPU with the bundle's packd_testing; parts 1 and 3 need CUDA and skip.
#
# packd gets the bundle's libraries through its wrapper (.gpu/bin/packd): Python and torch keep
# their own. Part 2 pins torch's allocator to plain cudaMalloc segments
# (PYTORCH_CUDA_ALLOC_CONF=backend:native,expandable_segments:False; PYTORCH_ALLOC_CONF unset):
# expandable segments and cudaMallocAsync make memory that CUDA IPC cannot export.
set -uo pipefail
cd "$(dirname "$0")/../.."
quick=no
for arg in "$@"; do
  case $arg in
    --quick) quick=yes ;;
    *) echo "usage: $0 [--quick]" >&2; exit 2 ;;
  esac
done
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
out=${OUT:-/tmp/packd-gpu}
bundle=${PACKD_GPU_BUNDLE:-.gpu}
[ -d "$bundle" ] && bundle=$(cd "$bundle" && pwd)
py=${PYTHON:-python3}
fake=${PACKD_FAKE_GPU_LIB:-}
[[ $quick == yes ]] && export PACKD_GPU_CHECK_SKIP_LARGE=1 PACKD_GPU_CHECK_QUICK=1
# Part 1's check, killed past its budget (the case over 4 GiB is most of it).
kernels_limit=$([ "${PACKD_GPU_CHECK_SKIP_LARGE:-}" = 1 ] && echo 60 || echo 120)
mkdir -p "$out"
rm -f "$out/gpu_client_check.txt"
summary=()
status=0
ipc_refused=no
has_gpu=no  # nvidia-smi sees a GPU (below)
note() { summary+=("$(printf '%-28s %-9s %s' "$1" "$2" "$3")"); }
run_start=$(date +%s)
elapsed() { echo "$(($(date +%s) - $1)) s"; }

# The table, however the run ends (a part's crash, a timeout's SIGTERM).
finish() {
  trap - EXIT
  echo "== summary ($(elapsed "$run_start"))"
  {
    printf '%-28s %-9s %s\n' part result detail
    printf '%s\n' "${summary[@]}"
    # Part 2's rows (one per check, packd's and the peer's times): the table docs/gpu.md lists.
    if [ -s "$out/gpu_client_check.txt" ]; then
      echo
      grep -E '^check | (ok|MISMATCH) |^target ' "$out/gpu_client_check.txt"
    fi
  } | tee "$out/summary.txt"
  if [ "$has_gpu" = yes ] && printf '%s\n' "${summary[@]}" | grep -q ' skipped '; then
    echo "FAILED: nvidia-smi sees a GPU, but a part was skipped (see the table): on a GPU" \
      "machine every part must run" | tee -a "$out/summary.txt"
    status=1
  fi
  if [ "$status" -eq 0 ] && [ "$ipc_refused" = yes ]; then
    echo "this machine refuses CUDA IPC: packd's device regions cannot work here (see the" \
      "preflight row); not a packd mismatch" | tee -a "$out/summary.txt"
    status=3
  fi
  exit "$status"
}
trap finish EXIT
trap 'note "run" INTERRUPTED "signal after $(elapsed "$run_start")"; status=1; exit' TERM INT

# Whether the machine has a GPU: then every part must run.
cap=
if [ -z "$fake" ] && command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader; then
  has_gpu=yes
  cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
fi
arch=${ARCH:-$([ -n "$cap" ] && echo "sm_$cap" || echo native)}

echo "== 0. preflight: CUDA IPC between two processes${fake:+ (the fake GPU)}"
start=$(date +%s)
line=$(timeout 20 "$py" tests/gpu/ipc_preflight.py 2>&1)
code=$?
echo "$line"
case $code in
  0) note "preflight: CUDA IPC" ok "$(elapsed "$start")" ;;
  2) note "preflight: CUDA IPC" REFUSED "${line#preflight: }"; ipc_refused=yes ;;
  *) note "preflight: CUDA IPC" skipped "${line#preflight: }" ;;
esac

echo "== 1. kernels: correctness and benchmark"
if [ -n "$fake" ]; then
  note "kernels" skipped "the fake GPU runs no CUDA code (gpu_pack_fake_test runs the cases)"
else
  start=$(date +%s)
  built=no
  if [ ! -x "$nvcc" ] && [ -x "$bundle/bin/gpu_check" ]; then
    echo "-- no nvcc here: the bundle's prebuilt check"
    cp "$bundle/bin/gpu_check" "$out/gpu_check" && built=yes
    note "kernels: build" ok "no nvcc: the bundle's gpu_check (sm_80, sm_90 + PTX)"
  else
    echo "-- build ($nvcc -arch=$arch)"
    "$nvcc" -std=c++17 -O3 -arch="$arch" -I. tests/gpu/gpu_check.cu kernels/gpu/gpu_kernels.cu \
      -o "$out/gpu_check" && built=yes
    if [ "$built" = yes ]; then note "kernels: build" ok "$(elapsed "$start"), -arch=$arch"
    elif [ -x "$bundle/bin/gpu_check" ]; then
      cp "$bundle/bin/gpu_check" "$out/gpu_check" && built=yes
      note "kernels: build" FAILED "nvcc -arch=$arch; the bundle's gpu_check runs instead"
      status=1
    fi
  fi
  if [ "$built" = yes ]; then
    start=$(date +%s)
    timeout "$kernels_limit" "$out/gpu_check" | tee "$out/gpu_check.txt"
    code=${PIPESTATUS[0]}
    if grep -q SKIPPED "$out/gpu_check.txt"; then
      note "kernels: correctness" skipped "no GPU device"
    else
      line=$(grep '^correctness:' "$out/gpu_check.txt" || echo "no result")
      if [ "$code" -eq 0 ]; then note "kernels: correctness" ok "$line ($(elapsed "$start"))"; else
        note "kernels: correctness" MISMATCH "$line (exit $code)"; status=1; fi
    fi
  else
    note "kernels: build" FAILED "nvcc -arch=$arch"
    status=1
  fi
fi

echo "== 2. packd on the GPU with the Python client"
server=$bundle/bin/packd
[ -n "$fake" ] && server=$bundle/bin/packd_testing
client_ready() {
  # packd.Client constructed (not only imported: a protobuf without what the stubs use fails
  # there). A module this Python lacks comes from the bundle's wheels, unpacked under $out.
  local module wheel dir
  for module in typing_extensions google.protobuf grpc; do
    "$py" -c "import $module" 2>/dev/null && continue
    case $module in
      grpc) wheel=$(ls "$bundle"/wheels/grpcio-*-"$("$py" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"-*.whl 2>/dev/null | head -1) ;;
      google.protobuf) wheel=$(ls "$bundle"/wheels/protobuf-*.whl 2>/dev/null | head -1) ;;
      *) wheel=$(ls "$bundle"/wheels/typing_extensions-*.whl 2>/dev/null | head -1) ;;
    esac
    [ -n "$wheel" ] || { echo "no $module here and no wheel of it in $bundle/wheels"; return 1; }
    dir=$out/site/$(basename "$wheel" .whl)
    [ -d "$dir" ] || "$py" -m zipfile -e "$wheel" "$dir" || return 1
    export PYTHONPATH="$PYTHONPATH:$dir"
    echo "$module: from $(basename "$wheel")"
  done
  "$py" -c 'import packd; packd.Client("unix:///nonexistent/packd.sock").close()' 2>&1 | tail -1
  return "${PIPESTATUS[0]}"
}
start=$(date +%s)
if [ ! -x "$server" ]; then
  note "packd + Python client" skipped "no bundle $bundle (tests/gpu/make_gpu_bundle.sh)"
elif [ "$ipc_refused" = yes ]; then
  note "packd + Python client" skipped "this machine refuses CUDA IPC (preflight)"
elif [ -z "$fake" ] && ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  note "packd + Python client" skipped "no Python torch with CUDA"
else
  export PACKD_BINARY="$server" PYTHONPATH="$bundle/python" PYTHONUNBUFFERED=1
  export PYTORCH_CUDA_ALLOC_CONF=backend:native,expandable_segments:False
  unset PYTORCH_ALLOC_CONF
  # Not in a subshell: the wheels' directories it adds stay on PYTHONPATH.
  client_ready >"$out/client_probe.txt" 2>&1
  code=$?
  cat "$out/client_probe.txt"
  if [ "$code" -ne 0 ]; then
    note "packd + Python client" FAILED "packd.Client: $(tail -1 "$out/client_probe.txt")"
    status=1
  else
    PACKD_GPU_CHECK_JSON="$out/gpu_client_check.json" \
      timeout "$([ "$quick" = yes ] && echo 120 || echo 180)" "$py" tests/gpu/gpu_client_check.py | tee "$out/gpu_client_check.txt"
    code=${PIPESTATUS[0]}
    line=$(grep '^gpu client checks:' "$out/gpu_client_check.txt" || echo "did not finish")
    if [ "$code" -eq 0 ]; then note "packd + Python client" ok "$line ($(elapsed "$start"))"; else
      note "packd + Python client" MISMATCH "$line (exit $code)"; status=1; fi
  fi
fi

echo "== 3. torch x[mask] on the kernel table's shapes"
if [ -n "$fake" ]; then
  note "torch baseline" skipped "the fake GPU: no torch CUDA"
elif [ "$quick" = yes ]; then
  note "torch baseline" "-" "--quick"
elif "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  start=$(date +%s)
  if timeout 60 "$py" tests/gpu/torch_baseline.py | tee "$out/torch_baseline.txt"; then
    note "torch baseline" ok "torch_baseline.txt ($(elapsed "$start"))"
  else
    note "torch baseline" failed ""
  fi
else
  note "torch baseline" skipped "no Python torch with CUDA"
fi
