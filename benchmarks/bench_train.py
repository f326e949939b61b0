"""A transformers model's training step on an RL rollout, three ways, timed in one run
(docs/performance.md, "Training a transformers model"):

  padded     the rows padded to the longest ([B, S]), an attention mask, SDPA;
  flattened  transformers' own DataCollatorWithFlattening (one row, position ids), SDPA;
  packd      packd's step (PackMicroBatches: one row per micro-batch, position ids, next-token
             labels, the loss over the plan's global_loss_tokens), attn_implementation=
             "packd_varlen";
  packd shared  the same with each GRPO group's prompt once (shared_prefix, DESIGN §14).

The model is a Qwen 3 from its config (about 5 M parameters, float32, random weights); the batch a
GRPO rollout: --groups prompts of --prompt tokens, each with --members responses whose lengths are
lognormal within --responses. Every way starts from the same weights and runs --steps AdamW steps
on the same batch; the whole step is timed (collating or packd's call, forward, backward, the
optimizer), the first step is a warm-up, the rest give the median. The first step's loss and
gradients are compared with the padded way's: equal up to float32's summation order, and to
1e-9 relative in float64 (--smoke).

    bench_train.py --packd build/bin/packd          # the table in docs/performance.md
    bench_train.py --smoke --packd build/bin/packd  # tiny, float64: losses and gradients to 1e-9
    bench_train.py --family qwen3_5 --packd ...     # the hybrid: Qwen 3.5 of the same sizes

With --family qwen3_5 the model's layers alternate gated delta nets and full attention; packd
runs each document of a packed row through the gated delta nets from a zero state
(packd.hf.bound_states). transformers' flattened row leaks their state across documents: its
row is shown with its difference, which must not be 0; shared prompts are not run (a stateful
layer cannot share a prompt's state yet).
"""
import argparse
import contextlib
import copy
import json
import math
import os
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_step import add_server_arguments, server  # noqa: E402

import packd  # noqa: E402
from packd.hf import (bound_states, register_varlen_attention,  # noqa: E402
                      shared_attention_kwargs)


def keep_float64():
    """Qwen 3's RMSNorm computes in float32 whatever its input: in float64 that rounds a shared
    prompt's gradient (summed over its members before the norm in the stream, after it in the
    padded batch) by about 1e-7. For --smoke's float64 comparison the norms and the softmax stay
    in float64, as in the model families' tests (examples/float64_check.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    from float64_check import keep_float64 as keep

    class Patch:
        setattr = staticmethod(setattr)

    keep(Patch(), ["qwen3"])


def model_of(vocab, hidden, layers, dtype, family="qwen3"):
    """bench-train's Qwen 3; with family="qwen3_5", a Qwen 3.5 of the same sizes whose layers
    alternate gated delta nets (linear attention, with their short convolutions) and full
    attention."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    heads = max(hidden // 64, 2)
    sizes = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                 num_hidden_layers=layers, num_attention_heads=heads,
                 num_key_value_heads=heads // 2, head_dim=hidden // heads,
                 max_position_embeddings=8192, tie_word_embeddings=False)
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        config = Qwen3_5TextConfig(
            **sizes, layer_types=["linear_attention", "full_attention"] * (layers // 2),
            linear_num_key_heads=heads, linear_num_value_heads=heads,
            linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads)
    else:
        config = Qwen3Config(**sizes)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)


class Rollout:
    """B = groups * members rows, right-padded: tokens and mask [B, S]; each row its group's
    prompt then its response; `predicts` [B, S]: the positions whose next token is a response
    token (where the loss counts)."""

    def __init__(self, seed, vocab, groups, members, prompt, responses):
        rng = random.Random(seed)
        lo, hi = responses
        rows, self.groups, self.prompts = [], [], []
        for g in range(groups):
            p = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt))]
            for _ in range(members):
                # Lognormal lengths: most responses short, a few near the limit.
                n = int(min(hi, max(lo, math.exp(rng.gauss(math.log(lo * hi) / 2,
                                                            math.log(hi / lo) / 4)))))
                rows.append((p, [rng.randrange(1, vocab) for _ in range(n)]))
                self.groups.append(g)
                self.prompts.append(len(p))
        self.B, self.S = len(rows), max(len(p) + len(r) for p, r in rows)
        self.tokens = torch.zeros(self.B, self.S, dtype=torch.long)
        self.mask = torch.zeros(self.B, self.S, dtype=torch.bool)
        self.predicts = torch.zeros(self.B, self.S, dtype=torch.bool)
        self.features = []
        for b, (p, r) in enumerate(rows):
            n = len(p) + len(r)
            self.tokens[b, :n] = torch.tensor(p + r)
            self.mask[b, :n] = True
            self.predicts[b, len(p) - 1:n - 1] = True
            self.features.append({"input_ids": p + r, "labels": [-100] * len(p) + r})
        self.targets = int(self.predicts.sum())
        self.active = int(self.mask.sum())


