"""One trainer rank of a streaming step, in its own process (tests/python/test_streaming_step.py):
receives its micro-batches from packd, backpropagates each one's summed token loss through the
examples' model in float64, and saves its gradients, micro-batch count and the step's
global_loss_tokens.

    python stream_rank.py ADDRESS STEP_ID RANK OUT_FILE
"""
import os
import sys

import torch
import torch.nn.functional as F

import packd

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from train_packed import TinyLM  # noqa: E402


def main(address, step_id, rank, out):
    model = TinyLM(seed=0).double()
    micro_batches = []
    with packd.Client(address) as client:
        stream = client.receive_step(step_id, int(rank))  # read with the step's layout
        for mb in stream:
            r = mb.result
            micro_batches.append(list(mb.samples))
            if r.total_active == 0:
                continue  # an empty micro-batch: a real trainer still runs its collectives
            h = model.embed(r.packed[0])
            logits = model.packed(h, r.position_ids, r.doc_cu_seqlens)
            labels, weights = r.shifted[0], r.packed[1].to(logits.dtype)
            token_loss = F.cross_entropy(logits, labels.clamp(min=0), reduction="none") * weights
            token_loss.sum().backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach()
             for n, p in model.named_parameters()}
    torch.save({"grads": grads, "micro_batches": micro_batches,
                "global_loss_tokens": stream.global_loss_tokens}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
