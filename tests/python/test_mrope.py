"""Multimodal rotary positions (docs/design.md §17): for Qwen2-VL, Qwen2.5-VL and Qwen3-VL, a
Pack's mrope_position_ids equal, for every sequence, transformers' own get_rope_index of that
sequence alone, over random batches of images and videos mixed (at least 216 grids a run),
several per row, with documents, left and right padding (vision tokens in the padding too), and
the layouts (padding, CP): each laid-out row holds its token's positions, each pad row its
position id, and the token mask says which is which. Bad grids are refused naming the grid and the row. Without
transformers (Debian 12) the comparisons skip, saying so; the refusals run on both stacks."""
import random
import re
import types

import pytest
import torch

import packd
from packd.hf import mrope_of, mrope_position_ids

import hf_families
from hf_families import transformers

needs_transformers = hf_families.needs_transformers("the PyPI stack's run compares with "
                                                    "get_rope_index")

# family: (config class, model class holding get_rope_index)
FAMILIES = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLModel"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLModel"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLModel"),
}
IMAGE, VIDEO, START, END = 151655, 151656, 151652, 151653


@pytest.fixture(scope="module")
def client(address):
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
        yield c


def family_of(name):
    config_class, model_class = FAMILIES[name]
    config = getattr(transformers, config_class)()
    assert (config.image_token_id, config.video_token_id) == (IMAGE, VIDEO)
    # get_rope_index reads only the config and get_vision_position_ids: no weights needed.
    model = types.SimpleNamespace(config=config)
    cls = getattr(transformers, model_class)
    model.get_vision_position_ids = types.MethodType(cls.get_vision_position_ids, model)
    model.get_rope_index = types.MethodType(cls.get_rope_index, model)
    return config, model


