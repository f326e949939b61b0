"""transformers' own model families train the same on packd's batches (docs/design.md §17).

One family per run (PACKD_MODEL_FAMILY; one ctest entry each, tests/models/CMakeLists.txt), built
from its config class at a tiny size (2 layers, hidden 32, vocab 128) with random weights, in
float64, no download. For every layout, a random batch of rows holding one or more documents,
left or right padded, is computed twice:

- padded: every document its own row of a padded batch through transformers' eager attention,
  the next-token loss summed over the batch and divided once by its number of targets;
- packed: the same batch through packd's step (pack_micro_batches: several micro-batches, labels
  from packd's shifts, loss_mask on every position that has a next token), each micro-batch
  through attn_implementation="packd_varlen", its summed loss divided by the step's one
  global_loss_tokens, gradients accumulated over the micro-batches.

The logits at every active position, the loss and every parameter's gradient must equal the
padded batch's to 1e-9 relative (a gradient relative to its own largest value, or to 1e-6 of the
model's largest gradient where that is larger: a reference gradient of exactly 0 is rounding's
to compare); a failure names the family, the layout, the seed (PACKD_TEST_SEED replays it) and
the first differing position. Layouts: plain rows, documents (positions reset at each), pad_multiple, context
parallelism (2 ranks) and Ulysses (3 ranks) with every rank's rows gathered as their attention
sees them (ordered by sequence and position), and shared prompts (GRPO groups with their prompt
once: the stream attends through its kv_index, the loss over its targets). The vision-language
family (Qwen2-VL, a one-block vision tower) trains on text and images through the step with its
multimodal positions (mrope), in every layout but shared prompts. The run prints its row of the
table in docs/operation.md (family x layout: the largest relative error of logits, loss and
gradients).
"""
import copy
import os
import random

import pytest
import torch

import packd
from packd.hf import register_varlen_attention, shared_attention_kwargs
from hf_families import (VOCAB, keep_float64, needs_transformers, padded_and_packed, relative,
                         transformers)

FAMILY = os.environ.get("PACKD_MODEL_FAMILY", "llama")
pytestmark = needs_transformers("the PyPI stack's run trains the families")

TOLERANCE = 1e-9

# The families of §17 that transformers runs packed on the CPU (hf_families.FAMILIES; the hybrid
# families refuse packed sequences on the CPU: docs/operation.md).
# Vision-language families: the text model's size as above, a one-block vision tower, their
# special tokens inside the small vocabulary.
IMAGE, VIDEO, START, END = 100, 101, 102, 103
VISION_FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration",
                 dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2,
                      patch_size=2, temporal_patch_size=2, spatial_merge_size=2,
                      in_channels=3)),
}
VISION_LAYOUTS = ("plain", "documents", "pad_multiple", "cp", "ulysses")

# layout: (documents within rows, keyword arguments of the step, ranks to gather or None)
LAYOUTS = {
    "plain": (False, {}, None),
    "documents": (True, {}, None),
    "pad_multiple": (True, {"pad_multiple": 8}, None),
    "cp": (True, {"pad_multiple": 4, "cp_size": 2}, ("cp_rank", 2)),
    "ulysses": (True, {"sp_size": 3}, ("sp_rank", 3)),
    "shared": (False, {}, None),  # GRPO groups with their prompt once (§14)
}
ERRORS = {}  # layout: largest relative error, for the table


@pytest.fixture(scope="module", autouse=True)
def table_row():
    yield
    if ERRORS:
        cells = " | ".join("%.1e" % ERRORS[k] if k in ERRORS else "-" for k in LAYOUTS)
        print("\n| family | %s |\n| %s | %s |" % (" | ".join(LAYOUTS), FAMILY, cells))


@pytest.fixture
def float64_model(monkeypatch):
    keep_float64(monkeypatch, [FAMILY])


def models():
    if FAMILY not in VISION_FAMILIES:
        return padded_and_packed(FAMILY)
    register_varlen_attention()
    config_name, model_name, vision = VISION_FAMILIES[FAMILY]
    config = getattr(transformers, config_name)(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [2, 1, 1]}),
        vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=START, vision_end_token_id=END, bos_token_id=None,
        eos_token_id=None)
    padded = getattr(transformers, model_name)._from_config(
        config, attn_implementation="eager", dtype=torch.float64).eval()
    packed = copy.deepcopy(padded)
    packed.config._attn_implementation = "packd_varlen"
    for sub in ("text_config", "vision_config"):
        getattr(packed.config, sub)._attn_implementation = "packd_varlen"
    return padded, packed


