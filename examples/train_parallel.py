"""Context-parallel and Ulysses training on packd's step, and the proof that it is exact.

Each CP rank (TransformerEngine's THD format: every sequence padded to a multiple of 2 * cp_size
and cut into 2 * cp_size chunks, rank r holding chunks r and 2 * cp_size - 1 - r) or Ulysses SP
rank (verl's ulysses_pad_and_slice_inputs: the stream padded to a multiple of sp_size and cut
into sp_size contiguous slices) asks one PackMicroBatches call for its own rows (cp_rank= or
sp_rank=). Every rank gets the same plan: a sample's length is its rows on one GPU, so
max_tokens is a per-GPU budget, and global_loss_tokens is the whole batch's. The hidden states
of each micro-batch go through RemotePackOp with the same layout, so backward scatters their
gradient through packd.

What each parallel attention's all-gather sees is rebuilt here from the ranks' rows (CP: every
sequence's chunks put back in order; Ulysses: the ranks' rows in rank order), the model runs on
it, and each rank's loss is its own rows' summed token loss over global_loss_tokens.

    python examples/train_parallel.py --address 127.0.0.1:50051 --mode cp --check
    python examples/train_parallel.py --address 127.0.0.1:50051 --mode sp --fixed --check

--check runs the unpacked model beside it in float64 (padded rows, a per-document causal mask,
one global denominator) and requires equal losses, hidden-state gradients and parameter
gradients, to 1e-9 relative. --fixed gives every micro-batch one fixed shape (a ghost sequence
takes the rest): fixed.tokens counts the rows of every rank, so ranks * max_tokens always fits.
"""
import argparse
import copy
import dataclasses
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_packed import DIM, TinyLM, corpus, dense_step, relative_difference  # noqa: E402

import packd  # noqa: E402


def parallel_layout(mode, size, rank, max_tokens, fixed):
    """The packd.Layout of one rank: CP pads every sequence to 2 * size; Ulysses pads only the
    stream's end (to a multiple of size). With `fixed`, every micro-batch has size * max_tokens
    rows and room for 64 sequences."""
    if mode == "cp":
        kwargs = dict(pad_multiple=2 * size, cp_size=size, cp_rank=rank)
    else:
        kwargs = dict(sp_size=size, sp_rank=rank)
    if fixed:
        tokens = size * max_tokens
        kwargs["fixed"] = (tokens, 64, tokens)
    return packd.Layout(**kwargs)


def all_gather_order(mode, size, cu_padded):
    """For each rank, the positions its rows take in the whole stream (what attention's
    all-gather rebuilds): CP, each sequence's chunks r and 2 * size - 1 - r; Ulysses, the
    contiguous slice r."""
    n = int(cu_padded[-1])
    if mode == "sp":
        share = n // size
        return [torch.arange(r * share, (r + 1) * share) for r in range(size)]
    order = [[] for _ in range(size)]
    bounds = cu_padded.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        h = (end - start) // (2 * size)
        for r in range(size):
            for chunk in (r, 2 * size - 1 - r):
                order[r].extend(range(start + chunk * h, start + (chunk + 1) * h))
    return [torch.tensor(o, dtype=torch.long) for o in order]


def rebuilt(parts, order):
    """The whole stream from every rank's rows (parts[r] holds rows order[r]); differentiable."""
    whole = torch.cat(parts)
    return whole[torch.argsort(torch.cat(order))]