def padded_loss(model, client, batch):
    logits = model(input_ids=batch.tokens, attention_mask=batch.mask.long(),
                   use_cache=False).logits
    token_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch.tokens[:, 1:].flatten(),
                                 reduction="none")
    loss = (token_loss * batch.predicts[:, :-1].flatten().to(logits.dtype)).sum() / batch.targets
    loss.backward()
    return loss.item()


def flattened_loss(model, client, batch):
    from transformers import DataCollatorWithFlattening
    flat = DataCollatorWithFlattening(return_position_ids=True)(batch.features)
    # use_cache=False: with a cache, transformers 5 does not find the flattened row's sequences
    # from the position ids on SDPA, and every sequence would attend to those before it.
    logits = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"],
                   use_cache=False).logits[0]
    loss = F.cross_entropy(logits[:-1], flat["labels"][0, 1:], ignore_index=-100,
                           reduction="sum") / batch.targets
    loss.backward()
    return loss.item()


def packd_loss(model, client, batch, shared=False, max_tokens=1 << 20):
    if shared:
        step = client.pack_micro_batches([batch.tokens], batch.mask, max_tokens,
                                         with_position_ids=True, layout=packd.Layout(
                                             shifts=[(0, -100)], shared_prefix=packd.SharedPrefix(
                                                 batch.groups, batch.prompts, (0, ))))
    else:
        step = client.pack_micro_batches(
            [batch.tokens, batch.predicts.to(torch.int64)], batch.mask, max_tokens,
            loss_mask=batch.predicts, with_position_ids=True,
            layout=packd.Layout(shifts=[(0, -100)]))
    assert step.plan.global_loss_tokens == batch.targets
    total = 0.0
    for mb in step:
        r = mb.result
        if shared:  # the stream: each prompt once, one row of logits per target
            logits = model(input_ids=r.packed[0][None], position_ids=r.position_ids[None],
                           use_cache=False, **shared_attention_kwargs(r)).logits[0]
            token_loss = F.cross_entropy(logits[r.shared.pred_index], r.shifted[0],
                                         ignore_index=-100, reduction="sum")
        else:
            logits = model(input_ids=r.packed[0][None], position_ids=r.position_ids[None],
                           use_cache=False).logits[0]
            token_loss = (F.cross_entropy(logits, r.shifted[0].clamp(min=0), reduction="none")
                          * r.packed[1].to(logits.dtype)).sum()
        loss = token_loss / step.plan.global_loss_tokens
        loss.backward()
        total += loss.item()
    return total


WAYS = {
    "padded": ("sdpa", padded_loss),
    "flattened": ("sdpa", flattened_loss),
    "packd": ("packd_varlen", packd_loss),
    "packd shared": ("packd_varlen", lambda m, c, b: packd_loss(m, c, b, shared=True)),
}


