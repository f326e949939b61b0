"""packd_varlen is never wrong without an error (docs/operation.md, "Every causal-LM type").

Every causal-LM model type of the pinned transformers (survey.causal_lm_types) is built at a tiny
size from its config class (survey.tiny_model: random weights, float64, no download, sliding
windows and chunks of 4 tokens) and runs one batch of 3 documents of 5 to 12 tokens two ways:

- padded: each document its own row of a right-padded batch with its attention mask, through
  transformers' own eager attention;
- packed: the documents packed by packd into one row (segment ids: position ids restart at
  every document), through attn_implementation="packd_varlen" inside packd.hf.packed_row, once
  with the position ids alone (the sequences reach packd_varlen through transformers' mask, the
  path of families whose layers drop the position ids) and once with transformers'
  flash-attention kwargs too (cu_seq_lens_q / _k, max_length_q / _k).

Each type's result is one of: equal (the logits at every token ≤ 1e-9 relative, both ways),
refused (an error before any logits that says packd_varlen cannot serve the family or names
the module and the option; any other exception fails the test: a crash is not a refusal), or not
built (the type cannot be made at all on the CPU from its config:
the reason shown). A type whose packed logits differ without an error fails the test. The
session prints the table (type, result, reason) and the counts; docs/operation.md keeps them."""
import collections
import copy
import random

import pytest
import torch

from packd.integrations import documents as _varlen
from packd.integrations.stateful import stateful_layers
from packd.hf import packed_row, register_varlen_attention
from hf_families import Float64Steps, keep_float64
from survey import VOCAB, causal_lm_types, logits_of, packed_and_alone, tiny_model, transformers

pytestmark = pytest.mark.skipif(transformers is None, reason="transformers is not installed "
                                "(Debian 12 has no package of it); the PyPI stack's run surveys")

TOLERANCE = 1e-9
if transformers is not None:
    transformers.logging.set_verbosity_error()  # the tiny configs' warnings
RESULTS = collections.OrderedDict()  # type: (result, reason)


@pytest.fixture(scope="module", autouse=True)
def table():
    yield
    if not RESULTS:
        return
    print("\n| type | result | reason |\n| --- | --- | --- |")
    for kind, (result, reason) in RESULTS.items():
        print("| %s | %s | %s |" % (kind, result, reason.replace("|", "/")))
    counts = collections.Counter(result for result, _ in RESULTS.values())
    print("survey: " + ", ".join("%d %s" % (n, r) for r, n in sorted(counts.items())))


@pytest.fixture
def float64_steps(monkeypatch):
    """transformers' eager softmax kept in float64 for float64 scores (keep_float64); and,
    through the returned Float64Steps' `.kept()`, its other float32 steps (the models are
    float64 through: survey.tiny_model). Both ways of a type run under the same steps, so that
    the padded reference is float64 through where the family allows it (a family that keeps
    modules in float32 does not: it runs without `.kept()`)."""
    keep_float64(monkeypatch, [])  # the softmax alone (a function or a tensor's method)
    return Float64Steps()


def first_line(error):
    text = str(error).strip().splitlines()
    return "%s: %s" % (type(error).__name__, text[0][:300] if text else "")



