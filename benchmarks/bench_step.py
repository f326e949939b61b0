"""A training step's preparation, three ways, timed in one run (docs/performance.md):

  packd     one PackMicroBatches call: the batch uploaded once, planned and packed by the
            server, the micro-batches streamed back;
  (a)       PlanMicroBatches, then one Pack per micro-batch of its rows (index_select here);
  (b)       in process, verl's own step where verl is installed (the PyPI stack): ranks
            balanced by get_seqlen_balanced_partitions over its workload (its trainer's
            _balance_batch), each rank's micro-batches by rearrange_micro_batches on a TensorDict,
            then a boolean pack per micro-batch and labels rolled over its stream (verl's
            FSDP engine), on the venv's torch with its default threads, as users run it;
            without verl, a transcription of the same step (Karmarkar-Karp in Python).

The batch is a rollout's: token ids (int64), log-probs and advantages (float32), [B, S], each
row a prompt and response of a lognormal length, right-padded; labels are the token ids
shifted within each row (-100 at its end); planning is by cost (24576 * P + P^2) over the
ranks. packd and (a) run with the batch in shared memory (handles, over the unix socket a
trainer on the node dials) and inline over loopback TCP. Every micro-batch of every way is checked against torch's.

    bench_step.py --packd build/bin/packd            # starts its own server
    bench_step.py --address 127.0.0.1:50051 --batch 512,4096 --ranks 8 --repeats 5
"""
import argparse
import contextlib
import heapq
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import packd

try:  # verl's own functions (the PyPI stack, deploy/pypi-constraints.txt)
    import verl
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import (calculate_workload, get_seqlen_balanced_partitions,
                                             rearrange_micro_batches)
except ImportError:
    verl = None

COST = (24576.0, 1.0)


def rollout(B, S, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(B, generator=g) * 1.0 + 6.8).clamp(16, S).long()
    mask = torch.arange(S)[None, :] < lengths[:, None]
    tokens = torch.randint(0, 151936, (B, S), generator=g)
    logprobs = -torch.rand(B, S, generator=g) * 5
    advantages = torch.randn(B, S, generator=g)
    return tokens, logprobs, advantages, mask


def karmarkar_karp(costs, k):
    """verl's balanced partitioning (the largest differencing method): k sets of indices. A
    transcription, for stacks without verl (verl/utils/seqlen_balancing.py)."""
    heap = []
    for i, c in enumerate(costs):
        sets = [[] for _ in range(k)]
        sums = [0.0] * k
        sets[0].append(i)
        sums[0] = c
        heapq.heappush(heap, (-(max(sums) - min(sums)), i, sums, sets))
    while len(heap) > 1:
        _, i, sa, a = heapq.heappop(heap)
        _, _, sb, b = heapq.heappop(heap)
        oa = sorted(range(k), key=lambda j: sa[j])
        ob = sorted(range(k), key=lambda j: -sb[j])
        sums = [sa[oa[j]] + sb[ob[j]] for j in range(k)]
        sets = [a[oa[j]] + b[ob[j]] for j in range(k)]
        heapq.heappush(heap, (-(max(sums) - min(sums)), i, sums, sets))
    return [sorted(s) for s in heap[0][3]] if heap else [[] for _ in range(k)]


def labels_of(tokens, mask):
    labels = torch.roll(tokens, -1, dims=1)
    last = mask.sum(1) - 1
    rows = torch.arange(tokens.shape[0])
    labels[rows[last >= 0], last[last >= 0]] = -100
    return labels


def verl_step(batch, ranks, max_tokens):
    """(b) with verl's own functions. batch: (TensorDict of the [B, S] tensors, mask). Returns
    the micro-batches: (rows, packed tensors, labels rolled over the micro-batch's stream)."""
    td, mask = batch
    lengths = mask.sum(1)
    out = []
    for part in get_seqlen_balanced_partitions(calculate_workload(lengths).tolist(),
                                               k_partitions=ranks, equal_size=True):
        rank_rows = torch.tensor(part, dtype=torch.long)
        micro_batches, indices = rearrange_micro_batches(td[rank_rows], max_token_len=max_tokens)
        for mb, idx in zip(micro_batches, indices):
            m = mb["attention_mask"].bool()
            packed = [mb["input_ids"][m], mb["old_log_probs"][m], mb["advantages"][m]]
            labels = torch.roll(packed[0].view(1, -1), shifts=-1, dims=1).view(-1)
            out.append((rank_rows[torch.tensor(idx, dtype=torch.long)], packed, labels))
    return out


