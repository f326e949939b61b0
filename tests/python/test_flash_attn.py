"""packd.flash_attn against flash-attn's own `flash_attn/bert_padding.py`: every returned value
equal, with its dtype, on 0/1 masks of every shape and dtype, hidden states of several tails; the
gradients of every function equal torch autograd's through the reference; the one documented
difference (a mask holding 2s) as documented; wrong shapes a ValueError.

The reference: on the PyPI stack, flash-attn 2.8.3's file itself (flash-attn ships only sources
that compile CUDA when installed, so deploy/pypi-venv.sh takes that file from its pinned source
archive into PACKD_PEERS_DIR); on Debian's, which has neither it nor einops, the transcription
below of flash-attn 2.8.3's flash_attn/bert_padding.py (einops' rearrange spelled with reshape).
test_the_reference_is_flash_attn_itself_where_it_can_be says which."""
import glob
import importlib.util
import os
import random

import pytest
import torch
import torch.nn.functional as F

import packd
from packd import flash_attn


# -- the transcription, for Debian's stack: flash-attn 2.8.3, flash_attn/bert_padding.py --------

def ref_unpad_input(hidden_states, attention_mask, unused_mask=None):
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def ref_unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    length = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.size(-1)
    attention_mask_2d = torch.arange(seqlen, device=length.device, dtype=length.dtype).expand(
        len(length), seqlen) < length.unsqueeze(1)
    real_indices_idx = torch.nonzero(attention_mask_in_length.flatten(), as_tuple=False).flatten()
    seqlens_in_batch = attention_mask_in_length.flatten()[real_indices_idx]
    indices = torch.nonzero(attention_mask_2d.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch


def ref_pad_input(hidden_states, indices, batch, seqlen):
    output = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    output[indices] = hidden_states
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


def _flash_attn_itself():
    """flash-attn's bert_padding module, loaded from PACKD_PEERS_DIR, or None."""
    found = sorted(glob.glob(os.path.join(os.environ.get("PACKD_PEERS_DIR", "/nonexistent"),
                                          "flash_attn-*", "bert_padding.py")))
    if not found:
        return None
    spec = importlib.util.spec_from_file_location("flash_attn_bert_padding", found[-1])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PEER = _flash_attn_itself()
if PEER is not None:
    ref_unpad_input = PEER.unpad_input
    ref_unpad_input_for_concatenated_sequences = PEER.unpad_input_for_concatenated_sequences
    ref_pad_input = PEER.pad_input


def test_the_reference_is_flash_attn_itself_where_it_can_be():
    """On the PyPI stack (PACKD_PEERS_DIR set) the reference must be flash-attn's own file: a
    missing file fails here rather than falling back to the transcription unseen."""
    if os.environ.get("PACKD_PEERS_DIR"):
        assert PEER is not None, f"no flash_attn-*/bert_padding.py in {os.environ['PACKD_PEERS_DIR']}"
        assert ref_unpad_input is PEER.unpad_input
    else:
        pytest.skip("Debian's stack: the transcription is the reference (no flash-attn, no einops)")


# -- helpers -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(address):
    with packd.Client(address, shared_memory=packd.SharedMemoryOptions(threshold_bytes=0)) as c:
        flash_attn.set_client(c)
        yield c
        flash_attn.set_client(None)


def same(a, b):
    """Equal values, dtype and shape (ints: ==; tensors: bit for bit)."""
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), type(a)
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (a, b)
        assert torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b)
    else:
        assert type(a) is type(b) and a == b, (a, b)


MASK_DTYPES = [torch.bool, torch.int32, torch.int64, torch.uint8, torch.float32]
SHAPES = [(1, 1), (1, 7), (3, 5), (4, 64), (2, 129), (9, 3)]


def random_mask(rng, B, S, dtype, kind):
    if kind == "prefix":
        lengths = [rng.randint(1, S) for _ in range(B)]  # flash-attn's max needs a token
        m = torch.tensor([[s < n for s in range(S)] for n in lengths])
    elif kind == "left":
        lengths = [rng.randint(1, S) for _ in range(B)]
        m = torch.tensor([[s >= S - n for s in range(S)] for n in lengths])
    else:
        m = torch.rand(B, S, generator=torch.Generator().manual_seed(rng.randint(0, 1 << 30))) < 0.5
        m[0, 0] = True
    return m.to(dtype)


