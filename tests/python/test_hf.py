"""packd.hf.DataCollatorWithFlattening side by side with transformers' own (the PyPI stack's
release, deploy/pypi-constraints.txt): on the same features, every argument in the constructor
and in the call, both return_tensors forms, features as lists, tensors and numpy arrays, empty
ones among them, the outputs equal key for key, dtype and value; the cases transformers' own
tests use; the flash-attention kwargs transformers' models derive from position_ids
(prepare_fa_kwargs_from_position_ids) equal to what packd returns; and the one difference, on
purpose, asserted by name. Then packd's extensions (pad_multiple, cp_size) against packd's own
layout, and bad features. Debian 12 has no transformers: there the comparisons skip, saying so."""
import copy
import random

import numpy
import pytest
import torch

import hf_families
import packd
from packd.hf import DataCollatorWithFlattening

try:
    from transformers import DataCollatorWithFlattening as TransformersCollator
    from transformers.modeling_flash_attention_utils import (_is_packed_sequence,
                                                             prepare_fa_kwargs_from_position_ids)
except ImportError:  # Debian's stack: the tests that need them skip (needs_transformers)
    pass

needs_transformers = hf_families.needs_transformers("the PyPI stack's run compares packd with "
                                                    "it")


@pytest.fixture(scope="module")
def client(address):
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
        yield c


def random_features(rng, with_labels, form="list", empty=False):
    """1 to 8 features of 1 to 70 tokens (some of none with empty=), as lists, torch tensors or
    numpy arrays."""
    features = []
    for _ in range(rng.randint(1, 8)):
        n = 0 if empty and rng.random() < 0.25 else rng.randint(1, 70)
        f = {"input_ids": [rng.randint(0, 50000) for _ in range(n)]}
        if with_labels:
            f["labels"] = [rng.choice([-100, rng.randint(0, 50000)]) for _ in range(n)]
        features.append(f)
    if all(len(f["input_ids"]) == 0 for f in features):
        features[0] = {k: [1, 2] for k in features[0]}
    convert = {"list": lambda v: v, "pt": torch.tensor, "np": numpy.array}[form]
    return [{k: convert(v) for k, v in f.items()} for f in features]


def same_batch(got, want):
    assert list(got) == list(want)
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert isinstance(got[k], torch.Tensor), k
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        elif isinstance(want[k], numpy.ndarray):
            assert isinstance(got[k], numpy.ndarray), k
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert numpy.array_equal(got[k], want[k]), k
        else:
            assert type(got[k]) is type(want[k]) and got[k] == want[k], k


def both(client, features, call=None, **kwargs):
    """packd's and transformers' collators with the same arguments, on copies of the same
    features: (packd's batch, transformers' batch)."""
    call = call or {}
    got = DataCollatorWithFlattening(client=client, **kwargs)(copy.deepcopy(features), **call)
    want = TransformersCollator(**kwargs)(copy.deepcopy(features), **call)
    return got, want


@needs_transformers
@pytest.mark.parametrize("trial", range(24))
@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_equals_transformers(client, trial, return_tensors):
    rng = random.Random()
    kwargs = {"return_position_ids": trial % 2 == 0,
              "return_flash_attn_kwargs": trial % 4 < 2, "return_seq_idx": trial % 8 < 4,
              "position_ids_start": rng.choice([0, 0, 2])}
    separator = rng.choice([-100, 0, 7])
    call = {}
    if trial % 3:  # return_tensors and separator_id in the constructor, else in the call
        kwargs.update(return_tensors=return_tensors, separator_id=separator)
    else:
        call.update(return_tensors=return_tensors, separator_id=separator)
    features = random_features(rng, with_labels=trial % 3 == 0,
                               form=("list", "pt", "np")[trial % 3], empty=trial % 5 == 0)
    got, want = both(client, features, call, **kwargs)
    same_batch(got, want)


@needs_transformers
@pytest.mark.parametrize("return_tensors", ["pt", "np"])
@pytest.mark.parametrize("options", [
    {}, {"return_flash_attn_kwargs": True}, {"return_seq_idx": True},
    {"return_position_ids": False}, {"return_flash_attn_kwargs": True, "return_seq_idx": True}])
