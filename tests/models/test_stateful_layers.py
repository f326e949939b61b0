"""Each kind of layer that carries state across tokens (or whose indexer picks keys across them),
on a packed row, equals the layer run on each document alone (packd/integrations/stateful.py: every
document from a zero state): the logits at every token and every parameter's gradient of a
weighted sum of them, documents of 1, 2, 63, 64, 65 and 300 tokens (around the chunk sizes of
the chunked scans, 64), in float64 (1e-9 relative; 1e-7 for the gradients of DeepSeek's
query path, QUERY_PATH) and float32 (1e-4 for the logits, 1e-3 for a gradient: the padded
documents' batched arithmetic against each document's own, and a parameter every token
reaches, such as DeepSeek V4's hyper-connection head, sums some 700 terms that cancel). The
layer kind runs inside the tiny model of a family that has it (survey.tiny_model). The same
row through transformers' eager attention (its 4-D mask cut per document) in float64.

Beside it, transformers' own packed path (position ids restarting at every document, its
eager attention, no packd) on the same row: the test prints whether it leaks state across the
documents (its logits differ from the documents alone) or refuses, the fact docs/operation.md
records."""
import copy
import os
import random
import re
import zlib

import pytest
import torch

import packd
from hf_families import Float64Steps, keep_float64
from packd.hf import packed_row, register_varlen_attention
from packd.integrations.stateful import bound_states, stateful_layers
from survey import VOCAB, logits_and_grads, packed_and_alone, tiny_model, transformers

pytestmark = pytest.mark.skipif(transformers is None, reason="transformers is not installed "
                                "(Debian 12 has no package of it); the PyPI stack's run tests")

# The layer kind: (a model type that has it, its layer class).
KINDS = {
    "gated delta rule + short convolution": ("qwen3_5_text", "Qwen3_5GatedDeltaNet"),
    "Mamba 1 scan": ("mamba", "MambaMixer"),
    "Mamba 2 scan": ("falcon_h1", "FalconH1Mixer"),
    "Mamba 2 scan (Nemotron-H)": ("nemotron_h", "NemotronHMamba2Mixer"),
    "short convolution": ("lfm3", "Lfm3ShortConv"),
    "lightning attention": ("minimax", "MiniMaxLightningAttention"),
    "RG-LRU recurrence + convolution": ("recurrent_gemma", "RecurrentGemmaRecurrentBlock"),
    "Kimi delta attention": ("kimi_linear", "KimiLinearDeltaAttention"),
    "indexed top-k attention (4 keys)": ("deepseek_v32", "DeepseekV32Attention"),
    "compressed sparse attention (blocks of 4 and 16)": ("deepseek_v4", "DeepseekV4Attention"),
}
LENGTHS = [1, 2, 63, 64, 65, 300]
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}  # logits
GRADIENT_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3}
# DeepSeek's latent attention: its query path's gradients are the small remainder of terms that
# cancel (a fresh model attends almost uniformly), so float64 rounding alone moves them: the
# same model on the same 300 tokens, transformers alone, differs by up to 1.3e-8 there between
# one thread and two (every other parameter by 0). Those parameters are held to 1e-7 in float64.
QUERY_PATH = re.compile(r"\.q_(a_proj|a_layernorm|b_proj)\.")
LEAKS = {}


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    if LEAKS:
        print("\n| layer kind | transformers alone, packed (eager, position ids) |\n| --- | --- |")
        for kind, what in LEAKS.items():
            print("| %s | %s |" % (kind, what))