def check(layout, seed, batch, active, got, want, packed, padded):
    """got and want: (logits [B * S, V], loss), compared at the positions `active`. Fails
    naming the family, the layout and the first differing position; records the largest
    relative error for the table."""
    (got_logits, got_loss), (want_logits, want_loss) = got, want
    difference = (got_logits[active] - want_logits[active]).abs().amax(-1)
    scale = want_logits[active].abs().max()
    if not bool((difference <= TOLERANCE * scale).all()):
        first = int(active.nonzero()[int((difference > TOLERANCE * scale).nonzero()[0])])
        pytest.fail("%s, %s (seed %d): the logits at row %d, position %d differ by %.3g"
                    % (FAMILY, layout, seed, first // batch.S, first % batch.S,
                       float(difference.max() / scale)))
    errors = [float(difference.max() / scale), relative(got_loss, want_loss)]
    assert errors[-1] <= TOLERANCE, (FAMILY, layout, seed, "loss", errors[-1])
    # A gradient is compared at its own scale, or at 1e-6 of the model's largest where that is
    # larger: a batch whose every query sees one key gives q_proj a gradient of exactly 0, and
    # the packed model's 1e-16 of rounding there is no difference.
    largest = max(float(q.grad.abs().max()) for q in padded.parameters() if q.grad is not None)
    for (name, p), q in zip(packed.named_parameters(), padded.parameters()):
        if q.grad is None:  # a part of the vision tower no image reached
            assert p.grad is None, (FAMILY, layout, name)
            continue
        scale = max(float(q.grad.abs().max()), 1e-6 * largest, 1e-300)
        errors.append(float((p.grad - q.grad).abs().max()) / scale)
        assert errors[-1] <= TOLERANCE, (FAMILY, layout, seed, "gradient of " + name,
                                         errors[-1])
    ERRORS[layout] = max(errors)


class Batch:
    """B rows of one or more documents, left or right padded: ids, mask, segment ids, the
    documents' flat positions in packed order, and loss_mask (a position with a next token)."""

    def __init__(self, rng, documents, shared=False):
        rows = [[rng.randint(1, 12) for _ in range(rng.randint(1, 3) if documents else 1)]
                for _ in range(rng.randint(3, 5))]
        self.groups = self.prompts = None
        if shared:  # groups of 1 to 3 rows, each row its group's prompt then its response
            self.groups, self.prompts, rows = [], [], []
            for g in range(rng.randint(2, 3)):
                prompt = rng.randint(1, 6)
                for _ in range(rng.randint(1, 3)):
                    self.groups.append(g)
                    self.prompts.append(prompt)
                    rows.append([prompt + rng.randint(1, 8)])
        self.S = S = max(sum(r) for r in rows) + rng.randint(0, 3)
        self.B = B = len(rows)
        self.ids = torch.randint(1, VOCAB, (B, S))
        self.mask = torch.zeros(B, S, dtype=torch.bool)
        self.segments = torch.zeros(B, S, dtype=torch.int32)
        self.loss_mask = torch.zeros(B, S, dtype=torch.bool)
        self.docs = []  # flat positions of each document, in packed order
        self.first_target = []  # of each document: its first predicted token
        for b, lengths in enumerate(rows):
            s = S - sum(lengths) if rng.random() < 0.5 else 0
            for k, n in enumerate(lengths):
                self.mask[b, s:s + n] = True
                self.segments[b, s:s + n] = k
                # Every token but the first is a target; with shared prompts (GRPO), the
                # response's tokens only, which is where loss_mask counts them.
                first = self.prompts[b] if shared else 1
                self.loss_mask[b, s + first:s + n] = True
                self.docs.append(list(range(b * S + s, b * S + s + n)))
                self.first_target.append(first)
                s += n
        if shared:  # each member's prompt is its group's first row's
            first = {}
            for b, g in enumerate(self.groups):
                first.setdefault(g, b)
                a, f = self.mask[b].nonzero()[0, 0], self.mask[first[g]].nonzero()[0, 0]
                self.ids[b, a:a + self.prompts[b]] = self.ids[first[g], f:f + self.prompts[b]]
        self.targets = int(self.loss_mask.sum())

    def model_inputs(self, ids):
        """What the reference model takes besides the documents' ids and mask."""
        return {}

    def reference(self, model):
        """Logits [B * S, V] at every active position (zeros elsewhere) and the loss, each
        document a row of a padded batch through eager attention."""
        flat = self.ids.view(-1)
        width = max(len(d) for d in self.docs)
        ids = torch.zeros(len(self.docs), width, dtype=torch.long)
        mask = torch.zeros(len(self.docs), width, dtype=torch.long)
        for n, d in enumerate(self.docs):
            ids[n, :len(d)] = flat[d]
            mask[n, :len(d)] = 1
        out = model(input_ids=ids, attention_mask=mask, **self.model_inputs(ids)).logits
        logits = torch.zeros(self.B * self.S, out.shape[-1], dtype=out.dtype)
        loss = 0
        for n, d in enumerate(self.docs):
            logits[d] = out[n, :len(d)]
            t = self.first_target[n]
            if len(d) > t:
                loss = loss + torch.nn.functional.cross_entropy(
                    out[n, t - 1:len(d) - 1], ids[n, t:len(d)], reduction="sum")
        return logits, loss / self.targets