class Document:
    """One sequence: its tokens, its images' and videos' grids, the videos' seconds per grid."""

    def __init__(self, rng, family, merge):
        self.tokens, self.images, self.videos, self.seconds = [], [], [], []
        text = lambda n: [rng.randrange(1, 1000) for _ in range(n)]
        self.tokens += text(rng.randrange(0, 4))
        for _ in range(rng.randrange(0, 4)):
            h, w = merge * rng.randrange(1, 4), merge * rng.randrange(1, 4)
            if rng.random() < 0.5:
                self.images.append((1, h, w))
                self.tokens += [START] + [IMAGE] * (h * w // merge ** 2) + [END]
            else:
                t = rng.randrange(1, 4)
                self.videos.append((t, h, w))
                self.seconds.append(rng.choice([0.5, 1.0, 2 / 3, 1.25, 0.083333]))
                frames = [1] * t if family == "qwen3_vl" else [t]  # Qwen3-VL: timestamps
                for f in frames:
                    if family == "qwen3_vl":
                        self.tokens += text(2)
                    self.tokens += [START] + [VIDEO] * (f * h * w // merge ** 2) + [END]
            self.tokens += text(rng.randrange(0, 4))
        if not self.tokens:
            self.tokens = text(1)

    def reference(self, model, family):
        """[3, len] from transformers' get_rope_index of this document alone."""
        ids = torch.tensor([self.tokens])
        kinds = torch.zeros_like(ids, dtype=torch.int32)
        kinds[ids == IMAGE], kinds[ids == VIDEO] = 1, 2
        extra = {}
        if family == "qwen2_5_vl":
            extra["second_per_grid_ts"] = torch.tensor(self.seconds, dtype=torch.float32)
        positions, _ = model.get_rope_index(
            ids, mm_token_type_ids=kinds,
            image_grid_thw=torch.tensor(self.images) if self.images else None,
            video_grid_thw=torch.tensor(self.videos) if self.videos else None, **extra)
        return positions[:, 0]


def random_batch(rng, family, merge):
    """(ids, mask, segment_ids, documents in packed order) of 1-4 rows of 1-3 documents, padded
    left or right with tokens that include vision ids (which the mask hides)."""
    rows = [[Document(rng, family, merge) for _ in range(rng.randrange(1, 4))]
            for _ in range(rng.randrange(1, 5))]
    width = max(sum(len(d.tokens) for d in row) for row in rows) + rng.randrange(0, 4)
    B = len(rows)
    ids = torch.tensor([[rng.choice([0, IMAGE, VIDEO]) for _ in range(width)]
                        for _ in range(B)])
    mask = torch.zeros(B, width, dtype=torch.bool)
    segments = torch.zeros(B, width, dtype=torch.int32)
    for b, row in enumerate(rows):
        tokens = [t for d in row for t in d.tokens]
        start = width - len(tokens) if rng.random() < 0.5 else 0
        ids[b, start:start + len(tokens)] = torch.tensor(tokens)
        mask[b, start:start + len(tokens)] = True
        s = start
        for k, d in enumerate(row):
            segments[b, s:s + len(d.tokens)] = k
            s += len(d.tokens)
    return ids, mask, segments, [d for row in rows for d in row]


def mrope_of_batch(config, ids, mask, documents, family):
    images = [g for d in documents for g in d.images]
    videos = [g for d in documents for g in d.videos]
    seconds = [s for d in documents for s in d.seconds]
    return mrope_of(config, ids, mask, torch.tensor(images) if images else None,
                    torch.tensor(videos) if videos else None,
                    torch.tensor(seconds, dtype=torch.float32) if seconds else None)


GRIDS_PER_TRIAL = 6  # 3 families x 12 trials: at least 216 grids a run


@needs_transformers
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("trial", range(12))
def test_equals_get_rope_index(client, family, trial):
    """Random batches until GRIDS_PER_TRIAL grids have been compared."""
    rng = random.Random(hash((family, trial)) & 0xFFFF)
    config, model = family_of(family)
    grids = 0
    while grids < GRIDS_PER_TRIAL:
        ids, mask, segments, documents = random_batch(rng, family,
                                                      config.vision_config.spatial_merge_size)
        grids += sum(len(d.images) + len(d.videos) for d in documents)
        check_batch(client, family, model, config, ids, mask, segments, documents)


def check_batch(client, family, model, config, ids, mask, segments, documents):
    mrope = mrope_of_batch(config, ids, mask, documents, family)
    r = client.pack([ids], mask, with_position_ids=True, segment_ids=segments,
                    layout=packd.Layout(mrope=mrope))
    expected = torch.cat([d.reference(model, family) for d in documents], dim=1)
    got = r.mrope_position_ids
    assert got.shape == expected.shape
    if not torch.equal(got, expected):
        k = int((got != expected).any(0).nonzero()[0])
        pytest.fail("%s: mrope position %d of %d is %s, get_rope_index's %s"
                    % (family, k, got.shape[1], got[:, k].tolist(), expected[:, k].tolist()))
    # Text positions restart at every document, as the model's packed-sequence detection reads.
    starts = torch.tensor([0] + [len(d.tokens) for d in documents]).cumsum(0)
    text = torch.cat([torch.arange(int(starts[k + 1] - starts[k]))
                      for k in range(len(documents))])
    assert torch.equal(r.position_ids, text)
    four = mrope_position_ids(r)
    assert four.shape == (4, 1, got.shape[1]) and torch.equal(four[1:, 0], got)


@needs_transformers
@pytest.mark.parametrize("layout", [{"pad_multiple": 8}, {"pad_multiple": 8, "cp_size": 2,
                                                         "cp_rank": 1},
                                    {"sp_size": 3, "sp_rank": 2}, {"fixed": (512, 0, 0)}])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_layouts_keep_each_tokens_positions(client, family, layout):
    rng = random.Random(hash((family, str(layout))) & 0xFFFF)
    config, model = family_of(family)
    ids, mask, segments, documents = random_batch(rng, family,
                                                  config.vision_config.spatial_merge_size)
    mrope = mrope_of_batch(config, ids, mask, documents, family)
    where = torch.arange(mask.numel()).view(mask.shape)  # each position's flat index
    r = client.pack([ids, where], mask, with_position_ids=True, segment_ids=segments,
                    layout=packd.Layout(mrope=mrope, with_token_mask=True, pad_values=[0, -1],
                                        **layout))
    expected = torch.cat([d.reference(model, family) for d in documents], dim=1)
    dense = torch.full([mask.numel()], -1)
    dense[mask.view(-1)] = torch.arange(int(mask.sum()))
    source = r.packed[1]
    assert torch.equal(r.token_mask, (source >= 0).to(torch.uint8))
    real = source >= 0
    assert torch.equal(r.mrope_position_ids[:, real], expected[:, dense[source[real]]])
    pad = r.position_ids[~real]
    assert torch.equal(r.mrope_position_ids[:, ~real], pad.expand(3, -1))


@pytest.mark.parametrize("case, message", [
    ("short", "mrope.grids[0] (t, h, w) = (1, 4, 4) is t * (h / 2) * (w / 2) = 4 vision "
              "tokens; row 1 (active position 2) has 3 image tokens"),
    ("extra_grid", "mrope.grids has 2 grids; the batch's rows have 1 runs of vision tokens"),
    ("no_start", "the image tokens at row 1 (active position 2) do not follow "
                 "vision_start_token_id 7"),
    ("bad_input", "mrope.input 3 names no input"),
    ("float_ids", "inputs[0] (mrope.input).dtype is float32"),
    # A spacing past float32's range (inf, and inf * 0 = NaN for frame 0), and one in range
    # whose last frame lands past 2^52.
    ("inf_spacing", "mrope: video 0 at row 1 (active position 2) spaces its 2 frames by "
                    "tokens_per_second * seconds_per_grid = 1e+300 * 1 positions (float32); "
                    "its last frame's offset is past 2^52"),
    ("far_spacing", "mrope: video 0 at row 1 (active position 2) spaces its 2 frames by "
                    "tokens_per_second * seconds_per_grid = 1e+16 * 1 positions (float32); "
                    "its last frame's offset is past 2^52"),
])
def test_bad_grids_are_refused_naming_grid_and_row(client, case, message):
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 7, 9, 9, 9, 5]])
    mask = torch.ones(2, 6, dtype=torch.bool)
    mrope = packd.MRope(image_token_id=9, video_token_id=10, grids=[(1, 4, 4)],
                        vision_start_token_id=7)
    if case == "extra_grid":
        mrope = packd.MRope(image_token_id=9, video_token_id=10, grids=[(1, 2, 6), (1, 2, 2)])
    elif case == "no_start":
        ids[1, 1] = 8
        mrope = packd.MRope(image_token_id=9, video_token_id=10, grids=[(1, 2, 6)],
                            vision_start_token_id=7)
    elif case == "bad_input":
        mrope = packd.MRope(image_token_id=9, video_token_id=10, grids=[(1, 2, 6)], input=3)
    elif case == "float_ids":
        ids = ids.float()
    elif case in ("inf_spacing", "far_spacing"):
        ids[1] = torch.tensor([1, 7, 10, 10, 5, 6])
        mrope = packd.MRope(image_token_id=9, video_token_id=10, grids=[(2, 2, 2)],
                            tokens_per_second=1e300 if case == "inf_spacing" else 1e16,
                            seconds_per_grid=[1.0])
    with pytest.raises(packd.PackdValueError, match=re.escape(message)):
        client.pack([ids], mask, layout=packd.Layout(mrope=mrope))
    # The server keeps serving: the same batch with a matching grid packs.
    good = packd.MRope(image_token_id=9, video_token_id=10, grids=[(1, 2, 6)])
    r = client.pack([torch.tensor([[1, 2, 3, 4, 5, 6], [1, 7, 9, 9, 9, 5]])], mask,
                    layout=packd.Layout(mrope=good))
    assert r.mrope_position_ids[:, 6:].tolist() == [[0, 1, 2, 2, 2, 5], [0, 1, 2, 2, 2, 5],
                                                    [0, 1, 2, 3, 4, 5]]


