"""A training loop on packed micro-batches from packd, and the proof that its loss is right.

A small causal transformer (plain torch: embeddings, rotary positions from position ids,
attention within each document from cu_seqlens) is trained on a synthetic corpus of documents
of mixed lengths, several packed to a row with segment ids, over simulated data-parallel ranks
under a token budget. One PackMicroBatches call per step gives the plan and every micro-batch,
packed with next-token labels (shifts) and a loss mask; the loss of every micro-batch is its
summed token loss divided by the plan's one global_loss_tokens (times the ranks, because
data-parallel training averages gradients over ranks). The embeddings are packed by RemotePackOp,
so backward goes through packd's Scatter.

    python examples/train_packed.py --address 127.0.0.1:50051           # train, print losses
    python examples/train_packed.py --address 127.0.0.1:50051 --check   # and compare
    python examples/train_packed.py --address 127.0.0.1:50051 --streaming --check

--streaming trains on a streaming step instead (docs/operation.md, "The streaming step"): the
batch's rows arrive as groups in a shuffled order from a rollout thread while every rank
receives its own micro-batches; each micro-batch's summed token loss is backpropagated and the
gradients scaled once by world_size / global_loss_tokens (packd.scale_gradients).

--check trains the same model unpacked as well (padded rows, a per-document causal attention
mask, positions counted from each document's start, one global denominator) in float64, and
requires equal losses and gradients after every step, to 1e-9 relative. It also shows the quiet
bug: a mean taken per micro-batch gives other gradients.
"""
import argparse
import copy
import math
import random
import sys
import threading

import torch
import torch.nn.functional as F

import packd

VOCAB, DIM, HEADS, LAYERS = 61, 32, 4, 2