def gathered(results):
    """Every rank's rows of one micro-batch, as the attention of the ranks together sees them:
    ordered by sequence (seq_idx), then position (which counts on through padding); a Ulysses
    ghost is the last sequence."""
    cat = lambda f: torch.cat([f(r) for r in results])
    seq, pos = cat(lambda r: r.seq_idx), cat(lambda r: r.position_ids)
    order = torch.argsort(seq * (1 << 32) + pos, stable=True)
    return (cat(lambda r: r.packed[0])[order], cat(lambda r: r.packed[1])[order],
            cat(lambda r: r.shifted[0])[order], pos[order])


def seeded(make_batch):
    """A fresh seed (named in failures), the models, the batch make_batch(rng) builds, and its
    padded reference: (logits, loss) detached, the padded model's gradients accumulated."""
    seed = int(os.environ.get("PACKD_TEST_SEED") or random.randrange(1 << 30))
    rng = random.Random(seed)
    torch.manual_seed(seed)
    padded, packed = models()
    batch = make_batch(rng)
    want_logits, want_loss = batch.reference(padded)
    want_loss.backward()
    return seed, padded, packed, batch, (want_logits.detach(), want_loss.detach())


def rank_steps(client, batch, documents, fields, ranks, layout):
    """The batch's step on every CP or SP rank (one rank without them), each micro-batch's
    inputs the token ids and every row's flat position, labels next tokens: each rank's
    micro-batches. The budget per GPU (a row's length on one rank is 1 / ranks of it) holds the
    longest row, padded, and about half the batch: most batches take two micro-batches or
    more."""
    where = torch.arange(batch.B * batch.S).view(batch.B, batch.S)
    n = ranks[1] if ranks else 1
    longest = int(batch.mask.sum(1).max()) + 3 * 7  # three documents, each padded
    budget = max(-(-longest // n), int(batch.mask.sum()) // (2 * n))
    steps = []
    for rank in range(n):
        rank_fields = dict(fields, **({ranks[0]: rank} if ranks else {}))
        steps.append(
            client.pack_micro_batches([batch.ids, where], batch.mask, budget,
                                      loss_mask=batch.loss_mask,
                                      segment_ids=batch.segments if documents else None,
                                      with_position_ids=True,
                                      layout=packd.Layout(with_seq_idx=True, shifts=[(0, -100)],
                                                          pad_values=[0, -1], **rank_fields)))
    assert steps[0].plan.global_loss_tokens == batch.targets, (FAMILY, layout)
    return [list(s) for s in steps]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_step_trains_as_the_padded_batch(client, layout, float64_model):
    if FAMILY in VISION_FAMILIES:
        if layout not in VISION_LAYOUTS:
            pytest.skip("%s: shared prompts with images are not part of the suite" % FAMILY)
        return check_vision_family(client, layout)
    documents, kwargs, ranks = LAYOUTS[layout]
    seed, padded, packed, batch, (want_logits, want_loss) = seeded(
        lambda rng: Batch(rng, documents, shared=layout == "shared"))
    if layout == "shared":
        kwargs = {"shared_prefix": packd.SharedPrefix(batch.groups, batch.prompts, (0,))}

    micro_batches = rank_steps(client, batch, documents, kwargs, ranks, layout)

    got_logits = torch.zeros_like(want_logits)
    got_loss = 0
    seen = torch.zeros(batch.B * batch.S, dtype=torch.bool)
    for parts in zip(*micro_batches):
        if layout == "shared":  # the stream: its attention metadata, one row per target
            r = parts[0].result
            ids, source, positions = r.packed[0], r.packed[1], r.position_ids
            logits = packed(input_ids=ids[None], position_ids=positions[None],
                            **shared_attention_kwargs(r)).logits[0]
            predicted, labels = logits[r.shared.pred_index], r.shifted[0]
        else:
            ids, source, labels, positions = gathered([mb.result for mb in parts])
            logits = packed(input_ids=ids[None], position_ids=positions[None]).logits[0]
            predicted = logits
        loss = torch.nn.functional.cross_entropy(predicted, labels, ignore_index=-100,
                                                 reduction="sum") / batch.targets
        loss.backward()
        got_loss = got_loss + loss.detach()
        real = source >= 0
        got_logits[source[real]] = logits[real].detach()
        seen[source[real]] = True

    # Every active position; with shared prompts, each member's prompt is its group's first
    # row's, computed once (the reference computes it for every member, the same tokens).
    active = batch.mask.view(-1) & seen
    assert layout == "shared" or bool((active == batch.mask.view(-1)).all()), (FAMILY, layout)
    check(layout, seed, batch, active, (got_logits, got_loss), (want_logits, want_loss), packed,
          padded)


class VisionBatch(Batch):
    """Rows of documents of text and images (vision_start, t x h/2 x w/2 image tokens,
    vision_end), their grids and pixel values in order over the rows."""

    def __init__(self, rng, documents):
        self.grids, self.pixels, self.row_images = [], [], {}
        rows = []
        for _ in range(rng.randint(2, 4)):
            row = []
            for _ in range(rng.randint(1, 2) if documents else 1):
                doc = [rng.randrange(1, IMAGE) for _ in range(rng.randint(1, 4))]
                for _ in range(rng.randint(0 if rows or row else 1, 2)):  # one at least
                    h, w = 2 * rng.randint(1, 2), 2 * rng.randint(1, 3)
                    self.grids.append((1, h, w))
                    self.pixels.append(torch.randn(h * w, 3 * 2 * 2 * 2, dtype=torch.float64))
                    self.row_images.setdefault(len(rows), []).append(len(self.grids) - 1)
                    doc += [START] + [IMAGE] * (h * w // 4) + [END]
                    doc += [rng.randrange(1, IMAGE) for _ in range(rng.randint(0, 3))]
                row.append(doc)
            rows.append(row)
        self.S = S = max(sum(len(d) for d in row) for row in rows) + rng.randint(0, 3)
        self.B = B = len(rows)
        self.ids = torch.zeros(B, S, dtype=torch.long)
        self.mask = torch.zeros(B, S, dtype=torch.bool)
        self.segments = torch.zeros(B, S, dtype=torch.int32)
        self.docs, self.first_target = [], []
        for b, row in enumerate(rows):
            s = S - sum(len(d) for d in row) if rng.random() < 0.5 else 0
            for k, doc in enumerate(row):
                self.ids[b, s:s + len(doc)] = torch.tensor(doc)
                self.mask[b, s:s + len(doc)] = True
                self.segments[b, s:s + len(doc)] = k
                self.docs.append(list(range(b * S + s, b * S + s + len(doc))))
                self.first_target.append(1)
                s += len(doc)
        self.targets = sum(len(d) - 1 for d in self.docs)
        self.vision = self.images_of(range(B))
        self.loss_mask = torch.zeros(B, S, dtype=torch.bool)
        for d in self.docs:
            self.loss_mask.view(-1)[d[1:]] = True

    def images_of(self, rows):
        """The model's vision arguments for rows `rows`, in that order."""
        images = [i for b in rows for i in self.row_images.get(b, [])]
        return dict(pixel_values=torch.cat([self.pixels[i] for i in images]) if images else None,
                    image_grid_thw=torch.tensor([self.grids[i] for i in images])
                    if images else None)

    def model_inputs(self, ids):
        return dict(mm_token_type_ids=(ids == IMAGE).int(), **self.vision)


def check_vision_family(client, layout):
    """The vision-language family: the batch through packd's step with its multimodal positions
    (packd.hf.mrope_of), each micro-batch through the model given [4, 1, rows] position ids and
    its rows' images in order; CP and Ulysses ranks' rows gathered as for the text families;
    the same comparisons."""
    from packd.hf import mrope_of
    documents, kwargs, ranks = LAYOUTS[layout]
    seed, padded, packed, batch, (want_logits, want_loss) = seeded(
        lambda rng: VisionBatch(rng, documents))

    mrope = mrope_of(padded.config, batch.ids, batch.mask, batch.vision["image_grid_thw"])
    micro_batches = rank_steps(client, batch, documents, dict(kwargs, mrope=mrope), ranks, layout)
    got_logits = torch.zeros_like(want_logits)
    got_loss = 0
    for parts in zip(*micro_batches):
        results = [mb.result for mb in parts]
        cat = lambda f: torch.cat([f(r) for r in results], dim=-1)
        text = cat(lambda r: r.position_ids)
        order = torch.argsort(cat(lambda r: r.seq_idx) * (1 << 32) + text, stable=True)
        ids, source = cat(lambda r: r.packed[0])[order], cat(lambda r: r.packed[1])[order]
        labels = cat(lambda r: r.shifted[0])[order]
        positions = torch.cat([text[None], cat(lambda r: r.mrope_position_ids)])[:, order]
        logits = packed(input_ids=ids[None], position_ids=positions[:, None],
                        **batch.images_of(parts[0].samples)).logits[0]
        loss = torch.nn.functional.cross_entropy(
            logits, labels, ignore_index=-100, reduction="sum") / batch.targets
        loss.backward()
        got_loss = got_loss + loss.detach()
        real = source >= 0
        got_logits[source[real]] = logits[real].detach()
    check(layout, seed, batch, batch.mask.view(-1), (got_logits, got_loss),
          (want_logits, want_loss), packed, padded)
