"""packd's varlen attention for transformers' models (packd.hf.register_varlen_attention): a
packed batch through attn_implementation="packd_varlen" gives, in float64, the logits of the same
sequences padded through transformers' own eager attention, and the same gradients, for each
family of FAMILIES: grouped-query attention (Llama), sliding windows (Mistral, Gemma 2), biased
projections (Qwen 2), q and k norms (Qwen 3), logit soft-capping (Gemma 2) and experts (Mixtral,
Qwen3-MoE). Sequences come from position ids or from cu_seq_lens_q. A router's auxiliary loss
over packd's token mask is the padded batch's."""
import random

import pytest
import torch

import packd
from packd.hf import DataCollatorWithFlattening
from hf_families import (FAMILIES, VOCAB, keep_float64, needs_transformers, padded_and_packed,
                         relative)

pytestmark = needs_transformers("the PyPI stack's run checks the attention with it")


@pytest.fixture(scope="module")
def client(address):
    with packd.Client(address, shm_threshold_bytes=0) as c:
        yield c


def next_token_loss(logits_by_sequence, ids_by_sequence):
    """The summed cross entropy of each sequence's next tokens."""
    total = 0
    for logits, ids in zip(logits_by_sequence, ids_by_sequence):
        if len(ids) > 1:
            total = total + torch.nn.functional.cross_entropy(
                logits[:-1], torch.tensor(ids[1:]), reduction="sum")
    return total


@pytest.fixture
def float64(monkeypatch):
    keep_float64(monkeypatch, FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("source", ["position_ids", "cu_seq_lens_q"])
def test_packed_logits_and_gradients_equal_the_padded_batchs(client, family, source,
                                                             float64):
    rng = random.Random()
    torch.manual_seed(rng.randrange(1 << 30))
    padded, packed = padded_and_packed(family)
    sequences = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))]
                 for _ in range(rng.randint(2, 5))]

    # Padded on the right, with an attention mask, through transformers' eager attention.
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, :len(s)] = torch.tensor(s)
        mask[b, :len(s)] = 1
    out = padded(input_ids=ids, attention_mask=mask).logits
    want = [out[b, :len(s)] for b, s in enumerate(sequences)]
    next_token_loss(want, sequences).backward()

    # Packed by packd into one row, through packd_varlen.
    batch = DataCollatorWithFlattening(
        client=client, return_flash_attn_kwargs=(source == "cu_seq_lens_q"))(
            [{"input_ids": s} for s in sequences])
    kwargs = {"position_ids": batch["position_ids"]}
    if source == "cu_seq_lens_q":
        kwargs.update(cu_seq_lens_q=batch["cu_seq_lens_q"], cu_seq_lens_k=batch["cu_seq_lens_k"],
                      max_length_q=batch["max_length_q"], max_length_k=batch["max_length_k"])
    got = packed(input_ids=batch["input_ids"], **kwargs).logits[0]
    starts = [0]
    for s in sequences:
        starts.append(starts[-1] + len(s))
    got = [got[a:b] for a, b in zip(starts, starts[1:])]
    next_token_loss(got, sequences).backward()

    for n, (g, w) in enumerate(zip(got, want)):
        assert relative(g.detach(), w.detach()) <= 1e-9, (family, source, "sequence", n)
    for (name, p), q in zip(packed.named_parameters(), padded.parameters()):
        assert relative(p.grad, q.grad) <= 1e-9, (family, source, name)


def test_sequences_come_from_cu_seqlens_or_positions_and_bad_ones_are_clear():
    from packd._varlen import sequence_bounds
    assert sequence_bounds(1, 7, {"cu_seq_lens_q": torch.tensor([0, 3, 3, 7])}) == [[(0, 3),
                                                                                   (3, 7)]]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    assert sequence_bounds(1, 7, {"position_ids": positions}) == [[(0, 3), (3, 5), (5, 7)]]
    assert sequence_bounds(2, 4, {}) == [[(0, 4)], [(0, 4)]]
    with pytest.raises(ValueError, match="does not cover"):
        sequence_bounds(1, 7, {"cu_seq_lens_q": torch.tensor([0, 3, 6])})
    with pytest.raises(ValueError, match="cu_seq_lens_k differs"):
        sequence_bounds(1, 7, {"cu_seq_lens_q": torch.tensor([0, 7]),
                               "cu_seq_lens_k": torch.tensor([0, 3, 7])})


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_router_aux_loss_over_the_token_mask_is_the_padded_batchs(client, family,
                                                                  float64):
    """A padded layout's pad rows go through the router too: the auxiliary load-balancing loss
    over packd's token_mask (0 at pad rows) is the padded batch's over its attention mask, and
    over every row it is not. transformers sums the loss's terms in float32 (in an order that
    depends on where the zeros are), so it agrees to 1e-6; each real token's router logits agree
    to 1e-9."""
    rng = random.Random()
    torch.manual_seed(rng.randrange(1 << 30))
    padded, packed = padded_and_packed(family)
    # The tiny models route almost uniformly, so the pad rows move the loss over every row by as
    # little as 1.4e-6; routers 100x sharper move it by 3.6e-4 or more (the least of 200
    # batches per family).
    with torch.no_grad():
        for model in (padded, packed):
            for name, p in model.named_parameters():
                if name.endswith("gate.weight"):
                    p.mul_(100)
    lengths = [5] + [rng.randint(1, 20) for _ in range(rng.randint(1, 4))]
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width))
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    want = padded(input_ids=ids, attention_mask=mask.long(), output_router_logits=True)

    r = client.pack(ids, mask, with_position_ids=True, pad_multiple=8, with_token_mask=True)
    assert (r.token_mask == 0).any() and int(r.token_mask.sum()) == sum(lengths)
    got = packed(input_ids=r.packed[None], position_ids=r.position_ids[None],
                 attention_mask=r.token_mask[None].long(), output_router_logits=True)
    assert relative(got.aux_loss.detach(), want.aux_loss.detach()) <= 1e-6, family
    real = r.token_mask.bool()
    for layer, (g, w) in enumerate(zip(got.router_logits, want.router_logits)):
        w = w.view(len(lengths), width, -1)[mask]
        assert relative(g.view(-1, g.shape[-1])[real].detach(), w.detach()) <= 1e-9, (family,
                                                                                       layer)
    # Over every row (pad rows included), the loss is another.
    every_row = packed(input_ids=r.packed[None], position_ids=r.position_ids[None],
                       output_router_logits=True)
    assert relative(every_row.aux_loss.detach(), want.aux_loss.detach()) > 1e-5, family
