"""packd.hf.DataCollatorWithFlattening against a reference written from transformers' published
DataCollatorWithFlattening: every key, value and dtype, with and without labels, position ids,
flash-attention kwargs and seq_idx, as torch tensors and as numpy arrays, on random features;
the pad_multiple and cp_size extensions against packd's own layout of the same batch; bad
features a ValueError."""
import random

import numpy
import pytest
import torch

import packd
from packd.hf import DataCollatorWithFlattening


def reference(features, return_position_ids=True, separator_id=-100,
              return_flash_attn_kwargs=False, return_seq_idx=False, return_tensors="pt"):
    """transformers' __call__: torch tensors ("pt") or numpy arrays ("np") of the same
    dtypes."""
    is_labels_provided = "labels" in features[0]
    batch = {"input_ids": [], "labels": []}
    if return_position_ids:
        batch["position_ids"] = []
    if return_seq_idx:
        batch["seq_idx"] = []
    cu_seq_lens, max_length = [0], 0
    for seq_idx, sample in enumerate(features):
        input_ids = sample["input_ids"]
        batch["input_ids"] += input_ids
        if is_labels_provided:
            batch["labels"] += [separator_id] + sample["labels"][1:]
        else:
            batch["labels"] += [separator_id] + input_ids[1:]
        if return_position_ids:
            batch["position_ids"] += list(range(len(input_ids)))
        if return_seq_idx:
            batch["seq_idx"] += [seq_idx for _ in range(len(input_ids))]
        cu_seq_lens.append(cu_seq_lens[-1] + len(input_ids))
        max_length = max(max_length, len(input_ids))
    if return_flash_attn_kwargs:
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu_seq_lens
        batch["max_length_q"] = batch["max_length_k"] = max_length
    out = {}
    for k, v in batch.items():
        if k in {"labels", "position_ids", "input_ids", "seq_idx"}:
            v = [v]
        wide = k in {"labels", "position_ids", "input_ids"}
        if k in {"max_length_q", "max_length_k"}:
            out[k] = v
        elif return_tensors == "np":
            out[k] = numpy.array(v, dtype=numpy.int64 if wide else numpy.int32)
        else:
            out[k] = torch.tensor(v, dtype=torch.int64 if wide else torch.int32)
    return out


@pytest.fixture(scope="module")
def client(address):
    with packd.Client(address, shm_threshold_bytes=0) as c:
        yield c


def random_features(rng, with_labels):
    features = []
    for _ in range(rng.randint(1, 9)):
        n = rng.randint(1, 70)
        f = {"input_ids": [rng.randint(0, 50000) for _ in range(n)]}
        if with_labels:
            f["labels"] = [rng.choice([-100, rng.randint(0, 50000)]) for _ in range(n)]
        features.append(f)
    return features


def same_batch(got, want):
    assert list(got) == list(want)
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        elif isinstance(want[k], numpy.ndarray):
            assert isinstance(got[k], numpy.ndarray), k
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
            assert numpy.array_equal(got[k], want[k]), k
        else:
            assert type(got[k]) is int and got[k] == want[k], k


@pytest.mark.parametrize("trial", range(16))
@pytest.mark.parametrize("return_tensors", ["pt", "np"])
def test_equals_transformers(client, trial, return_tensors):
    rng = random.Random()
    kwargs = {"return_position_ids": trial % 2 == 0, "separator_id": rng.choice([-100, 0, 7]),
              "return_flash_attn_kwargs": trial % 4 < 2, "return_seq_idx": trial % 8 < 4}
    features = random_features(rng, with_labels=trial % 3 == 0)
    if trial % 2:  # in the constructor, else in the call
        got = DataCollatorWithFlattening(client=client, return_tensors=return_tensors,
                                         **kwargs)(features)
    else:
        got = DataCollatorWithFlattening(client=client, **kwargs)(
            features, return_tensors=return_tensors)
    same_batch(got, reference(features, return_tensors=return_tensors, **kwargs))


def test_transformers_own_numpy_case(client):
    """transformers' test_data_collator_with_flattening, in its numpy form."""
    features = [{"input_ids": [10, 11, 12]}, {"input_ids": [20, 21, 22, 23, 24, 25]},
                {"input_ids": [30, 31, 32, 33, 34, 35, 36]}]
    batch = DataCollatorWithFlattening(client=client, return_tensors="np")(features)
    for unexpected in ["attention_mask", "cu_seq_lens_k", "cu_seq_lens_q", "max_length_k",
                       "max_length_q", "seq_idx"]:
        assert unexpected not in batch
    assert batch["input_ids"].shape == (1, 16)
    assert batch["input_ids"][0].tolist() == [10, 11, 12, 20, 21, 22, 23, 24, 25, 30, 31, 32,
                                              33, 34, 35, 36]
    assert batch["position_ids"].shape == (1, 16)
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6]
    assert batch["labels"][0].tolist() == [-100, 11, 12, -100, 21, 22, 23, 24, 25, -100, 31, 32,
                                           33, 34, 35, 36]


def test_a_separator_given_to_the_call_wins(client):
    features = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}]
    got = DataCollatorWithFlattening(client=client)(features, separator_id=-1)
    assert got["labels"].tolist() == [[-1, 2, 3, -1, 5]]
    assert got["position_ids"].tolist() == [[0, 1, 2, 0, 1]]


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
    r = client.pack([ids, labels], mask, pad_multiple=8, pad_values=[3.0, -100.0],
                    cp_size=2, cp_rank=1, with_position_ids=True, with_seq_idx=True)
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
    with pytest.raises(ValueError, match="no features"):
        collate([])
    with pytest.raises(ValueError, match="no input_ids"):
        collate([{"input_ids": [1]}, {"input_ids": []}])
    with pytest.raises(ValueError, match="labels"):
        collate([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="return_tensors must be one of"):
        DataCollatorWithFlattening(return_tensors="tf")
    with pytest.raises(ValueError, match="return_tensors must be one of"):
        collate([{"input_ids": [1]}], return_tensors="jax")