def corpus(seed, rows=24, seq=64):
    """token ids, mask, segment ids and loss mask, each [rows, seq]: documents of 2 to 24 tokens
    packed into rows, a ragged tail of padding, and the first tokens of each document a prompt
    without loss. loss_mask[b, s] says whether the prediction made at s (of token s + 1, in the
    same document) counts: never at a document's last token."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, seq), generator=g)
    mask = torch.zeros(rows, seq, dtype=torch.bool)
    segments = torch.zeros(rows, seq, dtype=torch.int32)
    loss_mask = torch.zeros(rows, seq, dtype=torch.bool)
    for b in range(rows):
        fill = int(torch.randint(seq // 3, seq + 1, (1,), generator=g))
        s, doc = 0, 0
        while s < fill:
            n = min(int(torch.randint(2, 25, (1,), generator=g)), fill - s)
            prompt = int(torch.randint(0, max(1, n // 2), (1,), generator=g))
            mask[b, s:s + n] = True
            segments[b, s:s + n] = doc
            loss_mask[b, s + prompt:s + n - 1] = True
            s, doc = s + n, doc + 1
    return tokens, mask, segments, loss_mask


def rope(x, positions):
    """Rotary position embedding of x [T, H, d] at integer positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=x.dtype) / d))
    angles = positions.to(x.dtype)[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class TinyLM(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList()
        for _ in range(LAYERS):
            self.layers.append(torch.nn.ModuleDict({
                "ln1": torch.nn.LayerNorm(DIM), "qkv": torch.nn.Linear(DIM, 3 * DIM),
                "out": torch.nn.Linear(DIM, DIM), "ln2": torch.nn.LayerNorm(DIM),
                "up": torch.nn.Linear(DIM, 4 * DIM), "down": torch.nn.Linear(4 * DIM, DIM)}))
        self.ln = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def packed(self, h, positions, cu_seqlens):
        """Logits of packed hidden states h [T, D]: attention runs within each sequence
        cu_seqlens[k] .. cu_seqlens[k + 1] (a document), causal, with rotary positions."""
        T = h.shape[0]
        bounds = cu_seqlens.tolist()
        for layer in self.layers:
            q, k, v = layer["qkv"](layer["ln1"](h)).view(T, 3, HEADS, DIM // HEADS).unbind(1)
            q, k = rope(q, positions), rope(k, positions)
            outs = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))  # [H, n, d]
                scores = qs @ ks.transpose(1, 2) / math.sqrt(DIM // HEADS)
                causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
                scores = scores.masked_fill(~causal, float("-inf"))
                outs.append((scores.softmax(-1) @ vs).transpose(0, 1).reshape(b - a, DIM))
            h = h + layer["out"](torch.cat(outs) if outs else h[:0])
            h = h + layer["down"](F.gelu(layer["up"](layer["ln2"](h))))
        return self.head(self.ln(h))

    def dense(self, tokens, mask, segments, h=None):
        """Logits [B, S, V] of padded rows: a per-document causal attention mask, positions
        counted from each document's start (the unpacked reference). h: the hidden states
        [B, S, D] to start from (default: the tokens' embeddings)."""
        B, S = tokens.shape
        h = self.embed(tokens) if h is None else h
        same = segments[:, :, None] == segments[:, None, :]
        allowed = same & mask[:, :, None] & mask[:, None, :]
        allowed &= torch.ones(S, S, dtype=torch.bool).tril()
        allowed |= torch.eye(S, dtype=torch.bool)  # padding attends to itself
        start = torch.zeros(B, S, dtype=torch.long)
        for b in range(B):
            for s in range(1, S):
                start[b, s] = start[b, s - 1] if segments[b, s] == segments[b, s - 1] else s
        positions = torch.arange(S)[None, :] - start
        for layer in self.layers:
            q, k, v = layer["qkv"](layer["ln1"](h)).view(B, S, 3, HEADS, DIM // HEADS).unbind(2)
            q = torch.stack([rope(q[b], positions[b]) for b in range(B)])
            k = torch.stack([rope(k[b], positions[b]) for b in range(B)])
            scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / math.sqrt(DIM // HEADS)
            scores = scores.masked_fill(~allowed[:, None], float("-inf"))
            att = (scores.softmax(-1) @ v.transpose(1, 2)).transpose(1, 2).reshape(B, S, DIM)
            h = h + layer["out"](att)
            h = h + layer["down"](F.gelu(layer["up"](layer["ln2"](h))))
        return self.head(self.ln(h))


def packed_step(model, client, batch, *, num_ranks, max_tokens, per_micro_batch_mean=False):
    """One step's gradients from packd's micro-batches; returns the step's loss (the global
    token mean). per_micro_batch_mean=True divides each micro-batch by its own loss tokens
    instead (the bug)."""
    tokens, mask, segments, loss_mask = batch
    op = packd.RemotePackOp(client)
    step = client.pack_micro_batches([tokens, loss_mask.to(torch.int64)], mask, max_tokens,
                                     plan=packd.PlanOptions(num_ranks=num_ranks, cost=(DIM, 1)),
                                     layout=packd.Layout(shifts=[(0, -100)]), loss_mask=loss_mask,
                                     segment_ids=segments, with_position_ids=True)
    plan = step.plan
    total = 0.0
    for mb in step:
        rows = torch.tensor(mb.samples, dtype=torch.long)
        r = mb.result
        # The embeddings packed by packd: backward scatters their gradient through it.
        h = op.pack(model.embed(tokens[rows]), mask[rows]).packed
        logits = model.packed(h, r.position_ids, r.doc_cu_seqlens)
        total += backward_next_tokens(logits, r, plan, num_ranks, per_micro_batch_mean)
    average_over_ranks(model, num_ranks)
    return total


def streaming_step(model, client, batch, *, num_ranks, max_tokens, per_micro_batch_mean=False,
                   group=4, seed=0):
    """One step's gradients from a streaming step: the batch's rows submitted `group` at a time
    in a shuffled order (seed) from a rollout thread, each rank receiving its own stream (the
    ranks simulated in this process). Each micro-batch's summed token loss is backpropagated,
    the ranks' gradients averaged, then scaled by world_size / global_loss_tokens. Returns the
    step's loss. per_micro_batch_mean=True: each micro-batch divided by its own loss tokens
    instead (the bug)."""
    tokens, mask, segments, loss_mask = batch
    layout = packd.Layout(shifts=((0, -100),))
    rows = [list(range(b, min(b + group, tokens.shape[0])))
            for b in range(0, tokens.shape[0], group)]
    random.Random(seed).shuffle(rows)
    with client.open_step(max_tokens, plan=packd.PlanOptions(num_ranks=num_ranks, cost=(DIM, 1)),
                          layout=layout, with_position_ids=True) as step:
        streams = [client.receive_step(step.step_id, r) for r in range(num_ranks)]
        received = [[] for _ in range(num_ranks)]
        ranks = [threading.Thread(target=received[r].extend, args=(streams[r],))
                 for r in range(num_ranks)]
        for t in ranks:
            t.start()
        with packd.Client(step.address) as rollouts:  # the replica holding the step
            for g in rows:
                rollouts.submit_group(step.step_id, [tokens[g], loss_mask[g].to(torch.int64)],
                                      mask[g], segment_ids=segments[g], loss_mask=loss_mask[g])
        summary = step.close()
        for t in ranks:
            t.join()
    total = 0.0
    for micro_batches in received:
        for mb in micro_batches:
            r = mb.result
            if r.total_active == 0:
                continue  # an empty micro-batch (a rank with nothing left at the close)
            logits = model.packed(model.embed(r.packed[0]), r.position_ids, r.doc_cu_seqlens)
            weights = r.packed[1].to(logits.dtype)
            token_loss = F.cross_entropy(logits, r.shifted[0].clamp(min=0),
                                         reduction="none") * weights
            if per_micro_batch_mean:
                (token_loss.sum() / max(int(weights.sum()), 1)
                 / summary.micro_batches_per_rank).backward()
            else:
                token_loss.sum().backward()
            total += token_loss.sum().item()
    average_over_ranks(model, num_ranks)
    if not per_micro_batch_mean:
        packd.scale_gradients(model.parameters(), num_ranks, summary.global_loss_tokens)
    return total / summary.global_loss_tokens


def backward_next_tokens(logits, r, plan, num_ranks, per_micro_batch_mean=False):
    """Backpropagates a micro-batch's next-token loss: logits [T, V] against the labels
    r.shifted[0], weighted by the loss mask packed as r.packed[1]. Returns its part of the
    step's loss (its summed token loss over global_loss_tokens)."""
    labels, weights = r.shifted[0], r.packed[1].to(logits.dtype)
    token_loss = F.cross_entropy(logits, labels.clamp(min=0), reduction="none") * weights
    micro_batch_loss(token_loss, weights, plan, num_ranks, per_micro_batch_mean).backward()
    return token_loss.sum().item() / plan.global_loss_tokens


def micro_batch_loss(token_loss, weights, plan, num_ranks, per_micro_batch_mean=False):
    """What one micro-batch backpropagates: its summed token loss over the plan's one
    global_loss_tokens, times the ranks (the all-reduce mean of the ranks' gradients is then
    the gradient of the global token mean). per_micro_batch_mean=True: each rank averages its
    micro-batches' own means instead, what gradient accumulation does when every micro-batch
    is divided by its own token count (the bug)."""
    if per_micro_batch_mean:
        return token_loss.sum() / max(int(weights.sum()), 1) / plan.micro_batches_per_rank
    return token_loss.sum() * num_ranks / plan.global_loss_tokens


def average_over_ranks(model, num_ranks):
    """The all-reduce mean of the ranks' gradients (the ranks simulated in one process)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= num_ranks


def dense_step(model, batch, hidden=None):
    """The reference: the whole batch unpacked, one global denominator (from `hidden`, the
    batch's hidden states, when given)."""
    tokens, mask, segments, loss_mask = batch
    logits = model.dense(tokens, mask, segments, h=hidden)
    labels = torch.roll(tokens, -1, dims=1)
    weights = (loss_mask & mask).to(logits.dtype)
    token_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    loss = (token_loss * weights.flatten()).sum() / weights.sum()
    loss.backward()
    return loss.item()


def relative_difference(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def train_beside(model, reference, packed, unpacked, steps, optimizer, log,
                 reference_name="unpacked"):
    """Trains `model` for `steps`, step i on corpus(seed=100 + i), its gradients from
    packed(model, batch, per_micro_batch_mean=False) (which returns the step's loss); with a
    `reference` model (else None), beside it from unpacked(reference, batch) at the same
    weights: the reference takes the model's weights after every step, so that each step is
    compared on its own (float rounding in one step's sums, which the optimizer can amplify, is
    not carried into the next comparison). optimizer(params) makes each model's optimizer.
    Returns the largest relative differences of losses and
    gradients (0 without a reference) and of the per-micro-batch mean's gradients on the first
    step."""
    models = [model] + ([reference] if reference is not None else [])
    optimizers = [optimizer(m.parameters()) for m in models]
    worst_loss = worst_grad = 0.0
    bug = None
    for i in range(steps):
        batch = corpus(seed=100 + i)
        for opt in optimizers:
            opt.zero_grad()
        loss = packed(model, batch)
        line = "step %d: loss %.6f" % (i, loss)
        if reference is not None:
            expected = unpacked(reference, batch)
            worst_loss = max(worst_loss, abs(loss - expected) / abs(expected))
            for p, q in zip(model.parameters(), reference.parameters()):
                worst_grad = max(worst_grad, relative_difference(p.grad, q.grad))
            line += "  %s %.6f  grad rel. diff %.1e" % (reference_name, expected, worst_grad)
            if bug is None:
                wrong = copy.deepcopy(model)
                wrong.zero_grad()
                packed(wrong, batch, per_micro_batch_mean=True)
                bug = max(relative_difference(p.grad, q.grad)
                          for p, q in zip(wrong.parameters(), reference.parameters()))
                line += "  (per-micro-batch mean: %.1e)" % bug
        log(line)
        for opt in optimizers:
            opt.step()
        if reference is not None:
            with torch.no_grad():
                for p, q in zip(model.parameters(), reference.parameters()):
                    q.copy_(p)
    return worst_loss, worst_grad, bug or 0.0


def report(loss, grad, bug, reference_name="unpacked"):
    """Prints --check's verdict; the exit status."""
    ok = loss <= 1e-9 and grad <= 1e-9 and bug > 1e-3
    print("losses and gradients equal the %s model's to %.1e / %.1e relative; a "
          "per-micro-batch mean differs by %.1e: %s" % (reference_name, loss, grad, bug,
                                                        "ok" if ok else "FAILED"))
    return 0 if ok else 1


def train(client, steps=3, num_ranks=4, max_tokens=96, check=False, log=print,
          streaming=False):
    """Trains for `steps` (on a streaming step with `streaming`); with `check`, beside the
    unpacked reference. Returns the largest relative differences of losses and gradients (0
    without check) and of the per-micro-batch mean's gradients on the first step."""
    torch.set_default_dtype(torch.float64)
    model = TinyLM().double()
    step = streaming_step if streaming else packed_step

    def packed(m, batch, per_micro_batch_mean=False):
        return step(m, client, batch, num_ranks=num_ranks, max_tokens=max_tokens,
                    per_micro_batch_mean=per_micro_batch_mean)

    return train_beside(model, copy.deepcopy(model) if check else None, packed, dense_step,
                        steps, lambda params: torch.optim.Adam(params, lr=1e-2), log)


def example_parser(description, ranks, max_tokens):
    """The examples' command line: --address, --steps, --ranks, --max_tokens, --check."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=ranks)
    parser.add_argument("--max_tokens", type=int, default=max_tokens)
    parser.add_argument("--check", action="store_true")
    return parser


def main(argv=None):
    parser = example_parser(__doc__.split("\n")[0], ranks=4, max_tokens=96)
    parser.add_argument("--streaming", action="store_true",
                        help="train on a streaming step (groups arriving over time)")
    args = parser.parse_args(argv)
    with packd.Client(args.address) as client:
        loss, grad, bug = train(client, args.steps, args.ranks, args.max_tokens, args.check,
                                streaming=args.streaming)
    return report(loss, grad, bug) if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