def as_tensordict(batch):
    tokens, logprobs, advantages, mask = batch
    return TensorDict({"input_ids": tokens, "attention_mask": mask.long(),
                       "old_log_probs": logprobs, "advantages": advantages},
                      batch_size=[mask.shape[0]]), mask


def in_process(batch, ranks, max_tokens):
    """(b) transcribed: verl's step in torch. Returns the micro-batches: (rows, packed tensors,
    labels)."""
    tokens, logprobs, advantages, mask = batch
    lengths = mask.sum(1).tolist()
    cost = [COST[0] * n + COST[1] * n * n for n in lengths]
    out = []
    for rank_rows in karmarkar_karp(cost, ranks):
        total = sum(lengths[i] for i in rank_rows)
        n = max(1, -(-total // max_tokens))
        for part in karmarkar_karp([lengths[i] for i in rank_rows], n):
            rows = torch.tensor([rank_rows[j] for j in part], dtype=torch.long)
            m = mask.index_select(0, rows)
            t = tokens.index_select(0, rows)
            packed = [t[m], logprobs.index_select(0, rows)[m],
                      advantages.index_select(0, rows)[m]]
            out.append((rows, packed, labels_of(t, m)[m]))
    return out


def through_pack(client, batch, ranks, max_tokens):
    """(a): a plan, then one Pack of each micro-batch's rows."""
    tokens, logprobs, advantages, mask = batch
    plan = client.plan_micro_batches(mask.sum(1).tolist(), max_tokens,
                                     plan=packd.PlanOptions(num_ranks=ranks, cost=COST))
    out = []
    for mb in plan.micro_batches:
        rows = torch.tensor(list(mb.samples), dtype=torch.long)
        r = client.pack([t.index_select(0, rows) for t in (tokens, logprobs, advantages)],
                        mask.index_select(0, rows), layout=packd.Layout(shifts=[(0, -100)]))
        out.append((rows, r.packed, r.shifted[0]))
    return out


def step(client, batch, ranks, max_tokens, first):
    """packd's PackMicroBatches; first[0] gets the seconds to the first micro-batch."""
    tokens, logprobs, advantages, mask = batch
    t0 = time.perf_counter()
    s = client.pack_micro_batches([tokens, logprobs, advantages], mask, max_tokens,
                                  plan=packd.PlanOptions(num_ranks=ranks, cost=COST),
                                  layout=packd.Layout(shifts=[(0, -100)]))
    out = []
    for mb in s:
        if not out:
            first[0] = time.perf_counter() - t0
        out.append((torch.tensor(mb.samples, dtype=torch.long), mb.result.packed,
                    mb.result.shifted[0]))
    return out


def check(name, batch, micro_batches, rolled=False):
    """Every micro-batch against torch's. rolled: labels rolled over the micro-batch's stream
    (verl's), so each row's last label is the next row's first token (the stream's first at its
    end) where torch's shift within the row has -100 (docs/design.md §10)."""
    tokens, logprobs, advantages, mask = batch
    seen = []
    for rows, packed, labels in micro_batches:
        m = mask.index_select(0, rows)
        for x, p in zip((tokens, logprobs, advantages), packed):
            if not torch.equal(x.index_select(0, rows)[m], p):
                raise SystemExit("bench_step: %s packed other values" % name)
        want = labels_of(tokens.index_select(0, rows), m)[m]
        if rolled:
            ends = m.sum(1).cumsum(0) - 1
            ends = ends[m.sum(1) > 0]
            stream = packed[0]
            want[ends] = stream[(ends + 1) % max(1, stream.numel())]
        if not torch.equal(want, labels):
            raise SystemExit("bench_step: %s shifted other labels" % name)
        seen += rows.tolist()
    if sorted(seen) != list(range(mask.shape[0])):
        raise SystemExit("bench_step: %s lost or repeated rows" % name)


def timed(fn, repeats):
    fn()  # warm: buffers, connections, segments
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def start_server(binary, address):
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([binary, "--listen=" + address], stdout=log, stderr=log)
    log.close()  # the child holds its own descriptor
    for _ in range(200):
        try:
            with packd.Client(address, timeout=1, retries=0) as c:
                c.info()
            return proc
        except packd.PackdError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("bench_step: packd did not start on %s" % address)


def add_server_arguments(parser, address_help="a running server",
                         packd_help="start this packd binary instead"):
    """--address and --packd, which server() reads."""
    parser.add_argument("--address", help=address_help)
    parser.add_argument("--packd", help=packd_help)


@contextlib.contextmanager
def server(address, binary, name):
    """`address` (a running packd), or else a packd started from `binary` on a unix socket for
    the block and ended after it."""
    if address:
        yield address
        return
    if not binary:
        raise SystemExit("%s: give --address or --packd" % name)
    address = "unix:/tmp/packd-%s-%d.sock" % (name, os.getpid())
    proc = start_server(binary, address)
    try:
        yield address
    finally:
        proc.kill()
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_arguments(
        parser, "a running server (node-local for handles)",
        "start this packd binary instead: on a unix socket for handles (a trainer on the node), "
        "on loopback TCP for inline")
    parser.add_argument("--batch", default="512,4096")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--max_tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a small batch, one repeat")
    parser.add_argument("--json", help="also write one JSON object a line per transport")
    args = parser.parse_args()
    B, S = (int(v) for v in args.batch.split(","))
    if args.smoke:
        B, S, args.repeats, args.max_tokens = 32, 512, 1, 4096
    procs = []
    directory = tempfile.TemporaryDirectory(prefix="bench-step-")
    if args.address:
        addresses = {"handles": args.address, "inline": args.address}
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        addresses = {"handles": "unix:%s/packd.sock" % directory.name,
                     "inline": "127.0.0.1:%d" % port}
        binary = args.packd or os.environ.get("PACKD_BINARY", "packd")
        procs = [start_server(binary, a) for a in addresses.values()]
    try:
        batch = rollout(B, S, seed=1)
        nbytes = sum(t.numel() * t.element_size() for t in batch)
        print("batch %d x %d: %d tokens, %.1f MiB; %d ranks, budget %d, cost %g*P + %g*P^2"
              % (B, S, int(batch[3].sum()), nbytes / 2**20, args.ranks, args.max_tokens,
                 *COST))
        rows = []
        # Through handles: the batch uploaded, and from the second step on the results
        # written, in shared memory; the same with results inline; everything inline.
        for transport, threshold, arena in (("handles", 1, True),
                                            ("handles, results inline", 1, False),
                                            ("inline", 0, False)):
            with packd.Client(
                    addresses[transport.split(",")[0]],
                    connection=packd.ConnectionOptions(split_threshold_bytes=0),
                    shared_memory=packd.SharedMemoryOptions(threshold_bytes=threshold,
                                                            step_results=arena)) as client:
                first = [0.0]
                check("packd", batch, step(client, batch, args.ranks, args.max_tokens, first))
                check("(a)", batch, through_pack(client, batch, args.ranks, args.max_tokens))
                firsts = []

                def packd_step():
                    step(client, batch, args.ranks, args.max_tokens, first)
                    firsts.append(first[0] * 1e3)

                ours = timed(packd_step, args.repeats)
                a = timed(lambda: through_pack(client, batch, args.ranks, args.max_tokens),
                          args.repeats)
                rows.append((transport, ours, statistics.median(firsts), a))
        if verl is not None:
            td = as_tensordict(batch)
            check("(b)", batch, verl_step(td, args.ranks, args.max_tokens), rolled=True)
            b = timed(lambda: verl_step(td, args.ranks, args.max_tokens), args.repeats)
            b_name = "verl %s's own functions" % verl.__version__
        else:
            check("(b)", batch, in_process(batch, args.ranks, args.max_tokens))
            b = timed(lambda: in_process(batch, args.ranks, args.max_tokens), args.repeats)
            b_name = "a transcription of verl's step (verl not installed)"
        print("(b): %s on torch %s, %d threads" % (b_name, torch.__version__,
                                                   torch.get_num_threads()))
        print("%-24s %10s %14s %10s %10s %10s %10s" % ("", "packd ms", "first mb ms",
                                                       "(a) ms", "(b) ms", "(a)/packd",
                                                       "(b)/packd"))
        for transport, ours, first_ms, a in rows:
            print("%-24s %10.1f %7.1f (%3.0f%%) %10.1f %10.1f %9.2fx %9.2fx"
                  % (transport, ours, first_ms, 100 * first_ms / ours, a, b, a / ours,
                     b / ours))
        if args.json:
            with open(args.json, "w") as f:
                for transport, ours, first_ms, a in rows:
                    f.write(json.dumps({"transport": transport, "packd_ms": ours,
                                        "plan_and_pack_ms": a, "verl_torch_ms": b,
                                        "verl": b_name, "torch": torch.__version__,
                                        "torch_threads": torch.get_num_threads(),
                                        "first_ms": first_ms}) + "\n")
        handles = rows[0]
        met = handles[3] / handles[1] >= 2 and b / handles[1] >= 1.5 and (
            handles[2] / handles[1] < 0.15)
        print("targets through handles (>= 2x (a), >= 1.5x (b), first < 15%%): %s"
              % ("met" if met else "missed"))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
        directory.cleanup()


if __name__ == "__main__":
    sys.exit(main())