def run_way(name, model, client, batch, steps):
    """(the first step's loss, its gradients, every step's seconds) of `steps` AdamW steps."""
    implementation, loss_of = WAYS[name]
    model.config._attn_implementation = implementation
    if implementation == "packd_varlen":
        bound_states(model)  # a hybrid's stateful layers: every document its own state
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = grads = None
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        step_loss = loss_of(model, client, batch)
        if grads is None:
            loss, grads = step_loss, [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    return loss, grads, seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_arguments(parser)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--prompt", default="128,512", help="MIN,MAX prompt tokens")
    parser.add_argument("--responses", default="16,2048", help="MIN,MAX response tokens")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4, help="AdamW steps each way (the first "
                        "a warm-up)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", help="also write one JSON object a line per way")
    parser.add_argument("--family", choices=["qwen3", "qwen3_5"], default="qwen3",
                        help="qwen3_5: the hybrid (gated delta nets and full attention); its "
                        "flattened way leaks state across documents and is shown, not checked, "
                        "and shared prompts are refused (a stateful layer cannot share them)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model and batch in float64, every way's loss and "
                        "gradients checked to 1e-9")
    args = parser.parse_args()
    dtype = torch.float32
    prompt = tuple(int(v) for v in args.prompt.split(","))
    responses = tuple(int(v) for v in args.responses.split(","))
    if args.smoke:
        args.groups, args.members, prompt, responses = 3, 3, (4, 12), (2, 24)
        args.hidden, args.layers, args.vocab, args.steps, dtype = 64, 2, 128, 2, torch.float64
        keep_float64()
    hybrid = args.family == "qwen3_5"
    ways = [w for w in WAYS if not (hybrid and w == "packd shared")]
    torch.set_num_threads(args.threads)
    register_varlen_attention()
    batch = Rollout(0, args.vocab, args.groups, args.members, prompt, responses)
    initial = model_of(args.vocab, args.hidden, args.layers, dtype, args.family)
    parameters = sum(p.numel() for p in initial.parameters())
    rows = {}
    kept = contextlib.nullcontext()
    if hybrid and dtype == torch.float64:  # Qwen 3.5's float32 steps kept in float64
        sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
        from float64_check import Float64Steps
        kept = Float64Steps().kept()
    with server(args.address, args.packd, "bench-train") as address, kept:
        with packd.Client(address) as client:
            for name in ways:
                loss, grads, seconds = run_way(name, copy.deepcopy(initial), client, batch,
                                               args.steps)
                rows[name] = (loss, grads, statistics.median(seconds[1:] or seconds))
    print("bench_train: %s, %.1f M parameters, %s, %d threads; %d groups x %d, prompts "
          "%d..%d, responses %d..%d: %d tokens, %.0f%% of the padded [%d, %d]"
          % ("Qwen 3.5 (gated delta nets + attention)" if hybrid else "Qwen 3",
             parameters / 1e6, str(dtype).replace("torch.", ""), args.threads, args.groups,
             args.members, prompt[0], prompt[1], responses[0], responses[1], batch.active,
             100 * batch.active / (batch.B * batch.S), batch.B, batch.S))
    print("| way | step (s) | tokens/s | vs padded | loss, step 1 | vs padded's | gradients vs "
          "padded's |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    base_loss, base_grads, base_time = rows["padded"]
    tolerance = 1e-9 if dtype == torch.float64 else 1e-5
    failed = []
    out = []
    for name, (loss, grads, seconds) in rows.items():
        difference = abs(loss - base_loss) / abs(base_loss)
        # Each parameter's largest difference relative to its largest gradient.
        grad_difference = max(float((g - b).abs().max() / b.abs().max().clamp(min=1e-30))
                              for g, b in zip(grads, base_grads))
        print("| %s | %.3f | %.0f | %.2fx | %.6f | %.1e | %.1e |"
              % (name, seconds, batch.active / seconds, base_time / seconds, loss, difference,
                 grad_difference))
        out.append({"way": name, "step_s": seconds, "tokens_per_s": batch.active / seconds,
                    "speedup": base_time / seconds, "loss": loss,
                    "loss_relative_difference": difference,
                    "gradient_relative_difference": grad_difference})
        # float32 sums in each way's order: the gradients are compared in float64 (--smoke).
        wrong = difference > tolerance or (dtype == torch.float64 and grad_difference > tolerance)
        if hybrid and name == "flattened":
            # transformers' own flattened row: the gated delta nets' state runs across the
            # documents. Shown, and required to differ (the leak packd fixes).
            wrong = difference <= tolerance and grad_difference <= tolerance
        if wrong:
            failed.append(name)
    print("(median of %d steps after a warm-up; tokens/s counts the %d real tokens)"
          % (max(args.steps - 1, 1), batch.active))
    if args.json:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in out)
    if failed:
        print("bench_train: the loss or gradients of %s differ from the padded way's by more "
              "than %.0e" % (", ".join(failed), tolerance), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