def test_transformers_own_cases(client, return_tensors, options):
    """The cases of transformers' own tests of the collator: three sequences of 3, 6 and 7
    tokens; labels as tensors and as lists; neither collator changes its input."""
    plain = [{"input_ids": [10, 11, 12]}, {"input_ids": [20, 21, 22, 23, 24, 25]},
             {"input_ids": [30, 31, 32, 33, 34, 35, 36]}]
    tensor_labels = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor([10, 11, 12])},
                     {"input_ids": torch.tensor([4, 5]), "labels": torch.tensor([13, 14])}]
    list_labels = [{"input_ids": [1, 2, 3], "labels": [10, 11, 12]},
                   {"input_ids": [4, 5], "labels": [13, 14]}]
    for features in (plain, tensor_labels, list_labels):
        before = copy.deepcopy(features)
        got = DataCollatorWithFlattening(client=client, return_tensors=return_tensors,
                                         **options)(features)
        want = TransformersCollator(return_tensors=return_tensors, **options)(features)
        same_batch(got, want)
        for f, g in zip(features, before):  # immutability
            assert list(f) == list(g)
            for k in f:
                assert numpy.array_equal(numpy.asarray(f[k]), numpy.asarray(g[k])), k


@needs_transformers
def test_every_feature_empty_is_the_same_error(client):
    for features in ([], [{"input_ids": []}, {"input_ids": []}]):
        with pytest.raises(ValueError) as theirs:
            TransformersCollator()(features)
        with pytest.raises(ValueError) as ours:
            DataCollatorWithFlattening(client=client)(features)
        assert str(ours.value) == str(theirs.value)


@needs_transformers
def test_labels_of_another_length_are_refused_where_transformers_misaligns(client):
    """The difference, on purpose: transformers concatenates a feature's labels whatever their
    length, so every later label sits beside another sequence's token; packd refuses."""
    features = [{"input_ids": [1, 2, 3], "labels": [7, 8]}, {"input_ids": [4, 5], "labels": [9, 6]}]
    theirs = TransformersCollator()(copy.deepcopy(features))
    assert theirs["labels"].shape != theirs["input_ids"].shape  # misaligned, silently
    with pytest.raises(ValueError, match="feature 0: 2 labels for 3 input_ids"):
        DataCollatorWithFlattening(client=client)(features)


@needs_transformers
@pytest.mark.parametrize("case", ["rows", "documents", "pad_multiple", "position_ids_start"])
def test_flash_attention_kwargs_transformers_derives_from_position_ids(client, case):
    """A transformers model given only position_ids (batch 1) finds the sequences itself
    (_is_packed_sequence, prepare_fa_kwargs_from_position_ids, what its flash-attention path
    calls): from packd's position ids it derives packd's cu_seqlens and max_seqlen exactly (per
    document with segment ids; with pad_multiple the padded ones, positions counting on through
    the padding)."""
    rng = random.Random()
    features = random_features(rng, with_labels=False)
    while len(features) < 2:
        features = random_features(rng, with_labels=False)
    if case == "documents":
        lengths = [rng.randint(1, 40) for _ in range(5)]
        mask = torch.zeros(5, 48, dtype=torch.bool)
        segments = torch.zeros(5, 48, dtype=torch.int64)
        for i, n in enumerate(lengths):
            mask[i, :n] = True
            cuts = sorted(rng.sample(range(1, 48), 3))
            for c in cuts:
                segments[i, c:] += 1
        r = client.pack(torch.randn(5, 48), mask, segment_ids=segments, with_position_ids=True,
                        cu_seqlens_dtype=torch.int32)
        position_ids, cu, longest = r.position_ids.view(1, -1), r.doc_cu_seqlens, r.doc_max_seqlen
    else:
        kwargs = {"pad_multiple": 8} if case == "pad_multiple" else {}
        if case == "position_ids_start":
            kwargs["position_ids_start"] = 2
        batch = DataCollatorWithFlattening(client=client, return_flash_attn_kwargs=True,
                                           **kwargs)(features)
        position_ids = batch["position_ids"]
        cu, longest = batch["cu_seq_lens_q"], batch["max_length_q"]
    assert bool(_is_packed_sequence(position_ids, batch_size=1)) == (len(cu) > 2)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    assert cu_q.dtype == torch.int32 and torch.equal(cu_q, cu.to(torch.int32)), case
    assert torch.equal(cu_k, cu_q)
    assert int(max_q) == int(max_k) == int(longest), case


