"""GRPO training on packd's shared prompts, and the proof that it is exact.

A GRPO batch holds every prompt once per response. packd packs each group with its prompt once
(docs/operation.md, "Shared prompts"): the stream is the prompt, then every member's response,
and one varlen attention call over it is exact,

    flash_attn_varlen_func(q, k[kv_index], v[kv_index], cu_seqlens_q, cu_seqlens_k,
                           max_seqlen_q, max_seqlen_k, causal=True)

each response attending to its prompt and to itself (causal aligned bottom-right). Here the
small causal transformer of train_packed.py (rotary positions from position ids) runs that call
in plain torch, segment by segment over kv_index. One PackMicroBatches call per step plans the
groups over data-parallel ranks (a group is never split) and packs them; its shifts give, in
target space (one row per predicted token), the labels, the old log-probs, the advantages and
the loss mask. The logits are gathered at pred_index (the prompt's last row predicts the first
token of every response), the loss is the token-level policy-gradient loss, clipped as PPO's,
summed and divided once by the plan's global_loss_tokens. The embeddings are packed by
RemotePackOp with the shared layout, so backward scatters their gradient through packd.

    python examples/train_grpo_shared.py --address 127.0.0.1:50051           # train
    python examples/train_grpo_shared.py --address 127.0.0.1:50051 --check   # and compare

--check trains the same model on the unshared rows as well (each row padded, causal within
itself, the logits at j - 1 predicting the token at j) in float64, and requires equal losses
and gradients after every step, to 1e-9 relative. Every step prints the tokens the stream
saves and the time of both forward passes (the shared stream's and the unshared packed
batch's).
"""
import copy
import dataclasses
import math
import os
import random
import sys
import time
from typing import List

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_packed import (DIM, HEADS, VOCAB, TinyLM, average_over_ranks,  # noqa: E402
                          example_parser, relative_difference, rope)

import packd  # noqa: E402

CLIP = 0.2


@dataclasses.dataclass
class Rollout:
    """A GRPO batch, [B, S] each: rows left-aligned (prompt, then response), right-padded,
    a group's rows scattered through the batch."""
    tokens: torch.Tensor
    mask: torch.Tensor
    groups: List[int]
    prompts: List[int]          # each row's prompt length (its group's)
    loss_mask: torch.Tensor     # the response tokens that count (truncated rows: none)
    old_logprobs: torch.Tensor  # the behaviour policy's log-prob of each token, at the token
    advantages: torch.Tensor    # the row's group-normalised reward, on each of its tokens