@pytest.mark.parametrize("kind", causal_lm_types())
def test_packed_equals_padded_or_is_refused(client, kind, float64_steps):
    register_varlen_attention()
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    torch.manual_seed(seed)
    try:
        padded = tiny_model(kind, "eager")
    except Exception as e:
        RESULTS[kind] = ("not built", first_line(e))
        pytest.skip("%s cannot be built on the CPU from its config: %s" % (kind, first_line(e)))
    lengths = [rng.randint(5, 12) for _ in range(3)]
    # Token ids clear of the type's special ids (a pad id would move a family's positions).
    special = set()
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(padded.config, name, None)
        special.update(value if isinstance(value, (list, tuple)) else [value])
    tokens = [t for t in range(4, VOCAB) if t not in special]
    documents = [[rng.choice(tokens) for _ in range(n)] for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(documents), width, dtype=torch.long)
    attention = torch.zeros(len(documents), width, dtype=torch.long)
    for b, d in enumerate(documents):
        ids[b, :len(d)] = torch.tensor(d)
        attention[b, :len(d)] = 1
    kept = True
    try:
        with torch.no_grad(), float64_steps.kept():
            want = logits_of(padded(input_ids=ids, attention_mask=attention, use_cache=False))
    except Exception:  # a family that keeps modules in float32: its float32 steps stay
        kept = False
        try:
            with torch.no_grad():
                want = logits_of(padded(input_ids=ids, attention_mask=attention,
                                        use_cache=False))
        except Exception as e:
            RESULTS[kind] = ("not built", "its eager forward fails on the CPU: " + first_line(e))
            pytest.skip("%s does not run on the CPU: %s" % (kind, first_line(e)))
    want = torch.cat([want[b, :n] for b, n in enumerate(lengths)])

    # One row: the documents by segment ids, packed by packd.
    row = torch.tensor([t for d in documents for t in d])[None]
    segments = torch.tensor([i for i, n in enumerate(lengths) for _ in range(n)])[None]
    r = client.pack([row], torch.ones_like(row, dtype=torch.bool), segment_ids=segments,
                    with_position_ids=True)
    assert r.doc_cu_seqlens.tolist() == [0] + list(torch.tensor(lengths).cumsum(0).tolist())
    packed = copy.deepcopy(padded)
    try:
        packed.set_attn_implementation("packd_varlen")
        errors, sources = [], set()
        for way in ("position ids", "kwargs"):
            with torch.no_grad(), float64_steps.kept(kept), packed_row(r, packed) as kwargs:
                if way == "position ids":
                    kwargs = {"position_ids": kwargs["position_ids"], "use_cache": False}
                got = logits_of(packed(input_ids=r.packed[0][None], **kwargs))[0]
                if way == "position ids":
                    sources.update(_varlen.declaration().sources)
            scale = want.abs().max()
            error = float((got - want).abs().max() / scale)
            errors.append(error)
            if not error <= TOLERANCE:
                first = int(((got - want).abs().amax(-1) > TOLERANCE * scale).nonzero()[0])
                RESULTS[kind] = ("DIFFERENT", "%s: %.2g relative, first at token %d"
                                 % (way, error, first))
                pytest.fail("%s (seed %d): packd_varlen through %s differs from eager on the "
                            "padded documents by %.3g relative, first at token %d of %s"
                            % (kind, seed, way, error, first, lengths))
    except Exception as e:
        if isinstance(e, pytest.fail.Exception):
            raise
        if "packd_varlen" not in str(e):  # a crash is not a refusal
            RESULTS[kind] = ("UNCLEAR ERROR", first_line(e))
            raise
        RESULTS[kind] = ("refused", first_line(e))
        return
    stateful = ""
    if stateful_layers(packed):
        stateful = stateful_documents(client, padded, packed, rng, tokens, float64_steps, kept,
                                      kind)
    RESULTS[kind] = ("equal", "%.1e, by %s%s%s" % (max(errors), " and ".join(sorted(sources)),
                                                   "" if kept else
                                            " (the family keeps modules in float32: its float32 "
                                            "steps left as they are)", stateful))


def stateful_documents(client, padded, packed, rng, tokens, float64_steps, kept, kind):
    """A family with layers that carry state (packd/integrations/stateful.py), again on documents
    around the chunked scans' chunk size (2, 63 and 65 tokens): its logits and every parameter's
    gradient of a weighted sum of them, packed, equal each document alone (the padded model,
    one document per call) to 1e-9; and transformers alone on the packed row (position ids
    restarting, no packd): whether its state leaks across the documents. The reason's tail."""
    documents = [[rng.choice(tokens) for _ in range(n)] for n in (2, 63, 65)]
    row = torch.tensor([t for d in documents for t in d])[None]
    segments = torch.tensor([i for i, d in enumerate(documents) for _ in d])[None]
    r = client.pack([row], torch.ones_like(row, dtype=torch.bool), segment_ids=segments,
                    with_position_ids=True)
    weights = torch.randn(row.shape[1], padded.config.vocab_size, dtype=torch.float64)
    names = [n for n, p in packed.named_parameters() if p.requires_grad]
    with float64_steps.kept(kept):
        (got, got_grads), (want, want_grads) = packed_and_alone(packed, padded, r, documents,
                                                                weights)
        worst = float((got - want).abs().max() / want.abs().max())
        for name, g, w in zip(names, got_grads, want_grads):
            if w.abs().max() > 0:
                worst = max(worst, float((g - w).abs().max() / w.abs().max()))
        if not worst <= TOLERANCE:
            RESULTS[kind] = ("DIFFERENT", "stateful layers on documents of 2, 63 and 65 tokens: "
                             "%.2g relative (logits or a gradient)" % worst)
            pytest.fail("%s: packed logits or gradients differ from each document alone by %.3g"
                        % (kind, worst))
        try:
            with torch.no_grad():
                alone = logits_of(padded(input_ids=r.packed[0][None], use_cache=False,
                                         position_ids=r.position_ids.long()[None]))[0]
            leak = float((alone - want).abs().max() / want.abs().max())
            alone = ("leaks %.2g" % leak) if leak > TOLERANCE else "does not leak"
        except Exception as e:  # noqa: BLE001 - what transformers does is the record
            alone = "raises %s" % type(e).__name__
    return ("; stateful layers (%s): logits and gradients on documents of 2, 63 and 65 tokens "
            "%.1e; transformers alone %s" % (", ".join(sorted({type(m).__name__ for _, m in
                                                               stateful_layers(packed)})),
                                             worst, alone))
