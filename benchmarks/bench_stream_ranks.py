"""Many ranks receiving one streaming step at once (docs/performance.md, "The streaming step"):
each rank's receive throughput, and the latency of the calls beside them (a SubmitGroup, which
takes the step's lock, and a small Pack, which does not), for one packd binary or two
(--packd-before: another build, measured in the same run, alternated, printed as ratios).

A step of --ranks ranks is opened and --groups groups of --rows rows (lengths uniform in
1/4..1 of --seq, float32 inputs of --hidden features) are submitted before any rank reads:
a backlog of planned micro-batches. Then every rank's receiving stream starts at once, each in
a process of its own (so that the receivers' decoding does not share one interpreter), while
a prober in this process submits a one-row group and sends a small Pack, in turn, every 5 ms.
A rank's throughput is its packed bytes over the time its stream took to bring them; once every
rank has its share of the backlog the step is closed.

    bench_stream_ranks.py --packd build/bin/packd
    bench_stream_ranks.py --packd build/bin/packd --packd-before /tmp/before/bin/packd
    bench_stream_ranks.py --smoke --packd build/bin/packd   # tiny, in make test
"""
import argparse
import multiprocessing
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_step import server  # noqa: E402

import packd  # noqa: E402


def groups_of(args):
    generator = torch.Generator().manual_seed(0)
    groups = []
    for _ in range(args.groups):
        lengths = torch.randint(args.seq // 4, args.seq + 1, (args.rows,), generator=generator)
        mask = torch.arange(args.seq)[None, :] < lengths[:, None]
        x = torch.randn(args.rows, args.seq, args.hidden, generator=generator)
        groups.append((x, mask))
    return groups


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def receive(address, step_id, rank, start, micro_batches, drained, out):
    """A rank's receiving stream, in its own process: waits for `start`, then reads, counting
    itself in `drained` once it has its first `micro_batches` micro-batches (the backlog); puts
    (rank, their bytes, the seconds they took) when the stream ends."""
    torch.set_num_threads(1)
    with packd.Client(address, timeout=600) as client:
        stream = client.receive_step(step_id, rank)
        start.wait()
        began, taken, backlog, seconds = time.perf_counter(), 0, 0, 0.0
        for mb in stream:
            taken += 1
            size = sum(t.numel() * t.element_size() for t in mb.result.packed)
            if taken <= micro_batches:
                backlog += size
                seconds = time.perf_counter() - began
                if taken == micro_batches:
                    with drained.get_lock():
                        drained.value += 1
        out.put((rank, backlog, seconds))


def one_run(binary, args, groups):
    """(each rank's MB/s, Pack latencies in ms, SubmitGroup latencies in ms)."""
    context = multiprocessing.get_context("spawn")
    with server(None, binary, "bench-stream-ranks") as address, \
            packd.Client(address, timeout=600) as client:
        budget = args.rows * args.seq * 2
        controller = client.open_step(budget, plan=packd.PlanOptions(num_ranks=args.ranks),
                                      reserve=0.0)
        waves = 0
        for x, mask in groups:  # the backlog: planned, not yet packed
            waves = client.submit_group(controller.step_id, x, mask).waves
        if waves == 0:
            raise SystemExit("bench_stream_ranks: the groups fill no wave of %d ranks: give "
                             "more --groups or fewer --ranks" % args.ranks)
        start, out, drained = context.Event(), context.Queue(), context.Value("i", 0)
        receivers = [context.Process(target=receive, args=(
            address, controller.step_id, r, start, waves, drained, out))
            for r in range(args.ranks)]
        for p in receivers:
            p.start()
        time.sleep(1.0 if not args.smoke else 0.5)  # every stream attached
        start.set()
        packs, submits = [], []
        x, mask = torch.randn(4, 64, 8), torch.ones(4, 64, dtype=torch.bool)
        tiny_x, tiny_mask = torch.randn(1, 8, args.hidden), torch.ones(1, 8, dtype=torch.bool)
        results = []
        deadline = time.perf_counter() + 600
        while drained.value < args.ranks and time.perf_counter() < deadline:
            t0 = time.perf_counter()
            client.submit_group(controller.step_id, tiny_x, tiny_mask)
            submits.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            client.pack(x, mask)
            packs.append((time.perf_counter() - t0) * 1e3)
            time.sleep(0.005)
            if any(p.exitcode is not None for p in receivers):
                break  # a receiver ended early: reported below
        controller.close()
        for _ in receivers:
            results.append(out.get(timeout=120))
        for p in receivers:
            p.join(timeout=120)
        if any(p.exitcode != 0 for p in receivers):
            raise RuntimeError("a receiver failed")
        rates = [backlog / 1e6 / seconds for _, backlog, seconds in sorted(results)]
        return rates, packs, submits


def summary(runs):
    rates = [statistics.median(r) for r, _, _ in runs]
    packs = [p for _, ps, _ in runs for p in ps]
    submits = [s for _, _, ss in runs for s in ss]
    return {"receive MB/s a rank (median)": statistics.median(rates),
            "Pack p50 ms": percentile(packs, 0.5), "Pack p95 ms": percentile(packs, 0.95),
            "SubmitGroup p50 ms": percentile(submits, 0.5),
            "SubmitGroup p95 ms": percentile(submits, 0.95)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--packd", required=True, help="the packd binary to measure")
    parser.add_argument("--packd-before", help="another build, measured in the same run")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--groups", type=int, default=96)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.ranks, args.groups, args.seq, args.hidden, args.repeats = 2, 16, 64, 8, 1
    torch.set_num_threads(1)
    groups = groups_of(args)
    binaries = {"after": args.packd}
    if args.packd_before:
        binaries = {"before": args.packd_before, "after": args.packd}
    runs = {name: [] for name in binaries}
    for _ in range(args.repeats):
        for name, binary in binaries.items():  # alternated
            runs[name].append(one_run(binary, args, groups))
    results = {name: summary(r) for name, r in runs.items()}
    print("bench_stream_ranks: %d ranks receiving at once, a backlog of %d groups of %d rows "
          "[S=%d, %d float32], %d repeats" % (args.ranks, args.groups, args.rows, args.seq,
                                              args.hidden, args.repeats))
    names = list(results)
    print("| figure | " + " | ".join(names) + (" | after / before |" if len(names) > 1 else " |"))
    print("| --- |" + " ---: |" * (len(names) + (len(names) > 1)))
    for key in results[names[-1]]:
        values = [results[n][key] for n in names]
        ratio = " | %.2f" % (values[-1] / values[0]) if len(names) > 1 else ""
        print("| %s | %s%s |" % (key, " | ".join("%.2f" % v for v in values), ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main())
