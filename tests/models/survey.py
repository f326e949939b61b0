"""Every causal-LM model type of the installed transformers at a tiny size, as the survey
(test_survey.py) builds it: the type's default config with its sizes made small (2 or 3 layers,
one of each layer type it mixes; hidden 32; 4 heads over 2; vocabulary 128; sliding windows and
attention chunks of 4 tokens, shorter than the survey's documents), from its config class
alone: random weights, no download."""
import re
import warnings

import torch

try:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError:  # Debian's stack: test_survey.py skips, saying so
    transformers = None
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}

VOCAB = 128
WINDOW = 4  # sliding windows and attention chunks, in tokens

# Sizes set to exactly these values wherever a config has them.
EXACT = {
    "vocab_size": VOCAB, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
    "n_positions": 128, "n_ctx": 128, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2,
    "n_shared_experts": 1, "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4, "v_head_dim": 8, "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW, "rotary_dim": 4}
# Per type, what the generic shrinking misses: layer-type lists that keep a layer of each kind,
# the sub-module shapes of Mamba 2 mixers (heads x head size = expand x hidden) and of routers
# (no more experts per token than experts), and indexers that choose.
RULES = {
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1, "state_size": 16,
               "chunk_size": 64},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
              "mamba_chunk_size": 64},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
                         "mamba_chunk_size": 64},
    "zamba2": {"n_mamba_heads": 4, "mamba_headdim": 16, "mamba_d_state": 16,
               "attention_head_dim": 8, "num_query_groups": 4, "chunk_size": 64},
    # Mamba 2 scans in chunks of 64 (documents of 63, 64 and 65 tokens straddle them), which
    # also bounds the reference scan's [chunk, chunk] blocks.
    "falcon_h1": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64,
                  "mamba_d_state": 16, "mamba_chunk_size": 64},
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
                   "n_groups": 1, "chunk_size": 64},
    "kimi_linear": {"num_experts_per_token": 2, "linear_num_heads": 4, "linear_head_dim": 8},
    # Multi-head latent attention: the rotary part's width is head_dim, a head's query and key
    # nope + rope; expert groups that divide the experts.
    "deepseek_v3": {"head_dim": 4, "qk_head_dim": 8, "n_group": 1, "topk_group": 1},
    "youtu": {"head_dim": 4, "qk_head_dim": 8, "n_group": 1, "topk_group": 1},
    "axk1": {"head_dim": 4, "qk_head_dim": 8, "n_group": 1, "topk_group": 1},
    "deepseek_v2": {"qk_head_dim": 8, "num_experts_per_tok": 2},
    # Defaults left to be derived (None): given.
    "hunyuan_v1_dense": {"head_dim": 8}, "hunyuan_v1_moe": {"head_dim": 8},
    "ministral": {"head_dim": 8}, "nemotron": {"num_key_value_heads": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "plbart": {"encoder_attention_heads": 4, "decoder_attention_heads": 4},
    "whisper": {"encoder_attention_heads": 4, "decoder_attention_heads": 4},
    "reformer": {"is_decoder": True},
    "beam": {"n_group": 1, "topk_group": 1},
    "bailing_hybrid": {"num_expert_group": 1, "topk_group": 1, "num_experts_per_token": 2},
    # An indexer that picks fewer keys than a document has: its top-k choice is exercised.
    "deepseek_v32": {"index_topk": 4}, "glm_moe_dsa": {"index_topk": 4},
    "hy_v4": {"index_topk": 4}, "axk2": {"index_topk": 4},
}
LAYERS = r"(num_hidden_layers|n_layers?|num_layers|decoder_layers|encoder_layers|depth)"
WIDTH = r"(hidden_size|n_embd|d_model|embed_dim|hidden_dim|dim)$"
INNER = r"(intermediate|ffn|d_ff|n_inner|mlp)"


def causal_lm_types():
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _kept_layers(values):
    """The layers kept: the first of each layer type (at most 3), else the first two."""
    n = next((values[k] for k in ("num_hidden_layers", "n_layer", "num_layers")
              if isinstance(values.get(k), int)), None)
    types = values.get("layer_types")
    if isinstance(types, (list, tuple)) and n and len(types) == n:
        keep = []
        for i, t in enumerate(types):
            if t not in [types[j] for j in keep]:
                keep.append(i)
        return n, (keep[:3] if len(keep) > 1 else list(range(min(n, 2))))
    return n, (list(range(2)) if n and n > 2 else None)