def parallel_step(model, client, batch, hidden, *, mode, size, num_ranks, max_tokens, fixed):
    """One step's loss and gradients (hidden.grad, the parameters') from every CP or SP rank's
    micro-batches."""
    tokens, mask, segments, loss_mask = batch
    steps, ops = [], []
    for rank in range(size):
        layout = parallel_layout(mode, size, rank, max_tokens, fixed)
        # The step's labels: the next token within each document, -100 at its end.
        labelled = dataclasses.replace(layout, shifts=((0, -100),))
        steps.append(
            client.pack_micro_batches([tokens, loss_mask.to(torch.int64)], mask, max_tokens,
                                      plan=packd.PlanOptions(num_ranks=num_ranks,
                                                             cost=(DIM, 1)),
                                      layout=labelled, loss_mask=loss_mask,
                                      segment_ids=segments, with_position_ids=True))
        ops.append(packd.RemotePackOp(client, layout=layout))
    plan = steps[0].plan
    for s in steps[1:]:
        assert s.plan == plan, "every CP or SP rank gets the same plan"
    total = 0.0
    for per_rank in zip(*steps):  # the same micro-batch on every rank
        rows = torch.tensor(per_rank[0].samples, dtype=torch.long)
        results = [mb.result for mb in per_rank]
        cu_padded = results[0].cu_seqlens_padded
        order = all_gather_order(mode, size, cu_padded)
        h = [ops[r].pack(hidden[rows], mask[rows], segments[rows]).packed for r in range(size)]
        positions = rebuilt([r.position_ids for r in results], order)
        logits = model.packed(rebuilt(h, order), positions, cu_padded)
        for r, result in enumerate(results):
            mine = logits[order[r]]
            labels, weights = result.shifted[0], result.packed[1].to(mine.dtype)
            token_loss = F.cross_entropy(mine, labels.clamp(min=0), reduction="none") * weights
            # Summed over every micro-batch of every rank (CP and data-parallel), divided once.
            loss = token_loss.sum() / plan.global_loss_tokens
            loss.backward(retain_graph=r + 1 < size)
            total += loss.item()
    return total


def train(client, *, mode="cp", size=2, fixed=False, steps=2, num_ranks=2, max_tokens=64,
          check=False, log=print):
    """Trains `steps` steps; with `check`, beside the unpacked model. Returns the largest
    relative differences of the losses, the hidden-state gradients and the parameter
    gradients (0 without check)."""
    torch.set_default_dtype(torch.float64)
    model = TinyLM(seed=1).double()
    reference = copy.deepcopy(model)
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, reference)]
    worst = [0.0, 0.0, 0.0]
    for i in range(steps):
        batch = corpus(seed=200 + i, rows=12)
        start = model.embed(batch[0]).detach()
        hidden = start.clone().requires_grad_()
        for opt in optimizers:
            opt.zero_grad()
        loss = parallel_step(model, client, batch, hidden, mode=mode, size=size,
                             num_ranks=num_ranks, max_tokens=max_tokens, fixed=fixed)
        line = "%s %d%s step %d: loss %.6f" % (mode, size, " fixed" if fixed else "", i, loss)
        if check:
            expected_hidden = start.clone().requires_grad_()
            expected = dense_step(reference, batch, expected_hidden)
            worst[0] = max(worst[0], abs(loss - expected) / abs(expected))
            worst[1] = max(worst[1], relative_difference(hidden.grad, expected_hidden.grad))
            for p, q in zip(model.parameters(), reference.parameters()):
                if q.grad is not None:
                    worst[2] = max(worst[2], relative_difference(p.grad, q.grad))
            line += "  unpacked %.6f  hidden grad %.1e  grad %.1e" % (expected, worst[1],
                                                                      worst[2])
        log(line)
        for opt in optimizers:
            opt.step()
    return tuple(worst)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--mode", choices=["cp", "sp"], default="cp")
    parser.add_argument("--size", type=int, default=2, help="CP or SP ranks")
    parser.add_argument("--fixed", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    with packd.Client(args.address) as client:
        worst = train(client, mode=args.mode, size=args.size, fixed=args.fixed,
                      steps=args.steps, check=args.check)
    if args.check:
        ok = max(worst) <= 1e-9
        print("losses, hidden-state and parameter gradients equal the unpacked model's to "
              "%.1e / %.1e / %.1e relative: %s" % (*worst, "ok" if ok else "FAILED"))
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
