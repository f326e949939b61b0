"""The in-process torch step that packd's step is timed against on a GPU
(tests/gpu/torch_step.py) does the same step: on CPU tensors, every micro-batch equal to
packd's byte for byte, planned from the lengths it measures itself."""
import os
import sys

import torch

import packd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "gpu"))
from torch_step import torch_step  # noqa: E402


def rollout(gen, B, S):
    lengths = torch.randint(1, S + 1, (B,), generator=gen)
    mask = torch.arange(S)[None, :] < lengths[:, None]
    tokens = torch.randint(0, 50000, (B, S), generator=gen)
    logprobs = torch.randint(-2**31, 2**31 - 1, (B, S), dtype=torch.int32,
                             generator=gen).view(torch.float32)  # every bit pattern
    ids = torch.randint(0, 5, (B, S), generator=gen).cumsum(1).to(torch.int32)
    loss_mask = mask & (torch.rand(B, S, generator=gen) < 0.9)
    return mask, tokens, logprobs, ids, loss_mask


def test_the_torch_step_packs_what_packds_step_packs(address):
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    mask, tokens, logprobs, ids, loss_mask = rollout(gen, 48, 300)
    budget, ranks = 2048, 4
    with packd.Client(address) as client:
        step = client.pack_micro_batches([tokens, logprobs], mask, budget,
                                         plan=packd.PlanOptions(num_ranks=ranks),
                                         layout=packd.Layout(pad_multiple=8,
                                                             shifts=[(0, -100)]), segment_ids=ids,
                                         loss_mask=loss_mask, with_position_ids=True)
        theirs = {(mb.rank, mb.index): mb for mb in step}
        planned = []

        def plan(lengths, loss_tokens):
            response = client.plan_micro_batches(lengths, budget,
                                                 plan=packd.PlanOptions(num_ranks=ranks),
                                                 loss_tokens=loss_tokens)
            planned.append(response)
            return [(mb.rank, list(mb.samples)) for mb in response.micro_batches]

        ours = torch_step([tokens, logprobs], mask, ids, pad_multiple=8, shift=(0, -100),
                          plan=plan, loss_mask=loss_mask)
    # The same plan from the lengths the torch step measured.
    assert [(mb.rank, list(mb.samples)) for mb in planned[0].micro_batches] == \
        [(mb.rank, list(mb.samples)) for mb in step.plan.micro_batches]
    assert planned[0].global_loss_tokens == step.plan.global_loss_tokens
    assert len(ours) == len(theirs) >= 8
    for mb in ours:
        want = theirs[(mb.rank, mb.index)]
        assert mb.samples == list(want.samples)
        r = want.result
        for a, b in zip(mb.packed + [mb.shifted], r.packed + r.shifted):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.contiguous().view(torch.uint8),
                               b.contiguous().view(torch.uint8))
        assert mb.cu_seqlens.tolist() == r.doc_cu_seqlens.tolist()
        assert mb.cu_seqlens_padded.tolist() == r.cu_seqlens_padded.tolist()
        assert mb.position_ids.tolist() == r.position_ids.tolist()