def rollout(seed, groups=6, seq=64):
    """`groups` prompts of 16 to 32 tokens, each with 1 to 6 responses of 1 to seq - P tokens;
    rewards normalised within each group; one row in five truncated (no loss)."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for k in range(groups):
        P = rng.randint(16, 32)
        prompt = torch.randint(0, VOCAB, (P,), generator=g)
        members = rng.randint(1, 6)
        rewards = torch.rand(members, generator=g, dtype=torch.float64)
        advantage = (rewards - rewards.mean()) / (rewards.std(unbiased=False) + 1e-6)
        for m in range(members):
            R = rng.randint(1, seq - P)
            tokens = torch.zeros(seq, dtype=torch.int64)
            tokens[:P] = prompt
            tokens[P:P + R] = torch.randint(0, VOCAB, (R,), generator=g)
            rows.append((tokens, P, R, 1000 + 7 * k, float(advantage[m]), rng.random() < 0.2))
    rng.shuffle(rows)
    B = len(rows)
    s = torch.arange(seq)[None, :]
    prompt_lengths = torch.tensor([r[1] for r in rows])[:, None]
    lengths = prompt_lengths + torch.tensor([r[2] for r in rows])[:, None]
    mask = s < lengths
    responses = mask & (s >= prompt_lengths)
    truncated = torch.tensor([r[5] for r in rows])[:, None]
    return Rollout(
        tokens=torch.stack([r[0] for r in rows]), mask=mask, groups=[r[3] for r in rows],
        prompts=[r[1] for r in rows], loss_mask=responses & ~truncated,
        old_logprobs=-torch.rand(B, seq, generator=g, dtype=torch.float64) - math.log(VOCAB),
        advantages=torch.tensor([r[4] for r in rows], dtype=torch.float64)[:, None].expand(
            B, seq).contiguous())


def shared_logits(model, h, positions, shared):
    """Logits of a shared stream h [N, D]: segment n's queries (its rows, cu_seqlens_q) attend
    to its keys (the stream rows kv_index[cu_seqlens_k[n]:cu_seqlens_k[n + 1]]), causal
    aligned bottom-right, rotary positions from each token's position in its own row: the
    plain-torch stand-in for flash_attn_varlen_func(q, k[kv_index], v[kv_index], ...)."""
    N = h.shape[0]
    cu_q, cu_k = shared.cu_seqlens_q.tolist(), shared.cu_seqlens_k.tolist()
    for layer in model.layers:
        q, k, v = layer["qkv"](layer["ln1"](h)).view(N, 3, HEADS, DIM // HEADS).unbind(1)
        q, k = rope(q, positions), rope(k, positions)
        k, v = k[shared.kv_index], v[shared.kv_index]  # keys gathered, as the varlen call's
        outs = []
        for n in range(len(cu_q) - 1):
            qs = q[cu_q[n]:cu_q[n + 1]].transpose(0, 1)  # [H, Lq, d]
            ks, vs = (t[cu_k[n]:cu_k[n + 1]].transpose(0, 1) for t in (k, v))
            Lq, Lk = qs.shape[1], ks.shape[1]
            allowed = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)
            scores = (qs @ ks.transpose(1, 2) / math.sqrt(DIM // HEADS)).masked_fill(
                ~allowed, float("-inf"))
            outs.append((scores.softmax(-1) @ vs).transpose(0, 1).reshape(Lq, DIM))
        h = h + layer["out"](torch.cat(outs) if outs else h[:0])
        h = h + layer["down"](F.gelu(layer["up"](layer["ln2"](h))))
    return model.head(model.ln(h))


def pg_token_loss(logits, labels, old_logprobs, advantages):
    """The token-level policy-gradient loss (PPO's clipped ratio, as GRPO uses it)."""
    logp = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    ratio = torch.exp(logp - old_logprobs)
    return -torch.min(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)


def shared_prefix_of(batch, rows=None):
    rows = range(len(batch.groups)) if rows is None else rows
    return packd.SharedPrefix([batch.groups[b] for b in rows], [batch.prompts[b] for b in rows],
                              same_inputs=(0,))


def shared_step(model, client, batch, *, num_ranks, max_tokens):
    """One step's gradients from packd's micro-batches of shared streams; returns the step's
    loss (the global token mean)."""
    step = client.pack_micro_batches(
        [batch.tokens, batch.old_logprobs, batch.advantages,
         batch.loss_mask.double()], batch.mask, max_tokens,
        plan=packd.PlanOptions(num_ranks=num_ranks, cost=(DIM, 1)),
        layout=packd.Layout(shared_prefix=shared_prefix_of(batch),
                            shifts=[(0, 0), (1, 0), (2, 0),
                                    (3, 0)]), loss_mask=batch.loss_mask, with_position_ids=True)
    plan = step.plan
    total = 0.0
    for mb in step:
        rows = torch.tensor(mb.samples, dtype=torch.long)
        r = mb.result
        op = packd.RemotePackOp(client, layout=packd.Layout(
            shared_prefix=shared_prefix_of(batch, mb.samples)))
        h = op.pack(model.embed(batch.tokens[rows]), batch.mask[rows]).packed
        logits = shared_logits(model, h, r.position_ids, r.shared)[r.shared.pred_index]
        labels, old, advantages, weights = r.shifted  # target space: a row per target
        token_loss = pg_token_loss(logits, labels, old, advantages) * weights
        loss = token_loss.sum() * num_ranks / plan.global_loss_tokens
        loss.backward()
        total += token_loss.sum().item() / plan.global_loss_tokens
    average_over_ranks(model, num_ranks)
    return total


def forward_times(model, client, batch, repeats=3):
    """The model's forward pass over the whole batch, shared (the stream) and unshared (the
    same rows packed as they are, every prompt G times): the best of `repeats` each, without
    the packing; and the rows of each."""
    shared = client.pack(batch.tokens, batch.mask,
                         layout=packd.Layout(shared_prefix=shared_prefix_of(batch)),
                         with_position_ids=True)
    plain = client.pack(batch.tokens, batch.mask, with_position_ids=True)
    runs = {
        "shared": lambda: shared_logits(model, model.embed(shared.packed), shared.position_ids,
                                        shared.shared),
        "unshared": lambda: model.packed(model.embed(plain.packed), plain.position_ids,
                                         plain.cu_seqlens)}
    best = {}
    with torch.no_grad():
        for name, run in runs.items():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            best[name] = min(times)
    return best["shared"], best["unshared"], shared.total_active, plain.total_active


def dense_step(model, batch):
    """The reference: every row unshared and padded, causal within itself; the logits at j - 1
    predict the token at j for every response token, one global denominator."""
    logits = model.dense(batch.tokens, batch.mask, torch.zeros_like(batch.tokens))
    P = torch.tensor(batch.prompts)[:, None].clamp(min=1)
    targets = batch.mask & (torch.arange(batch.mask.shape[1])[None, :] >= P)
    at = targets[:, 1:]
    token_loss = pg_token_loss(logits[:, :-1][at], batch.tokens[:, 1:][at],
                               batch.old_logprobs[:, 1:][at], batch.advantages[:, 1:][at])
    weights = batch.loss_mask[:, 1:][at].to(token_loss.dtype)
    loss = (token_loss * weights).sum() / weights.sum()
    loss.backward()
    return loss.item()


def train(client, steps=3, num_ranks=2, max_tokens=160, check=False, log=print):
    """Trains for `steps`; with `check`, beside the unshared reference. Returns the largest
    relative differences of losses and gradients (0 without check) and the stats of the
    stream: its rows, the active tokens, the forward times."""
    torch.set_default_dtype(torch.float64)
    model = TinyLM().double()
    reference = copy.deepcopy(model)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    worst_loss = worst_grad = 0.0
    stats = dict(stream_rows=0, active=0, shared_forward_s=0.0, unshared_forward_s=0.0)
    for i in range(steps):
        batch = rollout(seed=200 + i)
        for opt in optimizers:
            opt.zero_grad()
        loss = shared_step(model, client, batch, num_ranks=num_ranks, max_tokens=max_tokens)
        shared_s, unshared_s, rows, active = forward_times(model, client, batch)
        for key, value in (("stream_rows", rows), ("active", active),
                           ("shared_forward_s", shared_s), ("unshared_forward_s", unshared_s)):
            stats[key] += value
        line = ("step %d: loss %+.6f  tokens %d shared / %d unshared (%.0f%% fewer)  forward "
                "%.1f / %.1f ms" % (i, loss, rows, active, 100.0 * (active - rows) / active,
                                    1e3 * shared_s, 1e3 * unshared_s))
        if check:
            expected = dense_step(reference, batch)
            worst_loss = max(worst_loss, abs(loss - expected) / max(abs(expected), 1e-300))
            for p, q in zip(model.parameters(), reference.parameters()):
                worst_grad = max(worst_grad, relative_difference(p.grad, q.grad))
            line += "  unshared loss %+.6f  grad rel. diff %.1e" % (expected, worst_grad)
        log(line)
        for opt in optimizers:
            opt.step()
    return worst_loss, worst_grad, stats


def main(argv=None):
    args = example_parser(__doc__.split("\n")[0], ranks=2, max_tokens=160).parse_args(argv)
    with packd.Client(args.address) as client:
        loss, grad, stats = train(client, args.steps, args.ranks, args.max_tokens, args.check)
    print("the stream: %d rows for %d tokens (%.0f%% fewer); forward %.1f ms shared, %.1f ms "
          "unshared" % (stats["stream_rows"], stats["active"],
                        100.0 * (stats["active"] - stats["stream_rows"]) / stats["active"],
                        1e3 * stats["shared_forward_s"], 1e3 * stats["unshared_forward_s"]))
    if args.check:
        ok = loss <= 1e-9 and grad <= 1e-9
        print("losses and gradients equal the unshared model's to %.1e / %.1e relative: %s"
              % (loss, grad, "ok" if ok else "FAILED"))
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
