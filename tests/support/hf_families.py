"""transformers' model families as packd's tests build them (tests/python/test_varlen_attention.py,
tests/models): each from its config class at a tiny size (2 layers, hidden 32, vocab 128) with
random weights, in float64, no download; and the float32 steps transformers takes whatever the
model's dtype, kept in float64 with the same formulas so that a float64 model is float64 through
and through; and the mark of a test that needs transformers."""
import copy
import os
import sys

import torch

# The float64 steps are the examples' (examples/float64_check.py), which a user's --check runs.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from float64_check import ExactLogProb, Float64Steps, keep_float64  # noqa: E402,F401

try:
    import transformers
except ImportError:
    transformers = None

VOCAB = 128


def needs_transformers(why):
    """A skip mark for a test that needs transformers, which Debian 12 has no package of: `why`
    says what the PyPI stack's run does with it."""
    import pytest
    return pytest.mark.skipif(transformers is None, reason="transformers is not installed "
                              "(Debian 12 has no package of it); " + why)

# family: (config class, what it adds to a plain transformer)
FAMILIES = {
    "llama": ("LlamaConfig", {}),  # grouped-query attention
    "mistral": ("MistralConfig", {"sliding_window": 4}),
    "qwen2": ("Qwen2Config", {}),  # biased q, k, v projections
    "qwen3": ("Qwen3Config", {"head_dim": 8}),  # q and k norms
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": 4,
                                "attn_logit_softcapping": 50.0,
                                "final_logit_softcapping": 30.0,
                                "query_pre_attn_scalar": 8}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 4,
                                    "query_pre_attn_scalar": 8}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),  # MoE
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8,
                                     "moe_intermediate_size": 32}),  # routers, q and k norms
}


def config_of(family):
    import transformers
    name, extra = FAMILIES[family]
    return getattr(transformers, name)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)


def padded_and_packed(family):
    """(the family's model through eager attention, a copy through packd_varlen), float64, the
    experts in plain loops (the grouped matrix products take no float64)."""
    from transformers import AutoModelForCausalLM
    from packd.hf import register_varlen_attention
    register_varlen_attention()
    padded = AutoModelForCausalLM.from_config(config_of(family), attn_implementation="eager",
                                              experts_implementation="eager",
                                              dtype=torch.float64).eval()
    packed = copy.deepcopy(padded)
    packed.config._attn_implementation = "packd_varlen"
    return padded, packed


def relative(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))
