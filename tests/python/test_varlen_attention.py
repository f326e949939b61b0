"""packd's varlen attention for transformers' models (packd.hf.register_varlen_attention): a
packed batch through attn_implementation="packd_varlen" gives, in float64, the logits of the same
sequences padded through transformers' own eager attention, and the same gradients, for each
family of FAMILIES: grouped-query attention (Llama), sliding windows (Mistral, Gemma 2), biased
projections (Qwen 2), q and k norms (Qwen 3), logit soft-capping (Gemma 2) and experts (Mixtral,
Qwen3-MoE). Sequences come from position ids or from cu_seq_lens_q. A router's auxiliary loss
over packd's token mask is the padded batch's."""
import copy
import random

import pytest
import torch

import packd
from packd.hf import DataCollatorWithFlattening
from hf_families import (FAMILIES, VOCAB, Float64Steps, keep_float64, needs_transformers, padded_and_packed,
                         relative)

pytestmark = needs_transformers("the PyPI stack's run checks the attention with it")


@pytest.fixture(scope="module")
def client(address):
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
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
    # A gradient the padded model has exactly zero (the queries' and keys' when every sequence
    # is one token: a softmax over one key) is float64 rounding packed, compared with the
    # model's largest gradient instead.
    largest = max(float(q.grad.abs().max()) for q in padded.parameters())
    for (name, p), q in zip(packed.named_parameters(), padded.parameters()):
        assert (relative(p.grad, q.grad) <= 1e-9
                or float((p.grad - q.grad).abs().max()) <= 1e-12 * largest), (family, source, name)


def test_sequences_come_from_cu_seqlens_or_positions_and_bad_ones_are_clear():
    from packd.integrations.documents import sequence_bounds
    assert sequence_bounds(1, 7, {"cu_seq_lens_q": torch.tensor([0, 3, 3, 7])}) == [[(0, 3),
                                                                                   (3, 7)]]
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    assert sequence_bounds(1, 7, {"position_ids": positions}) == [[(0, 3), (3, 5), (5, 7)]]
    assert sequence_bounds(2, 4, {}) is None  # neither: the mask, else the whole row
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

    r = client.pack(ids, mask, with_position_ids=True,
                    layout=packd.Layout(pad_multiple=8, with_token_mask=True))
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


def test_chunked_attention_counts_its_chunks_within_each_document(client, float64):
    """Llama 4's chunked layers (chunks of 3, shorter than every document) and its layers that
    hand no position ids to their attention: packd_varlen equals eager on the documents padded,
    with the position ids alone (the sequences from transformers' mask) and with the
    flash-attention kwargs."""
    from packd.integrations import documents as _varlen
    from packd.hf import packed_row, register_varlen_attention
    from transformers import AutoModelForCausalLM, Llama4TextConfig
    register_varlen_attention()
    rng = random.Random()
    torch.manual_seed(rng.randrange(1 << 30))
    config = Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                              intermediate_size_mlp=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              attention_chunk_size=3, num_local_experts=2,
                              layer_types=["chunked_attention", "full_attention"],
                              no_rope_layers=[1, 0], max_position_embeddings=128)
    padded = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                              experts_implementation="eager",
                                              dtype=torch.float64).double().eval()
    packed = copy.deepcopy(padded)
    packed.set_attn_implementation("packd_varlen")
    lengths = [rng.randint(4, 12) for _ in range(3)]
    ids = torch.randint(4, VOCAB, (3, max(lengths)))
    mask = torch.arange(ids.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    steps = Float64Steps()
    with torch.no_grad(), steps.kept():
        want = padded(input_ids=ids * mask, attention_mask=mask.long()).logits[mask]
    segments = torch.arange(3)[:, None].expand_as(ids)[mask][None]
    r = client.pack([ids[mask][None]], torch.ones_like(segments, dtype=torch.bool),
                    segment_ids=segments, with_position_ids=True)
    for only_positions in (True, False):
        with torch.no_grad(), steps.kept(), packed_row(r, packed) as kwargs:
            if only_positions:
                kwargs = {"position_ids": kwargs["position_ids"], "use_cache": False}
            got = packed(input_ids=r.packed[0][None], **kwargs).logits[0]
            sources = set(_varlen.declaration().sources)
        assert relative(got, want) <= 1e-9, (lengths, only_positions, relative(got, want))
        if only_positions:  # Llama 4's attention takes no position ids: the mask gave them
            assert sources == {"transformers' mask"}, sources
    # With a 2D attention mask (which turns transformers' packed detection off) and without the
    # kwargs, the chunks would be counted from the row's start: refused, naming the module.
    with pytest.raises(ValueError, match=r"Llama4TextAttention.*token \d+ would attend"):
        with torch.no_grad(), packed_row(r, packed) as kwargs:
            packed(input_ids=r.packed[0][None], position_ids=kwargs["position_ids"],
                   attention_mask=torch.ones_like(r.packed[0][None]), use_cache=False)


@pytest.mark.parametrize("kind, extra", [
    ("rwkv", {}), ("bart", {}),
    ("llama", {"layer_types": ["full_attention", "indexed_attention"]})])
def test_families_it_cannot_serve_are_refused_before_the_forward(client, kind, extra):
    """packd.hf.packed_row(result, model) refuses, naming the family, a model whose layers mix
    tokens outside attention and outside the stateful layers packd runs per document (an
    indexed attention without an indexer module) or whose forward takes no position ids."""
    from packd.hf import packed_row
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model(kind, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, **extra)
    model = AutoModelForCausalLM.from_config(config)
    r = client.pack([torch.arange(1, 7)[None]], torch.ones(1, 6, dtype=torch.bool),
                    segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]), with_position_ids=True)
    with pytest.raises(ValueError, match=r"packd_varlen cannot serve .*\(%s\)" % kind):
        with packed_row(r, model):
            pass


def test_positions_from_after_the_pad_id_come_from_packed_row(client):
    """RoBERTa numbers a sequence's positions from padding_idx + 1: packed_row gives them from
    there (restarting at every document), and check_model refuses the family to a caller that
    passes packd's own position ids (0 at every document)."""
    from packd.integrations.checks import check_model
    from packd.hf import packed_row, register_varlen_attention
    from transformers import AutoModelForCausalLM, RobertaConfig
    register_varlen_attention()
    model = AutoModelForCausalLM.from_config(RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, is_decoder=True, pad_token_id=1),
        attn_implementation="packd_varlen")  # the leak probe runs it packed, from position 2
    r = client.pack([torch.arange(3, 9)[None]], torch.ones(1, 6, dtype=torch.bool),
                    segment_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]), with_position_ids=True)
    with packed_row(r, model) as kwargs:
        assert kwargs["position_ids"].tolist() == [[2, 3, 4, 2, 3, 4]]
    with pytest.raises(ValueError, match=r"cannot serve .*\(roberta\) here: .* from "
                       r"padding_idx \+ 1 = 2"):
        check_model(model)
