#!/usr/bin/env bash
# Runs the benchmarks and draws their charts (benchmarks/plot.py): `make plots` writes
# docs/plots/*.png; the plots_smoke test runs it with --smoke into a scratch folder.
#
#   benchmarks/plots.sh BIN_DIR OUT_DIR [--smoke]
set -euo pipefail
bin=$1 out=$2 smoke=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$bin/bench_pack" $smoke --json="$work/pack.json" > "$work/pack.txt"
"$bin/bench_plan" $smoke --json="$work/plan.json" > "$work/plan.txt"
"$bin/bench_service" $smoke --json="$work/service.json" > "$work/service.txt"
/usr/bin/python3 "$(dirname "$0")/plot.py" --pack="$work/pack.json" --plan="$work/plan.json" \
  --service="$work/service.json" --out="$out"
for chart in pack_throughput plan_imbalance service_latency; do
  [[ -s "$out/$chart.png" ]] || { echo "plots: $out/$chart.png was not written" >&2; exit 1; }
done