def test_token_mask_without_a_layout_is_all_ones_and_its_layout_inverts_the_pack(client):
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    x = torch.randn(2, 3, 4)
    layout = packd.Layout(with_token_mask=True)
    r = client.pack(x, mask, layout=layout)
    assert r.token_mask.dtype == torch.uint8 and r.token_mask.tolist() == [1, 1, 1, 1]
    # Scatter reads the fields that place rows: the token mask is what else the Pack returned.
    back = client.scatter(r.packed, mask, layout=layout)
    assert torch.equal(back[mask], x[mask]) and not back[~mask].any()
    request = packd.v1.pack_service_pb2.ScatterRequest()
    layout.to_scatter(request)
    assert request == packd.v1.pack_service_pb2.ScatterRequest()


@needs_transformers
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("layout", [{}, {"pad_multiple": 4, "cp_size": 2, "cp_rank": 1}])
def test_a_step_hands_each_micro_batch_its_rows_grids(client, family, layout):
    """A training step with mrope: every micro-batch's positions are get_rope_index's of its
    rows' documents (in the plan's order of rows), from the batch's grids."""
    rng = random.Random(hash((family, str(layout), "step")) & 0xFFFF)
    config, model = family_of(family)
    batches = []
    while len(batches) < 2:  # a batch the budget splits: the longest row, padded, per budget
        ids, mask, segments, documents = random_batch(rng, family,
                                                      config.vision_config.spatial_merge_size)
        mrope = mrope_of_batch(config, ids, mask, documents, family)
        where = torch.arange(mask.numel()).view(mask.shape)
        budget = int(mask.sum(1).max()) + 16
        plan = client.pack_micro_batches([ids, where], mask, budget, segment_ids=segments,
                                         with_position_ids=True,
                                         layout=packd.Layout(with_token_mask=True, mrope=mrope,
                                                             pad_values=[0, -1], **layout))
        batches = list(plan)
    of_row, k = [], 0  # each row's documents
    for b in range(ids.shape[0]):
        count = len(set(segments[b][mask[b]].tolist()))
        of_row.append(documents[k:k + count])
        k += count
    for mb in batches:
        expected = torch.cat([d.reference(model, family) for b in mb.samples for d in of_row[b]],
                             dim=1)
        r = mb.result
        if not layout:
            assert torch.equal(r.mrope_position_ids, expected), (family, mb.samples)
            continue
        # CP: this rank's rows; each token's positions are its own, by its flat index.
        order = torch.full([mask.numel()], -1)
        flat = torch.cat([where[b][mask[b]] for b in mb.samples])
        order[flat] = torch.arange(len(flat))
        source = r.packed[1]
        real = source >= 0
        assert torch.equal(r.token_mask, real.to(torch.uint8))
        assert torch.equal(r.mrope_position_ids[:, real], expected[:, order[source[real]]])


def test_a_step_names_the_grid_that_does_not_match(client):
    mask = torch.ones(2, 6, dtype=torch.bool)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [1, 7, 9, 9, 9, 5]])
    mrope = packd.MRope(image_token_id=9, video_token_id=10, grids=[(1, 2, 4)])
    with pytest.raises(packd.PackdValueError,
                       match=re.escape("batch.mrope.grids[0] (t, h, w) = (1, 2, 4) is")):
        list(client.pack_micro_batches([ids], mask, 16, layout=packd.Layout(mrope=mrope)))
    plan = client.pack_micro_batches([ids], mask, 16,
                                     layout=packd.Layout(with_token_mask=True, pad_multiple=4))
    results = [mb.result for mb in plan]
    assert [r.token_mask.tolist() for r in results] == [[1] * 6 + [0, 0] + [1] * 6 + [0, 0]]