def relative(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def seeded(kind, test):
    """A fixed seed per test and layer kind, printed (PACKD_TEST_SEED adds to it, to try
    others): torch's global generator is seeded with it; returns a random.Random of it."""
    seed = (zlib.crc32(("%s/%s" % (test, kind)).encode())
            + int(os.environ.get("PACKD_TEST_SEED", "0"))) % (1 << 31)
    print("\n%s [%s]: seed %d" % (test, kind, seed))
    torch.manual_seed(seed)
    return random.Random(seed)


def gradient_tolerance(name, dtype):
    if dtype == torch.float64 and QUERY_PATH.search(name):
        return 1e-7
    return GRADIENT_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_each_document_its_own_state(client, kind, dtype, monkeypatch):
    # transformers' float32 steps (norms, scores, the reference's eager softmax) kept in float64
    # for a float64 model.
    if dtype == torch.float64:
        keep_float64(monkeypatch, [])
    with Float64Steps().kept(dtype == torch.float64):
        each_document_its_own_state(client, kind, dtype)


def each_document_its_own_state(client, kind, dtype, attention="packd_varlen"):
    model_type, layer_class = KINDS[kind]
    register_varlen_attention()
    rng = seeded(kind, "each document its own state, %s, %s" % (dtype, attention))
    model = tiny_model(model_type, "eager").to(dtype)
    assert layer_class in {type(m).__name__ for _, m in stateful_layers(model)}
    plain = copy.deepcopy(model)  # transformers alone, no packd: the reference
    documents = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in LENGTHS]
    row = torch.tensor([t for d in documents for t in d])[None]
    segments = torch.tensor([i for i, d in enumerate(documents) for _ in d])[None]
    r = client.pack([row], torch.ones_like(row, dtype=torch.bool), segment_ids=segments,
                    with_position_ids=True)
    weights = torch.randn(row.shape[1], model.config.vocab_size, dtype=dtype)

    model.set_attn_implementation(attention)
    # Each document alone: its logits, and the sum of the documents' gradients.
    (got, got_grads), (want, want_grads) = packed_and_alone(model, plain, r, documents, weights)
    tolerance = TOLERANCE[dtype]
    assert relative(got, want) <= tolerance, (kind, relative(got, want))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, g, w in zip(names, got_grads, want_grads):
        if w.abs().max() > 0:
            assert relative(g, w) <= gradient_tolerance(name, dtype), (kind, name,
                                                                       relative(g, w))

    if dtype == torch.float64 and attention == "packd_varlen":
        try:
            with torch.no_grad():
                alone = plain(input_ids=r.packed[0][None], use_cache=False,
                              position_ids=r.position_ids.long()[None]).logits[0]
            error = relative(alone, want)
            LEAKS[kind] = ("leaks: %.2g relative, from token %d" % (
                error, int(((alone - want).abs().amax(-1) > 1e-9 * want.abs().max())
                           .nonzero()[0])) if error > 1e-9 else "equal (%.1e)" % error)
        except Exception as e:  # noqa: BLE001 - what transformers does is the record
            LEAKS[kind] = "raises %s: %s" % (type(e).__name__, str(e).splitlines()[0][:160])


