"""The model's forward and backward on a GRPO batch, with its prompts shared and not, timed in
one run (docs/performance.md, "Shared prompts"):

  shared    the stream (packd's shared prefix: each group's prompt once, then its responses),
            one varlen attention over kv_index, the loss on logits gathered at pred_index;
  unshared  the same rows packed as they are (every prompt G times), attention within each row.

The model is examples/train_grpo_shared.py's (the tiny transformer of train_packed.py, rotary
positions, per-segment attention in plain torch), the loss its clipped token-level policy
gradient over the same targets, so the two losses are equal (checked). Packing is not timed
(bench_pack measures it); the batch is packed once, then forward + backward runs --repeats
times each way, alternating, and the medians are reported.

    bench_grpo.py --packd build/bin/packd                    # 8 groups x 8, prompt 1024
    bench_grpo.py --address 127.0.0.1:50051 --groups 16 --members 8 --prompt 1024 --json out
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from bench_step import add_server_arguments, server  # noqa: E402
from train_grpo_shared import (VOCAB, Rollout, TinyLM, pg_token_loss,  # noqa: E402
                               shared_logits, shared_prefix_of)

import packd  # noqa: E402


def rollout(groups, members, prompt, responses, seed=0):
    """groups prompts of `prompt` tokens, each with `members` responses of responses[0] ..
    responses[1] tokens; rows in group order, right-padded."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    S = prompt + responses[1]
    B = groups * members
    tokens = torch.randint(0, VOCAB, (B, S), generator=g)
    lengths = torch.tensor([prompt + rng.randint(*responses) for _ in range(B)])
    for b in range(B):
        tokens[b, :prompt] = tokens[b - b % members, :prompt]
    s = torch.arange(S)[None, :]
    mask = s < lengths[:, None]
    advantages = torch.randn(B, 1, generator=g).expand(B, S).contiguous()
    return Rollout(tokens=tokens, mask=mask, groups=[b // members for b in range(B)],
                   prompts=[prompt] * B, loss_mask=mask & (s >= prompt),
                   old_logprobs=-torch.rand(B, S, generator=g) - 4.0, advantages=advantages)


def inputs_of(batch, dtype):
    return [batch.tokens, batch.old_logprobs.to(dtype), batch.advantages.to(dtype),
            batch.loss_mask.to(dtype)]


def shared_step(model, r):
    """Forward and backward on the stream; returns the loss."""
    logits = shared_logits(model, model.embed(r.packed[0]), r.position_ids, r.shared)
    labels, old, advantages, weights = r.shifted
    loss = (pg_token_loss(logits[r.shared.pred_index], labels, old, advantages)
            * weights).sum() / weights.sum()
    loss.backward()
    return loss.item()


def unshared_step(model, r):
    """Forward and backward on the rows as they are: the logits at j predict the token at
    j + 1 (the shifts), weighted by its loss mask."""
    logits = model.packed(model.embed(r.packed[0]), r.position_ids, r.cu_seqlens)
    labels, old, advantages, weights = r.shifted
    loss = (pg_token_loss(logits, labels.clamp(min=0), old, advantages)
            * weights).sum() / weights.sum()
    loss.backward()
    return loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_arguments(parser)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--responses", default="128,1024", help="MIN,MAX response tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", help="also write the row as JSON to this file")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny batch in float64, the losses checked to 1e-9")
    args = parser.parse_args()
    responses = tuple(int(v) for v in args.responses.split(","))
    dtype = torch.float32
    if args.smoke:
        args.groups, args.members, args.prompt, responses = 3, 4, 24, (4, 16)
        args.repeats, dtype = 1, torch.float64
    torch.set_num_threads(args.threads)
    torch.set_default_dtype(dtype)
    with server(args.address, args.packd, "bench-grpo") as address:
        with packd.Client(address) as client:
            batch = rollout(args.groups, args.members, args.prompt, responses)
            shifts = [(0, -100), (1, 0), (2, 0), (3, 0)]
            shared = client.pack(
                inputs_of(batch, dtype), batch.mask, with_position_ids=True,
                layout=packd.Layout(shared_prefix=shared_prefix_of(batch), shifts=shifts))
            plain = client.pack(inputs_of(batch, dtype), batch.mask, with_position_ids=True,
                                layout=packd.Layout(shifts=shifts))
    model = TinyLM().to(dtype)
    times = {"shared": [], "unshared": []}
    losses = {}
    for _ in range(args.repeats + 1):  # the first run of each warms up
        for name, step, r in (("shared", shared_step, shared),
                              ("unshared", unshared_step, plain)):
            model.zero_grad()
            start = time.perf_counter()
            losses[name] = step(model, r)
            times[name].append(time.perf_counter() - start)
    ms = {k: 1e3 * statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
    difference = abs(losses["shared"] - losses["unshared"]) / abs(losses["unshared"])
    tolerance = 1e-9 if dtype == torch.float64 else 1e-4
    row = {"groups": args.groups, "members": args.members, "prompt": args.prompt,
           "responses": list(responses), "dtype": str(dtype).replace("torch.", ""),
           "threads": args.threads, "tokens_shared": shared.total_active,
           "tokens_unshared": plain.total_active, "shared_ms": round(ms["shared"], 2),
           "unshared_ms": round(ms["unshared"], 2),
           "speedup": round(ms["unshared"] / ms["shared"], 3),
           "loss_relative_difference": difference}
    print("bench_grpo: %d groups x %d, prompt %d, responses %d..%d, %s, %d threads"
          % (args.groups, args.members, args.prompt, responses[0], responses[1],
             row["dtype"], args.threads))
    print("  tokens   %8d shared  %8d unshared  (%.2fx fewer)"
          % (shared.total_active, plain.total_active,
             plain.total_active / max(shared.total_active, 1)))
    print("  fwd+bwd  %8.1f ms     %8.1f ms        (%.2fx faster, median of %d)"
          % (ms["shared"], ms["unshared"], row["speedup"], args.repeats))
    print("  losses equal to %.1e relative" % difference)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(row) + "\n")
    if difference > tolerance:
        print("bench_grpo: the shared loss differs from the unshared one", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
