#!/usr/bin/env python3
"""Charts of packd's benchmarks (PNG, matplotlib), as docs/performance.md shows them.

    build/bin/bench_pack --json=pack.json
    build/bin/bench_plan --json=plan.json
    build/bin/bench_service --json=service.json
    /usr/bin/python3 benchmarks/plot.py --pack=pack.json --plan=plan.json \\
        --service=service.json --out=docs/plots

Writes pack_throughput.png (pack GB/s by mask density: the memcpy limit, packd end to end and
torch's x[mask], for the hidden states and the token ids), plan_imbalance.png (cost imbalance of
packd's plan against verl's and slime's planners, per workload) and service_latency.png (a
large call's median latency by path, over a unix socket and TCP). Each input is optional; a
chart is written for each one given. `make plots` runs the benchmarks and this."""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PACK_IMPLS = [("memcpy (limit)", "memcpy (the limit)"), ("packd end to end", "packd"),
              ("torch x[mask]", "torch x[mask]")]


def plot_pack(rows, path):
    """GB/s by density, one panel per (payload, mask kind)."""
    panels = []
    for dtype, payload in (("bfloat16", "hidden states"), ("int64", "token ids")):
        for mask in ("prefix", "holes"):
            mine = [r for r in rows if r["op"] == "pack" and r["dtype"] == dtype and
                    r["mask"] == mask]
            if mine:
                panels.append((f"{payload}, {mask} mask", mine))
    if not panels:
        raise SystemExit("plot: no pack rows in the bench_pack JSON")
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (title, mine) in zip(axes[0], panels):
        for impl, label in PACK_IMPLS:
            points = sorted((r["density"], r["gbps"]) for r in mine if r["impl"] == impl)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("mask density")
        ax.set_ylabel("GB/s (packed bytes)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Pack throughput against the memcpy limit (bench_pack)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish_bars(fig, ax, title, path):
    """A horizontal bar chart's title, legend and grid, written to path."""
    ax.set_title(title, fontsize=11)
    ax.legend(fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_plan(rows, path):
    """Each row's cost imbalance - 1 for packd and its peers (bench_plan --json)."""
    if not rows:
        raise SystemExit("plot: no rows in the bench_plan JSON")
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.6))
    height = 0.27
    for i, name in enumerate(("packd", "verl", "slime")):
        ax.barh([y + (i - 1) * height for y in range(len(rows))],
                [r[name]["cost_imbalance"] - 1 for r in rows], height, label=name)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['workload']} ({r['cost']})" for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlabel("cost imbalance - 1 (max rank cost / mean - 1; lower is better)")
    finish_bars(fig, ax, "Micro-batch plans: cost imbalance against verl and slime "
                "(bench_plan)", path)


def plot_service(rows, path):
    if not rows:
        raise SystemExit("plot: no rows in the bench_service JSON")
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    height = 0.38
    ys = range(len(rows))
    ax.barh([y - height / 2 for y in ys], [r["unix_median_ms"] for r in rows], height,
            label="unix socket")
    ax.barh([y + height / 2 for y in ys], [r["tcp_median_ms"] for r in rows], height,
            label="TCP loopback")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([r["path"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("median ms")
    r = rows[0]
    finish_bars(fig, ax, f"A [{r['B']}, {r['S']}, {r['hidden']}] call by path (bench_service)",
                path)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pack", help="bench_pack --json output")
    parser.add_argument("--plan", help="bench_plan --json output")
    parser.add_argument("--service", help="bench_service --json output")
    parser.add_argument("--out", required=True, help="folder for the PNG files")
    args = parser.parse_args(argv)
    if not (args.pack or args.plan or args.service):
        parser.error("give at least one of --pack, --plan, --service")
    os.makedirs(args.out, exist_ok=True)
    written = []
    if args.pack:
        with open(args.pack) as f:
            plot_pack(json.load(f), os.path.join(args.out, "pack_throughput.png"))
        written.append("pack_throughput.png")
    if args.plan:
        with open(args.plan) as f:
            plot_plan(json.load(f), os.path.join(args.out, "plan_imbalance.png"))
        written.append("plan_imbalance.png")
    if args.service:
        with open(args.service) as f:
            plot_service(json.load(f), os.path.join(args.out, "service_latency.png"))
        written.append("service_latency.png")
    print("plot: wrote " + ", ".join(os.path.join(args.out, w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