def _small(config):
    """Keyword arguments that make `config`'s class small (sub-configs made small as dicts)."""
    values = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    n, keep = _kept_layers(values)
    out = {}
    for k, v in values.items():
        if isinstance(v, PretrainedConfig):
            out[k] = {**v.to_dict(), **_small(v)}
        elif (isinstance(v, (list, tuple)) and keep is not None and len(v) == n
              and k not in ("architectures",)):
            out[k] = [v[i] for i in keep]
        elif isinstance(v, int) and not isinstance(v, bool):
            new = None
            if k in EXACT:
                new = EXACT[k]
            elif re.fullmatch(LAYERS, k):
                new = len(keep) if keep is not None and v == n else min(v, 2)
            elif re.search(WIDTH, k) and v > 32:
                new = 32
            elif re.search(INNER, k) and v > 64:
                new = 64
            if new is not None and new != v:
                out[k] = new
    layers = config.to_dict().get("per_layer_config") if "num_hidden_layers" in values else None
    if isinstance(layers, dict) and keep is not None:
        # Per-layer overrides, keyed by layer index: those of the kept layers, re-indexed, with
        # a head size of their own (twice the others') so that they stay per layer.
        out["per_layer_config"] = {
            "%0*d" % (len(k), keep.index(int(k))): {
                name: 2 * EXACT["head_dim"] if name == "head_dim" else value
                for name, value in v.items()}
            for k, v in layers.items() if k.isdigit() and int(k) in keep}
    if "vocab_size_per_layer_input" in values:  # Gemma's per-layer token embeddings
        out["vocab_size_per_layer_input"] = VOCAB
        out["hidden_size_per_layer_input"] = 8
    if "kv_lora_rank" in values:  # multi-head latent attention: as many key heads as query
        out["num_key_value_heads"] = EXACT["num_attention_heads"]
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(values.get(token), int) and values[token] >= VOCAB:
            out[token] = 0
    out.update({k: v for k, v in RULES.get(getattr(config, "model_type", None), {}).items()
                if k in values})
    return out


def _set_small(config, seen):
    """The same sizes set on a built config in place (for classes whose constructor refuses
    the keyword form)."""
    if id(config) in seen:
        return
    seen.add(id(config))
    small = _small(config)
    for k, v in small.items():
        sub = getattr(config, k, None)
        if isinstance(sub, PretrainedConfig):
            _set_small(sub, seen)
            continue
        try:
            setattr(config, k, v)
        except Exception:  # a read-only property: left as it is
            pass


def tiny_model(model_type, attn_implementation):
    """The type's causal LM at a tiny size in float64 (every parameter and buffer, the modules
    the family keeps in float32 too), eval mode: its config class's defaults, made small by
    keyword (or, where the class refuses that, in place)."""
    default = AutoConfig.for_model(model_type)
    errors = []
    for make in (lambda: type(default)(**{**default.to_dict(), **_small(default)}),
                 lambda: _in_place(AutoConfig.for_model(model_type))):
        try:
            config = make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = AutoModelForCausalLM.from_config(
                    config, attn_implementation=attn_implementation,
                    experts_implementation="eager", dtype=torch.float64)
            return model.double().eval()  # the modules kept in float32 too
        except Exception as e:  # the next way, or the reason it cannot be built
            errors.append(e)
    raise errors[-1]


def _in_place(config):
    _set_small(config, set())
    return config


def logits_of(output):
    return output.logits if hasattr(output, "logits") else output[0]


def logits_and_grads(model, weights, **call):
    """The model's logits of one row and every trainable parameter's gradient of the weighted
    sum (weights [tokens, vocabulary]); zeros for a parameter the row does not reach."""
    logits = logits_of(model(**call))[0]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((logits * weights).sum(), params, allow_unused=True)
    return logits.detach(), [torch.zeros_like(p) if g is None else g
                             for g, p in zip(grads, params)]


def packed_and_alone(packed, alone, result, documents, weights):
    """(logits, gradients) of `packed` on a Pack's row of the documents (packd.hf.packed_row),
    and of `alone` on each document by itself (logits in order, gradients summed)."""
    from packd.hf import packed_row
    with packed_row(result, packed) as kwargs:
        got = logits_and_grads(packed, weights, input_ids=result.packed[0][None], **kwargs)
    want, want_grads, start = [], None, 0
    for d in documents:
        logits, grads = logits_and_grads(alone, weights[start:start + len(d)],
                                         input_ids=torch.tensor(d)[None], use_cache=False)
        want.append(logits)
        want_grads = grads if want_grads is None else [a + b for a, b in zip(want_grads, grads)]
        start += len(d)
    return got, (torch.cat(want), want_grads)
