#!/usr/bin/env bash
# The GPU machine's run rehearsed where there is no GPU: tests/gpu/run_gpu_checks.sh as a GPU
# machine runs it (the bundle, the preflight, the client's probe, every check of part 2 on its
# own, the summary), against packd's fake GPU (tests/fake_gpu): the Python process's tensors in
# the fake GPU's memory, packd_testing --fake_gpu_devices=1 serving them from its IPC handles.
# Three runs:
#   1. clean: every row ok, exit 0;
#   2. planted failures (PACKD_GPU_CHECK_PLANT): a wrong byte in the step's device result and an
#      exception in the child-region check must be those two rows' MISMATCH while every other
#      row runs and is ok, the summary printed, exit 1;
#   3. a preflight that is refused (this process opens its own handle, which CUDA refuses):
#      "refuses CUDA IPC", part 2 not run, exit 3.
# Parts 1 and 3 need CUDA and show as skipped. Prints each run's summary; exits 1 when a run did
# not end as it should.
#
#   tests/gpu/rehearse.sh BUILD_DIR [PYTHON]     # ctest: rehearsal_gpu_checks
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:?usage: rehearse.sh BUILD_DIR [PYTHON]}" && pwd)
py=${2:-/usr/bin/python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/packd-rehearsal.XXXXXX")
trap 'rm -rf "$work"' EXIT
failed=0
fail() { echo "REHEARSAL FAILED: $*"; failed=1; }

FROM_BUILD=$build BUNDLE=$work/bundle BUNDLE_PYTHONS="" "$here/make_gpu_bundle.sh" || exit 1
export PACKD_FAKE_GPU_LIB=$build/lib/libpackd_fake_gpu_c.so PACKD_GPU_BUNDLE=$work/bundle
export PYTHON=$py

# run NAME [args...]: run_gpu_checks.sh into $work/NAME; its exit code in $code, summary in $sum.
run() {
  local name=$1
  shift
  echo "==== rehearsal: $name"
  OUT=$work/$name "$here/run_gpu_checks.sh" "$@" >"$work/$name.log" 2>&1
  code=$?
  sum=$work/$name/summary.txt
  if [ -s "$sum" ]; then cat "$sum"; else fail "$name: no summary"; tail -40 "$work/$name.log"; fi
}
rows() { grep -cE " $1 " "$sum" 2>/dev/null || true; }

run clean
[ "$code" -eq 0 ] || { fail "clean: exit $code, not 0"; tail -60 "$work/clean.log"; }
grep -qE '^preflight: CUDA IPC +ok' "$sum" || fail "clean: the preflight did not pass"
grep -qE '^packd \+ Python client +ok +gpu client checks: 0 failed' "$sum" ||
  fail "clean: part 2 did not pass"
clean_rows=$(rows ok)
[ "$(rows MISMATCH)" -eq 0 ] || fail "clean: a row is MISMATCH"

step_row="step on the GPU (device regions)"
child_row="region exported by a child process"
PACKD_GPU_CHECK_PLANT="$step_row:byte,$child_row:raise" run planted --quick
[ "$code" -eq 1 ] || fail "planted: exit $code, not 1"
grep -qE "^${step_row//[()]/.} +MISMATCH" "$sum" || fail "planted: the step's row is not MISMATCH"
grep -qE "^$child_row +MISMATCH +-.*planted failure" "$sum" ||
  fail "planted: the child region's row is not MISMATCH with its exception"
grep -q "gpu client checks: 2 failed" "$sum" || fail "planted: not exactly 2 failed"
grep -q "^server exit after SIGTERM *ok" "$sum" || fail "planted: the server's exit row"
# Every other row ran and passed: the clean run's ok rows but the two planted ones (the part
# row turns MISMATCH too, counted apart).
[ "$(rows MISMATCH)" -eq 3 ] || fail "planted: $(rows MISMATCH) MISMATCH rows, not 3"
[ "$(rows ok)" -eq $((clean_rows - 3)) ] ||
  fail "planted: $(rows ok) ok rows, not the clean run's $clean_rows less 3"

PACKD_GPU_CHECK_PLANT="preflight:refuse" run refused --quick
[ "$code" -eq 3 ] || fail "refused: exit $code, not 3"
grep -qE '^preflight: CUDA IPC +REFUSED +this machine refuses CUDA IPC' "$sum" ||
  fail "refused: no REFUSED preflight row"
grep -qE '^packd \+ Python client +skipped +this machine refuses CUDA IPC' "$sum" ||
  fail "refused: part 2 was not left out"

[ "$failed" -eq 0 ] && echo "rehearsal: the three runs ended as they should"
exit "$failed"