@needs_transformers
def test_a_context_parallel_ranks_positions_do_not_give_its_sequences(client):
    """The other difference: with cp_size, a rank's position ids are its chunks' and do not
    restart at every sequence, so a model must be given the collator's cu_seq_lens (the whole
    padded sequences', as TransformerEngine takes them), never derive them from position_ids."""
    features = [{"input_ids": list(range(1, 11))}, {"input_ids": list(range(1, 7))}]
    batch = DataCollatorWithFlattening(client=client, return_flash_attn_kwargs=True,
                                       pad_multiple=4, cp_size=2, cp_rank=1)(features)
    (derived, _), _ = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert batch["cu_seq_lens_q"].tolist() == [0, 12, 20]
    assert not torch.equal(derived, batch["cu_seq_lens_q"])


def test_pad_multiple_and_cp_use_packds_layout(client):
    """The collator's batch equals the client's layout Pack of the dense features (layouts are
    tested against torch in test_layout.py): tokens, labels and seq_idx aligned."""
    rng = random.Random()
    features = random_features(rng, with_labels=True)
    collate = DataCollatorWithFlattening(client=client, return_flash_attn_kwargs=True,
                                         return_seq_idx=True, pad_multiple=8, cp_size=2,
                                         cp_rank=1, pad_token_id=3)
    got = collate(features)
    n = [len(f["input_ids"]) for f in features]
    F, S = len(features), max(n)
    ids = torch.full((F, S), 3, dtype=torch.int64)
    labels = torch.full((F, S), -100, dtype=torch.int64)
    mask = torch.zeros(F, S, dtype=torch.bool)
    for i, f in enumerate(features):
        ids[i, :n[i]] = torch.tensor(f["input_ids"])
        labels[i, 1:n[i]] = torch.tensor(f["labels"][1:])
        mask[i, :n[i]] = True
    r = client.pack([ids, labels], mask,
                    layout=packd.Layout(pad_multiple=8, pad_values=[3.0, -100.0], cp_size=2,
                                        cp_rank=1, with_seq_idx=True), with_position_ids=True)
    assert got["input_ids"].tolist() == [r.packed[0].tolist()]
    assert got["labels"].tolist() == [r.packed[1].tolist()]
    assert got["seq_idx"].dtype == torch.int32
    assert got["seq_idx"].tolist() == [r.seq_idx.tolist()]
    # Padding belongs to its feature: seq_idx never decreases (Mamba's kernels need that).
    seq = got["seq_idx"][0]
    assert bool((seq[1:] >= seq[:-1]).all())
    assert sorted(set(seq.tolist())) == list(range(F))
    assert got["position_ids"].tolist() == [r.position_ids.tolist()]
    assert got["cu_seq_lens_q"].dtype == torch.int32
    assert got["cu_seq_lens_q"].tolist() == r.cu_seqlens_padded.tolist()
    assert got["max_length_q"] == r.max_seqlen_padded
    # Each padded sequence is a multiple of 8; rank 1 holds half of each.
    padded = [-(-k // 8) * 8 for k in n]
    assert got["cu_seq_lens_q"].tolist() == [0] + torch.tensor(padded).cumsum(0).tolist()
    assert got["input_ids"].shape[1] == sum(padded) // 2


def test_bad_features_are_value_errors(client):
    collate = DataCollatorWithFlattening(client=client)
    with pytest.raises(ValueError, match="every example is empty"):
        collate([])
    with pytest.raises(ValueError, match="every example is empty"):
        collate([{"input_ids": []}])
    with pytest.raises(ValueError, match="feature 2: 1 labels for 2 input_ids"):
        collate([{"input_ids": [1], "labels": [1]}, {"input_ids": [], "labels": []},
                 {"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="return_tensors must be one of"):
        DataCollatorWithFlattening(return_tensors="tf")
    with pytest.raises(ValueError, match="return_tensors must be one of"):
        collate([{"input_ids": [1]}], return_tensors="jax")