# -- the tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["prefix", "left", "holes"])
def test_unpad_input_equals_flash_attn(client, shape, kind):
    rng = random.Random()
    B, S = shape
    for i, dtype in enumerate(MASK_DTYPES):
        mask = random_mask(rng, B, S, dtype, kind)
        tail = [(), (3,), (2, 5)][i % 3]
        hidden = torch.randn(B, S, *tail, dtype=torch.float64)
        if not tail:  # flash-attn needs a tail; packd does not
            got = flash_attn.unpad_input(hidden, mask)
            same(got[0], hidden[mask != 0])
            continue
        got = flash_attn.unpad_input(hidden, mask)
        want = ref_unpad_input(hidden, mask)
        assert len(got) == 5
        for g, w in zip(got, want):
            same(g, w)


def test_unused_mask_is_packed_but_not_in_seqused(client):
    rng = random.Random()
    for B, S in SHAPES:
        used = random_mask(rng, B, S, torch.int32, "holes")
        unused = (torch.rand(B, S) < 0.3).to(torch.int32) * (1 - used)
        hidden = torch.randn(B, S, 4)
        for g, w in zip(flash_attn.unpad_input(hidden, used, unused),
                        ref_unpad_input(hidden, used, unused)):
            same(g, w)


@pytest.mark.parametrize("shape", SHAPES)
def test_pad_input_inverts_unpad_and_equals_flash_attn(client, shape):
    rng = random.Random()
    B, S = shape
    mask = random_mask(rng, B, S, torch.bool, rng.choice(["prefix", "holes"]))
    hidden = torch.randn(B, S, 6, dtype=torch.bfloat16)
    unpadded, indices, *_ = flash_attn.unpad_input(hidden, mask)
    same(flash_attn.pad_input(unpadded, indices, B, S), ref_pad_input(unpadded, indices, B, S))
    # Indices in any order, as flash-attn allows, give the same result.
    order = torch.randperm(indices.numel())
    same(flash_attn.pad_input(unpadded[order], indices[order], B, S),
         ref_pad_input(unpadded[order], indices[order], B, S))


def test_concatenated_sequences_equal_flash_attn(client):
    rng = random.Random()
    for B, S in SHAPES + [(3, 6), (5, 40)]:
        rows = []
        for _ in range(B):
            lengths, room = [], S
            while room > 0 and rng.random() < 0.8:
                n = rng.randint(1, room)
                lengths.append(n)
                room -= n
            if not lengths:
                lengths = [rng.randint(1, S)]
            rows.append(lengths + [0] * (S - len(lengths)))
        in_length = torch.tensor(rows, dtype=torch.int32)
        hidden = torch.randn(B, S, 3, dtype=torch.float16)
        got = flash_attn.unpad_input_for_concatenated_sequences(hidden, in_length)
        want = ref_unpad_input_for_concatenated_sequences(hidden, in_length)
        assert len(got) == 4
        for g, w in zip(got, want):
            same(g, w)
    # flash-attn's own worked example.
    example = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    _, indices, cu, longest = flash_attn.unpad_input_for_concatenated_sequences(
        torch.zeros(3, 6, 1), example)
    assert cu.tolist() == [0, 2, 5, 8, 10, 16] and longest == 6
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 17]


def test_gradients_equal_torch_autograd_through_the_reference(client):
    rng = random.Random()
    for B, S in SHAPES:
        mask = random_mask(rng, B, S, torch.bool, "holes")
        x = torch.randn(B, S, 5, dtype=torch.float64, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_(True)
        unpadded, indices, *_ = flash_attn.unpad_input(x, mask)
        weight = torch.randn(unpadded.shape, dtype=torch.float64)
        padded = flash_attn.pad_input(unpadded * weight, indices, B, S)
        ref_unpadded, ref_indices, *_ = ref_unpad_input(x_ref, mask)
        ref_padded = ref_pad_input(ref_unpadded * weight, ref_indices, B, S)
        upstream = torch.randn(B, S, 5, dtype=torch.float64)
        (padded * upstream).sum().backward()
        (ref_padded * upstream).sum().backward()
        same(x.grad, x_ref.grad)


def test_a_mask_of_twos_counts_each_position_once(client):
    """The documented difference: flash-attn's cu_seqlens would count the 2 twice."""
    mask = torch.tensor([[1, 2, 0], [0, 1, 1]])
    _, indices, cu, longest, seqused = flash_attn.unpad_input(torch.zeros(2, 3, 1), mask)
    assert indices.tolist() == [0, 1, 4, 5]
    assert cu.tolist() == [0, 2, 4] and longest == 2 and seqused.tolist() == [2, 2]
    assert ref_unpad_input(torch.zeros(2, 3, 1), mask)[2].tolist() == [0, 3, 5]


def test_wrong_shapes_are_value_errors(client):
    with pytest.raises(ValueError, match="attention_mask"):
        flash_attn.unpad_input(torch.zeros(2, 3, 4), torch.ones(3, 2))
    with pytest.raises(ValueError, match="indices"):
        flash_attn.pad_input(torch.zeros(3, 4), torch.arange(2), 1, 4)
