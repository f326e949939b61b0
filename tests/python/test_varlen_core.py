"""packd_varlen's own rules, without transformers (so on Debian's torch 1.13 as on PyPI's
torch 2): a declared packed row whose sequences reach no source is refused naming the module,
options it does not compute are refused by name, and attention sinks follow the eager formula.
test_varlen_attention.py checks it against transformers' models."""
import pytest
import torch

from hf_families import relative


def test_a_row_whose_sequences_reach_no_source_is_refused_naming_the_module():
    """A declared packed row (packd.hf.packed_row) whose attention receives neither kwargs,
    position ids nor a mask: a ValueError naming the module, never one long sequence."""
    from packd.integrations.documents import declared_sequences
    from packd.integrations.varlen import varlen_attention
    module = torch.nn.Module()
    q = torch.randn(1, 2, 7, 4, dtype=torch.float64)
    with declared_sequences([(0, 3), (3, 7)]):
        with pytest.raises(ValueError, match=r"Module.*2 sequences.*no source.*token 3"):
            varlen_attention(module, q, q, q, None)
    # Undeclared, the same call is one sequence (a plain unpacked row).
    out, _ = varlen_attention(module, q, q, q, None)
    scores = (q @ q.transpose(-1, -2)) * 4 ** -0.5
    scores = scores.masked_fill(~torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))
    want = torch.softmax(scores, -1) @ q
    assert relative(out, want.transpose(1, 2)) <= 1e-12


def test_options_it_does_not_compute_are_refused_by_name():
    from packd.integrations.varlen import varlen_attention
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="position_bias="):
        varlen_attention(torch.nn.Module(), q, q, q, None, position_bias=torch.zeros(1))


def test_attention_sinks_are_the_eager_formulas():
    """gpt-oss's sinks: each head's learned logit joins the softmax and attends to nothing."""
    from packd.integrations.varlen import varlen_attention
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, dtype=torch.float64)
    out, _ = varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.5, s_aux=sinks,
                              position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    for s in (0, 3):
        scores = (q[0, :, s:s + 3] @ k[0, :, s:s + 3].transpose(-1, -2)) * 0.5
        scores = scores.masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(), float("-inf"))
        logits = torch.cat([scores, sinks[:, None, None].expand(2, 3, 1)], -1)
        probs = torch.softmax(logits, -1)[..., :-1]
        assert relative(out[0, s:s + 3], (probs @ v[0, :, s:s + 3]).transpose(0, 1)) <= 1e-12