@pytest.mark.parametrize("pad_multiple", [0, 16], ids=["unpadded", "pad_multiple"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_row_of_one_document(client, kind, pad_multiple, monkeypatch):
    """A packed row that holds one document (a micro-batch of one long rollout), padded to a
    multiple or not, runs every stateful layer as the document alone: the logits of its
    tokens and every gradient, float64, to 1e-9 (transformers' own CPU scans raise when the
    row's cu_seq_lens reach them)."""
    model_type, _ = KINDS[kind]
    register_varlen_attention()
    keep_float64(monkeypatch, [])  # the reference's eager softmax in float64 too
    seeded(kind, "a row of one document, %s" % pad_multiple)
    with Float64Steps().kept():
        model = tiny_model(model_type, "eager").to(torch.float64)
        alone = copy.deepcopy(model)  # transformers alone, no packd
        model.set_attn_implementation("packd_varlen")
        document = torch.randint(4, VOCAB, (1, 37))
        r = client.pack([document], torch.ones_like(document, dtype=torch.bool),
                        with_position_ids=True, layout=packd.Layout(pad_multiple=pad_multiple))
        assert r.packed[0].numel() == (48 if pad_multiple else 37)
        weights = torch.randn(r.packed[0].numel(), model.config.vocab_size, dtype=torch.float64)
        weights[37:] = 0  # the padding's logits weigh nothing
        with packed_row(r, model) as kwargs:
            got, got_grads = logits_and_grads(model, weights, input_ids=r.packed[0][None],
                                              **kwargs)
        want, want_grads = logits_and_grads(alone, weights[:37], input_ids=document,
                                            use_cache=False)
    assert relative(got[:37], want) <= 1e-9, (kind, relative(got[:37], want))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, g, w in zip(names, got_grads, want_grads):
        if w.abs().max() > 0:
            assert relative(g, w) <= gradient_tolerance(name, torch.float64), (kind, name)


@pytest.mark.parametrize("kind", list(KINDS))
def test_eager_attention_its_mask_cut_per_document(client, kind, monkeypatch):
    """The same row through transformers' eager attention (its block-diagonal [1, 1, T, T] mask,
    found from the position ids) in float64: a layer that runs per document under an attention
    mask gets its documents' blocks of that mask (packd.integrations.stateful._padded_mask), and
    the logits and gradients equal the documents alone as through packd_varlen. transformers' eager softmax
    kept in float64 (its float32 sums round apart over the padded rows and each document)."""
    import packd.integrations.stateful as stateful
    cut, padded_mask = [], stateful._padded_mask

    def spy(layer, mask, *args):
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            cut.append(type(layer).__name__)
        return padded_mask(layer, mask, *args)

    monkeypatch.setattr(stateful, "_padded_mask", spy)
    keep_float64(monkeypatch, [])
    with Float64Steps().kept():
        each_document_its_own_state(client, kind, torch.float64, attention="eager")
    # The attentions that mix tokens besides attending, and RecurrentGemma's block, take the
    # mask; the other scans take none.
    assert bool(cut) == (kind in MASKED), (kind, cut)


@pytest.mark.parametrize("kind", ["indexed top-k attention (4 keys)",
                                  "compressed sparse attention (blocks of 4 and 16)"])
def test_the_per_document_eager_attention_changes_no_shared_config(client, kind):
    """A layer whose documents run through transformers' eager attention sees "eager" through
    its own view of the config (packd.integrations.stateful.LayerConfig) for that call only;
    the model's config, which every other layer reads, stays packd_varlen throughout."""
    model_type, layer_class = KINDS[kind]
    register_varlen_attention()
    seeded(kind, "no shared config changed")
    model = tiny_model(model_type, "eager")
    model.set_attn_implementation("packd_varlen")
    bound_states(model)
    layers = [m for _, m in stateful_layers(model) if type(m).__name__ == layer_class]
    seen = []

    def look(module, args, kwargs):
        seen.append((layers[0].config._attn_implementation, model.config._attn_implementation))

    first_child = next(layers[0].children())
    first_child.register_forward_pre_hook(look, with_kwargs=True)
    row = torch.randint(4, VOCAB, (1, 20))
    r = client.pack([row], torch.ones_like(row, dtype=torch.bool), with_position_ids=True,
                    segment_ids=torch.tensor([[0] * 8 + [1] * 12]))
    with torch.no_grad(), packed_row(r, model) as kwargs:
        model(input_ids=r.packed[0][None], **kwargs)
    assert seen and set(seen) == {("eager", "packd_varlen")}, seen
    assert layers[0].config._attn_implementation == "packd_varlen"


# The kinds whose per-document layer takes transformers' attention mask.
MASKED = {"indexed top-k attention (4 keys)", "compressed sparse attention (blocks of 4 and 16)",
          "RG-LRU recurrence + convolution"}


# A GRPO group: its prompt and its responses, of lengths around the chunk size.
PROMPT, RESPONSES = 63, [1, 2, 64, 65]


@pytest.mark.parametrize("kind", list(KINDS))
def test_shared_prompts_each_response_from_its_prompt(client, kind, monkeypatch):
    """A shared prompts' stream (packd.hf.shared_attention_kwargs: the prompt once, each
    response attending it): each response's logits and every parameter's gradient equal its
    prompt and response run alone, the prompt's logits its own, in float64 (1e-9; QUERY_PATH's
    gradients 1e-7). A stateful layer runs each response from the start of its prompt (the
    prompt computed again in that layer for each member, as the unshared batch does, an
    indexed or compressed attention too); attention layers read the prompt's keys once.
    transformers' eager softmax kept in float64: in float32 its sums over the stream's padded
    rows and over each member alone round apart (6e-8 in the indexed families' gradients)."""
    keep_float64(monkeypatch, [])
    with Float64Steps().kept():
        shared_prompts(client, kind)


def shared_prompts(client, kind):
    from packd.hf import shared_attention_kwargs
    model_type, layer_class = KINDS[kind]
    register_varlen_attention()
    rng = seeded(kind, "shared prompts")
    model = tiny_model(model_type, "eager")
    plain = copy.deepcopy(model)  # transformers alone, no packd: the reference
    prompt = [rng.randrange(4, VOCAB) for _ in range(PROMPT)]
    members = [prompt + [rng.randrange(4, VOCAB) for _ in range(n)] for n in RESPONSES]
    width = max(len(m) for m in members)
    ids = torch.zeros(len(members), width, dtype=torch.long)
    mask = torch.zeros(len(members), width, dtype=torch.bool)
    for b, m in enumerate(members):
        ids[b, :len(m)], mask[b, :len(m)] = torch.tensor(m), True
    r = client.pack([ids], mask, with_position_ids=True, layout=packd.Layout(
        shared_prefix=packd.SharedPrefix([0] * len(members), [PROMPT] * len(members))))
    # The stream's rows: the prompt once, then each response; their tokens of the batch.
    stream = r.packed[0]
    assert len(stream) == PROMPT + sum(RESPONSES)
    weights = torch.randn(len(stream), model.config.vocab_size, dtype=torch.float64)

    model.set_attn_implementation("packd_varlen")
    assert bound_states(model)  # as packd.trl does (packed_row refuses a shared stream)
    got, got_grads = logits_and_grads(model, weights, input_ids=stream[None],
                                      position_ids=r.position_ids.long()[None], use_cache=False,
                                      **shared_attention_kwargs(r))
    # Alone: the prompt, and each member (its prompt's logits weighted zero, as the stream
    # holds them once).
    want = torch.zeros_like(got)
    want_grads = None
    start = PROMPT
    calls = [(prompt, weights[:PROMPT], slice(0, PROMPT), slice(0, PROMPT))]
    for m, n in zip(members, RESPONSES):
        w = torch.cat([torch.zeros(PROMPT, weights.shape[1], dtype=weights.dtype),
                       weights[start:start + n]])
        calls.append((m, w, slice(start, start + n), slice(PROMPT, PROMPT + n)))
        start += n
    for tokens, w, into, part in calls:
        logits, grads = logits_and_grads(plain, w, input_ids=torch.tensor(tokens)[None],
                                         use_cache=False)
        want[into] = logits[part]
        want_grads = grads if want_grads is None else [a + b for a, b in zip(want_grads, grads)]
    assert relative(got, want) <= 1e-9, (kind, relative(got, want))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, g, w in zip(names, got_grads, want_grads):
        if w.abs().max() > 0:
            assert relative(g, w) <= gradient_tolerance(name, torch.float64), (
                kind, name, relative(g, w))



def test_length_groups_pad_no_document_past_twice_its_length():
    """The row's documents run in groups of similar length
    (packd.integrations.stateful._length_groups): every document in exactly one group, in the row's order within it, padded to at most twice
    its length (or the chunked scans' chunk); documents of one length are one group. (The
    tests above run documents of 1 to 300 tokens as three groups.)"""
    from packd.integrations.stateful import _GROUP_FLOOR, _length_groups
    rng = seeded("", "length groups")
    for _ in range(500):
        lengths = [rng.randrange(1, rng.choice([70, 3000])) for _ in range(rng.randrange(1, 40))]
        groups = _length_groups(lengths)
        assert sorted(d for g in groups for d in g) == list(range(len(lengths)))
        for g in groups:
            assert g == sorted(g)
            longest = max(lengths[d] for d in g)
            assert all(longest <= max(2 * lengths[d], _GROUP_FLOOR) for d in g), (lengths, g)
    assert _length_groups([300] * 8) == [list(range(8))]
    assert _length_groups([1, 2, 63, 64, 65, 300]) == [[5], [2, 3, 4], [0, 1]]
